"""Benchmark: DFlash drafter training throughput (Qwen3-8B dims) on one GPU, and on two through torchrun.

Measures the library's own training step (`dflash_assets.drafter.loss.train_step`: block layout,
flex_attention BlockMask built once per step, 5-layer drafter under bf16 autocast, frozen target
head with the chunked cross-entropy, backward, grad clip, fused AdamW) on synthetic data resident
on the GPU: Qwen3-8B dims (H 4096, 32 heads, 8 KV heads, head_dim 128, MLP 12288, vocab 151,936,
5 captured layers), random frozen embeddings and head, block 16, sequence 3072, 512 anchors.
Reports tokens/s (sequence tokens), step time, peak memory, a per-phase breakdown and MFU against
a bf16 matmul peak measured in the same run; compares with SpecForge's trainer (14.0K / 15.7K /
16.6K tok/s at batch 1 / 2 / 4 on the same GPU). `--quick` runs tiny shapes on CPU.

`--varied` also trains on samples of varied lengths (long-tailed like chat data: mean ~390 tokens,
at most 2,048; see `varied_lengths`), collated by the library's `collate` as training does, in
the padded layout (one row per sample, padded to the longest) and the packed one (all samples'
blocks and context in one row) in the same run: tokens/s, MFU over real tokens' FLOPs, the padded
shares and the widths each layout met; `--varied-eager` adds the packed batches run eagerly, the peer of the
compiled step; `--profile` with them profiles a few packed steps (the kernels the step's time goes to).
The flex attention tiles are those training runs with (`torch_compile.drafter_flex_kernel_options`: named for
this GPU and head size, else flex's own); `--flex-kernel-options` sets others (`'{}'`: flex's own, the peer of
the named ones) and `--compile-mode` (e.g. max-autotune) another compile mode of the layers.

Reads nothing; prints one JSON object on stdout (progress on stderr) and, with --out, writes it.
Needs only torch (+ triton on GPU), numpy, safetensors. See BENCHMARKS.md.

    python bench/drafter_training.py                       # H200: batch 1, 2, 4 (+ 2 GPUs if present)
    python bench/drafter_training.py --dims smollm2-135m --batch-sizes 48 --seq 512 --anchors 384 --profile
    python bench/drafter_training.py --dims smollm2-135m --batch-sizes 48 --anchors 384 --varied-only
    python bench/drafter_training.py --quick               # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from bench.machine import gpu_info, machine_info  # noqa: E402
from dflash_assets.target_model.conventions import dflash_target_layer_ids  # noqa: E402
from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, TargetHead  # noqa: E402
from dflash_assets.drafter.data import Batch, Sample, collate, sample_anchors  # noqa: E402
from dflash_assets.drafter.loss import dflash_block_mask, drafter_forward_loss, head_cross_entropy, train_step  # noqa: E402
from dflash_assets.torch_compile import drafter_flex_kernel_options, set_flex_kernel_options  # noqa: E402

SPECFORGE_TOK_S = {1: 14_000, 2: 15_700, 4: 16_600}  # SpecForge's own trainer, one H200 (BENCHMARKS.md, drafter)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151_936, num_target_layers=36, mask_token_id=151_669)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49_152, num_target_layers=30, mask_token_id=49_151)  # the GPU study's target
DIMS = {"qwen3-8b": QWEN3_8B, "smollm2-135m": SMOLLM2_135M}
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=1024, num_target_layers=8, mask_token_id=1023)

FLOP_FORMULA = (
    "per step, 2 FLOPs per multiply-add: trainable matmuls x3 (forward, grad-input, grad-weight): "
    "block tokens (b*N*B) x layers x (q,o: 2*H*nh*hd + k,v: 2*H*nkv*hd + MLP: 3*H*I), plus context tokens "
    "(b*S) x layers x k,v (2*H*nkv*hd); fc x2 (forward, grad-weight; its input needs no grad): b*S*n*H*H; "
    "frozen lm_head x2 (forward, grad-input): rows x H x V with rows = labelled block positions; "
    "attention x3 (forward, 2x backward): layers x sum over blocks of B*(anchor+B) visible keys x nh*hd x 2 "
    "(QK^T and PV). Embedding lookups, norms, RoPE, softmax and the optimizer are not counted. Only real "
    "tokens count: kept blocks, real context tokens, labelled rows, each block's own keys and context before "
    "its anchor; padding (blocks, context slots, masked keys) is computed but not counted."
)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def drafter_config(dims: dict, layers: int, block: int) -> DrafterConfig:
    d = dict(dims)
    L = d.pop("num_target_layers")
    return DrafterConfig(**d, target_layer_ids=dflash_target_layer_ids(L, 5), num_target_layers=L,
                         num_hidden_layers=layers, block_size=block)


def make_batch(b: int, S: int, N: int, cfg: DrafterConfig, device, dtype, rng: np.random.Generator) -> Batch:
    """Random tokens, a 10% prompt without loss, N random anchors per sequence, random target features."""
    B, H, n = cfg.block_size, cfg.hidden_size, len(cfg.target_layer_ids)
    lm = np.ones(S, dtype=bool)
    lm[: S // 10] = False
    anchors = np.stack([sample_anchors(lm, B, N, rng) for _ in range(b)])
    return Batch(
        input_ids=torch.from_numpy(rng.integers(0, cfg.vocab_size - 1, (b, S))).to(device),
        loss_mask=torch.from_numpy(np.tile(lm, (b, 1))).to(device),
        hidden=torch.randn(b, S, n * H, device=device, dtype=dtype),
        anchors=torch.from_numpy(anchors).to(device),
        keep=torch.ones(b, anchors.shape[1], dtype=torch.bool, device=device),
        num_tokens=b * S,
    )


def step_flops(cfg: DrafterConfig, batch: Batch) -> dict[str, float]:
    """FLOPs of one step over the batch's real tokens (`FLOP_FORMULA`), in either layout."""
    H, I, L, B = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.block_size
    nh, nkv, hd, V, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, len(cfg.target_layer_ids)
    keep, anchors = batch.keep.cpu(), batch.anchors.cpu()
    rows_of = batch.block_sample.cpu() if batch.packed else torch.arange(keep.shape[0])[:, None].expand_as(keep)
    lm = batch.loss_mask.cpu()
    at = (anchors[keep][:, None] + torch.arange(1, B)).clamp(max=lm.shape[1] - 1)
    rows = int(lm[rows_of[keep][:, None], at].sum())  # labelled block positions
    tq = int(keep.sum()) * B  # real block tokens
    ctx = batch.num_tokens  # real context tokens
    visible = float((anchors[keep].float() + B).sum()) * B  # (query, key) pairs per head and layer
    return {
        "drafter_linear": 3 * 2 * L * (tq * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I) + ctx * 2 * H * nkv * hd),
        "fc": 2 * 2 * ctx * n * H * H,
        "lm_head": 2 * 2 * rows * H * V,
        "attention": 3 * 2 * L * visible * nh * hd * 2,
    }


def matmul_peak(device, quick: bool) -> float:
    """bf16 (CPU: fp32) matmul throughput in FLOP/s, best of a few timed runs."""
    n, dtype, iters = (512, torch.float32, 5) if quick else (8192, torch.bfloat16, 30)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            c = a @ b
        _sync(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t))
    del c
    return best


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def build(cfg: DrafterConfig, device, compile_layers: bool, world: int, mode: str | None = None):
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    V, H = cfg.vocab_size, cfg.hidden_size
    head = TargetHead(torch.randn(V, H, device=device, dtype=dtype, generator=g) * 0.02,
                      torch.randn(V, H, device=device, dtype=dtype, generator=g) * 0.02)
    if compile_layers:
        for layer in drafter.layers:
            layer.compile(mode=mode)
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[torch.device(device).index] if torch.device(device).type == "cuda" else None,
            broadcast_buffers=False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, **({"fused": True} if torch.device(device).type == "cuda" else {}))
    return drafter, model, head, opt


def run_batch_size(b: int, args, cfg: DrafterConfig, device, world: int = 1) -> dict:
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rng = np.random.default_rng(b)
    batches = [make_batch(b, args.seq, args.anchors, cfg, device, dtype, rng) for _ in range(3)]
    kw = dict(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=7.0, attention=args.attention,
              grad_clip=1.0, compiled_loss=args.compile, world=world)
    drafter, model, head, opt = build(cfg, device, args.compile, world, args.compile_mode)

    def step(i):
        bt = batches[i % len(batches)]
        return train_step(model, head, opt, bt, bt.hidden, **kw)

    t0 = time.perf_counter()
    for i in range(args.warmup):
        stats, w = step(i)
    _sync(device)
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        stats, w = step(i)
        _sync(device)
        times.append(time.perf_counter() - t)
    if world > 1:
        dist.all_reduce(stats)  # w is already the global weight
    loss = float(stats[0].cpu() / w.cpu())
    step_s = float(np.median(times))
    flops = step_flops(cfg, batches[0])
    res = {
        "batch_size": b, "world_size": world, "seq_len": args.seq, "anchors": args.anchors,
        "step_s_median": step_s, "step_s_min": float(np.min(times)), "step_s_max": float(np.max(times)),
        "tokens_per_s": world * b * args.seq / step_s,
        "flops_per_step": sum(flops.values()) * world, "flops_breakdown_per_rank": flops,
        "achieved_tflops_per_gpu": sum(flops.values()) / step_s / 1e12,
        "warmup_s": warm_s, "loss": loss,
    }
    if cuda:
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.breakdown and world == 1:
        res["breakdown_ms"] = breakdown(model, head, opt, batches[0], cfg, device, kw)
    if args.profile and world == 1:
        res["profile"] = profile_steps(step, device)
    del drafter
    model = head = opt = batches = None  # free them (a `del` leaves names undefined for step())
    if cuda:
        torch.cuda.empty_cache()
    return res


def breakdown(model, head, opt, batch: Batch, cfg, device, kw) -> dict[str, float]:
    """Milliseconds of the parts of one step (each synchronized; the sum exceeds a real step a little)."""
    cuda = torch.device(device).type == "cuda"
    B = cfg.block_size

    def timed(fn, reps=3):
        fn()
        _sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            out = fn()
        _sync(device)
        return (time.perf_counter() - t) / reps * 1e3, out

    res = {}
    if kw["attention"] == "flex":
        res["block_mask"], _ = timed(lambda: dflash_block_mask(batch.anchors, batch.keep, batch.input_ids.shape[1], B))

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            return drafter_forward_loss(model, head, batch, block_size=B, mask_token_id=cfg.mask_token_id, gamma=7.0,
                                        attention=kw["attention"], compiled_loss=kw["compiled_loss"])

    res["forward_incl_loss"], so = timed(fwd)

    def fwd_bwd():
        so = fwd()
        (so.loss_sum / so.weight_sum).backward()

    res["forward_backward"], _ = timed(fwd_bwd)
    params = [p for g in opt.param_groups for p in g["params"]]
    res["clip_and_adamw"], _ = timed(lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0), opt.step()))
    opt.zero_grad(set_to_none=True)
    M = int(so.count_by_pos.sum())
    h = torch.randn(M, cfg.hidden_size, device=device, dtype=head.lm_head.weight.dtype, requires_grad=True)
    y = torch.randint(0, cfg.vocab_size, (M,), device=device)
    w = torch.ones(M, device=device)

    def ce():
        loss, _ = head_cross_entropy(h, head.lm_head.weight, y, w, compiled=kw["compiled_loss"])
        loss.backward()

    res["lm_head_ce_fwd_bwd"], _ = timed(ce)
    return {k: round(v, 3) for k, v in res.items()}


def profile_steps(step, device, steps: int = 3, top: int = 25) -> dict:
    """torch.profiler over `steps` steps (the library's `drafter.step_profile.StepProfiler`, as training's
    `profile_steps` runs it): the wall time, the device's busy time and the kernels that take it, top `top`."""
    from dflash_assets.drafter.step_profile import StepProfiler

    profiler = StepProfiler(0, steps, torch.device(device), top=top)
    for i in range(steps):
        profiler.before_step(i + 1)
        step(i)
        profiler.after_step(i + 1)
    summary = profiler.summary()
    return {"wall_ms_per_step": summary["wall_ms_per_step"], "busy_ms_per_step": summary["busy_ms_per_step"],
            "top": summary["kernels"]}


def check_attention_paths(cfg: DrafterConfig, device, quick: bool) -> dict[str, float]:
    """Loss and gradients of the flex BlockMask path against the SDPA bool-mask path, same weights and
    batch, bf16 autocast on GPU: relative differences (bf16 rounding is ~1e-3..1e-2)."""
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        return {"skipped": "flex has no CPU backward"}
    S, N = (256, 16) if quick else (1024, 64)
    batch = make_batch(2, S, N, cfg, device, torch.bfloat16, np.random.default_rng(7))
    drafter, model, head, _ = build(cfg, device, False, 1)
    out = {}
    for attn in ("sdpa", "flex"):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            so = drafter_forward_loss(drafter, head, batch, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                      gamma=7.0, attention=attn)
        (so.loss_sum / so.weight_sum).backward()
        out[attn] = (float(so.loss_sum.detach() / so.weight_sum), torch.cat([p.grad.float().flatten() for p in drafter.parameters()]))
    g_s, g_f = out["sdpa"][1], out["flex"][1]
    res = {"loss_sdpa": out["sdpa"][0], "loss_flex": out["flex"][0],
           "loss_rel_diff": abs(out["flex"][0] - out["sdpa"][0]) / abs(out["sdpa"][0]),
           "grad_rel_diff": float((g_f - g_s).norm() / g_s.norm())}
    del drafter, model, head, out, g_s, g_f, batch
    torch.cuda.empty_cache()
    return res


def varied_samples(n: int, cfg: DrafterConfig, max_len: int, rng: np.random.Generator, dtype) -> list[Sample]:
    """Samples of long-tailed lengths like chat data (log-normal, median 260, mean ~390 tokens, cut to
    [32, max_len]), the first 30% of each a prompt without loss, random features."""
    lengths = np.clip(rng.lognormal(np.log(260), 0.9, n), 32, max_len).astype(int)
    out = []
    for T in lengths:
        lm = np.ones(T, dtype=bool)
        lm[: int(T * 0.3)] = False
        out.append(Sample(rng.integers(0, cfg.vocab_size - 1, T), lm,
                          torch.from_numpy(rng.standard_normal((T, len(cfg.target_layer_ids) * cfg.hidden_size),
                                                               dtype=np.float32)).to(dtype)))
    return out


def varied_lengths(args, cfg: DrafterConfig, device, peak: float) -> dict:
    """The same varied-length batches in the padded and the packed layout, as `BatchLoader` collates them (on a
    GPU: widths multiples of 128 and bucketed, compiled layers), each layout from the same initial weights: a first
    pass over the batches (compiling each new width), then `--varied-passes` timed passes. tokens/s over real
    sequence tokens; MFU over real tokens' FLOPs (`step_flops`) against the measured matmul peak."""
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    B, b = cfg.block_size, args.varied_batch
    rng = np.random.default_rng(0)
    groups = []
    for _ in range(args.varied_batches):
        samples = varied_samples(b, cfg, args.varied_max_length, rng, dtype)
        groups.append((samples, [sample_anchors(s.loss_mask, B, args.anchors, rng) for s in samples]))
    out = {"batch_size": b, "batches": args.varied_batches, "max_length": args.varied_max_length,
           "anchors": args.anchors, "mean_length": float(np.mean([len(s.input_ids) for g in groups for s in g[0]]))}
    runs = [("padded", args.compile), ("packed", args.compile)]
    if args.varied_eager and args.compile:
        runs.append(("packed_eager", False))  # the peer: the same packed batches, eager layers and loss
    for layout, compiled in runs:
        kw = dict(block_size=B, mask_token_id=cfg.mask_token_id, gamma=7.0, attention=args.attention, grad_clip=1.0,
                  compiled_loss=compiled)
        batches = [collate(smp, anc, seq_multiple=128 if cuda else 1, anchor_multiple=max(1, 128 // B) if cuda else 1,
                           bucket=cuda and compiled, packed=layout != "padded").to(device) for smp, anc in groups]
        if cuda:
            torch._dynamo.reset()
            torch.cuda.reset_peak_memory_stats(device)
        drafter, model, head, opt = build(cfg, device, compiled, 1, args.compile_mode)
        losses = []

        def run_pass():
            for bt in batches:
                stats, w = train_step(model, head, opt, bt, bt.hidden, **kw)
                losses.append(float(stats[0] / w))

        t = time.perf_counter()
        run_pass()
        _sync(device)
        first_s = time.perf_counter() - t
        t, cpu_t = time.perf_counter(), time.process_time()
        for _ in range(args.varied_passes):
            run_pass()
        _sync(device)
        timed_s, cpu_s = time.perf_counter() - t, time.process_time() - cpu_t
        tokens = sum(bt.num_tokens for bt in batches) * args.varied_passes
        flops = sum(sum(step_flops(cfg, bt).values()) for bt in batches) * args.varied_passes
        blocks = sum(int(bt.keep.sum()) for bt in batches)
        out[layout] = {
            "tokens_per_s": tokens / timed_s, "step_s_mean": timed_s / (len(batches) * args.varied_passes),
            # this process's CPU seconds per step: on a CPU shared with other work, steadier than the wall clock
            "process_s_per_step": cpu_s / (len(batches) * args.varied_passes),
            "achieved_tflops": flops / timed_s / 1e12, "mfu": flops / timed_s / peak, "first_pass_s": first_s,
            "padded_block_share": 1 - blocks / sum(bt.block_slots for bt in batches),
            "padded_context_share": 1 - sum(bt.num_tokens for bt in batches) / sum(bt.context_slots for bt in batches),
            "widths": sorted({(bt.context_slots, bt.block_slots) for bt in batches}),
            "first_losses": [round(x, 5) for x in losses[:3]],
        }
        if cuda:
            out[layout]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.profile and layout == "packed":  # the default layout: where its step's time goes, batch by batch
            out[layout]["profile"] = profile_steps(
                lambda i: train_step(model, head, opt, batches[i % len(batches)], batches[i % len(batches)].hidden,
                                     **kw), device, steps=min(len(batches), 4))
        log(f"varied lengths, {layout}: " + json.dumps(out[layout]))
        del drafter, model, head, opt, batches
        if cuda:
            torch.cuda.empty_cache()
    # the first step starts from the same weights and batch: the layouts give the same loss (bf16 rounding on a GPU)
    out["first_loss_rel_diff"] = abs(out["packed"]["first_losses"][0] - out["padded"]["first_losses"][0]) / abs(
        out["padded"]["first_losses"][0])
    out["packed_speedup"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    if "packed_eager" in out:
        out["compiled_vs_eager"] = out["packed"]["tokens_per_s"] / out["packed_eager"]["tokens_per_s"]
    return out


def ddp_worker(args) -> None:
    """Inside torchrun: every rank trains its own batch; rank 0 prints one JSON line per batch size."""
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    cfg = drafter_config(TINY if args.quick else DIMS[args.dims], args.layers, args.block)
    for b in args.batch_sizes:
        if cuda:
            torch._dynamo.reset()
        try:
            r = run_batch_size(b, args, cfg, device, world=dist.get_world_size())
        except Exception as e:  # report, keep going
            r = {"batch_size": b, "error": f"{type(e).__name__}: {e}"}
        if dist.get_rank() == 0:
            print("DDP_RESULT " + json.dumps(r), flush=True)
    dist.destroy_process_group()


def two_gpu_section(args, single: dict[int, dict]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--ddp-worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seq", str(args.seq), "--anchors", str(args.anchors), "--attention", args.attention, "--dims", args.dims,
           "--batch-sizes", *map(str, args.batch_sizes), *(["--quick"] if args.quick else []),
           *(["--no-compile"] if not args.compile else []), "--flex-kernel-options", args.flex_kernel_options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.ddp_timeout)
    rows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("DDP_RESULT ")]
    for r in rows:
        one = single.get(r.get("batch_size"))
        if one and "tokens_per_s" in r and "tokens_per_s" in one:
            r["scaling_efficiency"] = r["tokens_per_s"] / (2 * one["tokens_per_s"])
    out = {"results": rows, "returncode": proc.returncode}
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr[-3000:]
    return out


def end_to_end(args) -> dict:
    """`train_drafter` itself: a synthetic target dir and hidden-state cache partition on disk (Qwen3-8B
    dims, random lengths), a run stopped after some steps, then resumed to the end of the epoch."""
    import tempfile

    from safetensors.torch import save_file

    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.state import latest_state_dir
    from dflash_assets.drafter.training import train_drafter
    from dflash_assets.hidden_states.format import SafetensorsStreamWriter, ShardMetadata, shard_tensor_specs

    cuda = torch.cuda.is_available() and not args.quick
    dev = "cuda" if cuda else "cpu"
    dims = dict(TINY if args.quick else DIMS[args.dims])
    H, V, L = dims["hidden_size"], dims["vocab_size"], dims["num_target_layers"]
    root = Path(tempfile.mkdtemp(prefix="dflash-e2e-"))
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
        "intermediate_size": dims["intermediate_size"], "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"], "head_dim": dims["head_dim"], "num_hidden_layers": L,
        "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}))
    g = torch.Generator(device=dev).manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu(),
               "lm_head.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu()},
              str(target / "model.safetensors"))
    layer_ids = dflash_target_layer_ids(L, 5)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.seq // 6, args.seq + 1, args.e2e_sequences).tolist()
    meta = ShardMetadata(target_model="synthetic", layer_ids=tuple(layer_ids), dtype="bfloat16", hidden_size=H,
                         prompt_ids=tuple(f"s{i}" for i in range(len(lengths))))
    cache = root / "part-0.safetensors"
    t = time.perf_counter()
    with SafetensorsStreamWriter(cache, shard_tensor_specs(sum(lengths), len(lengths), 5, H, "bfloat16"),
                                 meta.to_header(), fsync=False) as w:
        for T in lengths:
            w.write("hidden", torch.randn(T, 5 * H, device=dev, generator=g).bfloat16().cpu())
            w.write("input_ids", torch.from_numpy(rng.integers(0, V - 1, T).astype(np.int32)))
            lm = np.ones(T, dtype=np.uint8)
            lm[: T // 10] = 0
            w.write("loss_mask", lm)
        w.write("cu_seqlens", torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64))
    write_s = time.perf_counter() - t
    recipe = DrafterRecipe(name="e2e", epochs=1, batch_size=args.e2e_batch, mask_token_id=dims["mask_token_id"],
                           max_length=args.seq, max_anchors=args.anchors, save_every=10**9,
                           compile=args.compile)
    steps: list[tuple[float, int]] = []

    def log_step(m):
        steps.append((time.perf_counter(), m["tokens"]))

    first_steps = max(1, len(lengths) // args.e2e_batch // 3)
    t = time.perf_counter()
    part = train_drafter(recipe, [cache], target, root / "out", log=log_step, max_steps=first_steps)
    stopped_at = latest_state_dir(root / "out" / "state").name
    rest = train_drafter(recipe, [cache], target, root / "out", log=log_step)
    wall = time.perf_counter() - t
    tail = steps[len(steps) // 2 :]  # steady state: the second half of the resumed run
    res = {
        "sequences": len(lengths), "tokens": int(sum(lengths)), "batch_size": args.e2e_batch,
        "cache_gb": cache.stat().st_size / 1e9, "cache_write_s": write_s, "first_run_steps": part.steps,
        "state_saved": stopped_at, "resumed_from_step": rest.resumed_from_step, "total_steps": rest.steps,
        "finished": rest.finished, "checkpoint_files": sorted(p.name for p in (root / "out" / "drafter").iterdir()),
        "loss_first": rest.losses[0], "loss_last": rest.losses[-1], "wall_s_both_runs": wall,
        "steady_tokens_per_s": sum(n for _, n in tail[1:]) / max(tail[-1][0] - tail[0][0], 1e-9) if len(tail) > 2 else None,
        "accuracy_by_position": [round(a, 4) for a in rest.accuracy_by_position],
    }
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="DFlash drafter training throughput")
    p.add_argument("--quick", action="store_true", help="tiny shapes on CPU (a smoke test)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per batch size")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (compilation happens here)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--anchors", type=int, default=None)
    p.add_argument("--dims", choices=sorted(DIMS), default="qwen3-8b", help="the target's shapes (hidden, heads, vocab)")
    p.add_argument("--profile", action="store_true", help="also profile a few steps: the kernels a step spends on "
                   "(with --varied*: of the packed rows)")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--attention", choices=["flex", "sdpa"], default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager layers and loss")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode of the layers, e.g. max-autotune "
                   "(which also autotunes flex attention's tiles; default: torch's)")
    p.add_argument("--flex-kernel-options", default=None,
                   help='flex attention\'s kernel_options as JSON, e.g. \'{"BLOCK_M": 64, "BLOCK_N": 64}\' '
                        "(torch_compile.set_flex_kernel_options); '{}': flex's own; default: the drafter's tiles "
                        "for this GPU and head size, as training runs (torch_compile.DRAFTER_FLEX_TILES)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    p.add_argument("--two-gpu", choices=["auto", "on", "off"], default="auto",
                   help="auto: when 2+ GPUs are visible; on: also on CPU with gloo (with --quick)")
    p.add_argument("--ddp-timeout", type=int, default=420)
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--e2e", action="store_true", help="also run train_drafter from a cache on disk (+ resume)")
    p.add_argument("--e2e-only", action="store_true", help="only the end-to-end run")
    p.add_argument("--e2e-sequences", type=int, default=None)
    p.add_argument("--e2e-batch", type=int, default=2)
    p.add_argument("--varied", action="store_true", help="also train on varied lengths, padded against packed")
    p.add_argument("--varied-only", action="store_true", help="only the varied-length comparison")
    p.add_argument("--varied-batch", type=int, default=None, help="samples per batch (default: the first batch size)")
    p.add_argument("--varied-batches", type=int, default=None, help="distinct batches (default 12, quick 3)")
    p.add_argument("--varied-passes", type=int, default=2, help="timed passes over them")
    p.add_argument("--varied-eager", action="store_true", help="also the packed batches eagerly: the peer of compiled")
    p.add_argument("--varied-max-length", type=int, default=None, help="longest sample (default 2048, quick 768)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    if args.flex_kernel_options is not None:  # as given ('{}': flex's own), else the drafter's tiles, as training
        tiles = json.loads(args.flex_kernel_options)
    else:
        dims = TINY if args.quick else DIMS[args.dims]
        tiles = drafter_flex_kernel_options("cuda" if cuda else "cpu", dims["head_dim"])
    set_flex_kernel_options(tiles)
    args.flex_kernel_options = json.dumps(tiles)
    args.batch_sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 2, 4])
    args.steps = args.steps or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.seq = args.seq or (256 if args.quick else 3072)
    args.anchors = args.anchors or (16 if args.quick else 512)
    args.attention = args.attention or ("flex" if cuda else "sdpa")  # flex has no CPU backward
    if not cuda:
        args.compile = False
    if args.ddp_worker:
        ddp_worker(args)
        return 0

    args.e2e_sequences = args.e2e_sequences or (12 if args.quick else 48)
    args.varied_batch = args.varied_batch or args.batch_sizes[0]
    args.varied_batches = args.varied_batches or (3 if args.quick else 12)
    args.varied_max_length = args.varied_max_length or (768 if args.quick else 2048)
    if args.e2e_only:
        res = {"end_to_end": end_to_end(args)}
        print(json.dumps(res, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    cfg = drafter_config(TINY if args.quick else DIMS[args.dims], args.layers, args.block)
    result = {
        "bench": "dflash drafter training", "quick": args.quick,
        "device": device.type, "machine": machine_info("torch", "transformers", "safetensors", "numpy"), "gpu": gpu_info(),
        "config": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "block": cfg.block_size,
                   "vocab": cfg.vocab_size, "captured_layers": len(cfg.target_layer_ids), "seq": args.seq,
                   "anchors": args.anchors, "attention": args.attention, "compile": args.compile,
                   "compile_mode": args.compile_mode, "flex_kernel_options": json.loads(args.flex_kernel_options),
                   "dtype": "bf16 autocast, fp32 master weights" if cuda else "fp32",
                   "drafter_params": None},
        "flop_formula": FLOP_FORMULA,
    }
    with torch.device("meta"):
        result["config"]["drafter_params"] = DFlashDrafter(cfg).num_params()
    peak = matmul_peak(device, args.quick)
    result["matmul_peak_tflops"] = peak / 1e12
    log(f"matmul peak {peak / 1e12:.1f} TFLOP/s on {result['device']}")
    if args.varied_only:
        result["varied_lengths"] = varied_lengths(args, cfg, device, peak)
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0

    try:
        result["attention_path_check"] = check_attention_paths(cfg, device, args.quick)
    except Exception as e:
        result["attention_path_check"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    log("attention path check: " + json.dumps(result["attention_path_check"]))
    single: dict[int, dict] = {}

    def save_partial():  # a run killed at its time limit still leaves what it measured
        if args.out:
            Path(args.out).write_text(json.dumps({**result, "single_gpu": list(single.values())}, indent=2) + "\n")

    for b in args.batch_sizes:
        if cuda:
            torch._dynamo.reset()  # static shapes per batch size, no recompile limit across sizes
        try:
            r = run_batch_size(b, args, cfg, device)
        except Exception as e:
            if not args.compile:
                raise
            log(f"batch {b}: compiled run failed ({e!r}); retrying eager")
            traceback.print_exc(file=sys.stderr)
            args.compile = False
            result["config"]["compile"] = False
            result["compile_error"] = f"{type(e).__name__}: {e}"[:2000]
            r = run_batch_size(b, args, cfg, device)
        r["mfu"] = r["achieved_tflops_per_gpu"] * 1e12 / peak
        if not args.quick and args.dims == "qwen3-8b" and b in SPECFORGE_TOK_S:
            r["specforge_tokens_per_s"] = SPECFORGE_TOK_S[b]
            r["speedup_vs_specforge"] = r["tokens_per_s"] / SPECFORGE_TOK_S[b]
        single[b] = r
        log(json.dumps(r))
        save_partial()
    result["single_gpu"] = list(single.values())

    want_two = args.two_gpu == "on" or (args.two_gpu == "auto" and cuda and torch.cuda.device_count() >= 2)
    if want_two:
        log("two-process section (torchrun, DDP)")
        try:
            result["two_gpu"] = two_gpu_section(args, single)
        except Exception as e:
            result["two_gpu"] = {"error": f"{type(e).__name__}: {e}"}
    if args.varied:
        log("varied lengths: padded against packed")
        try:
            result["varied_lengths"] = varied_lengths(args, cfg, device, peak)
        except Exception as e:
            result["varied_lengths"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if args.e2e:
        log("end-to-end train_drafter run")
        try:
            result["end_to_end"] = end_to_end(args)
        except Exception as e:
            result["end_to_end"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
