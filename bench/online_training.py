"""Benchmark: online DFlash training at Qwen3-8B shapes: the target's forward feeding the drafter's step in one process.

Three measurements in the same run, per batch size (1, 2, 4 sequences of 3,072 tokens):
- capture alone: the target (random weights, Qwen3-8B shapes: 36 layers, H 4096) with the project's
  ``LayerCapture`` (hooks on the 5 DFlash layers, the decoder cut after the last one), as the cache stage and
  online training run it;
- training alone: ``drafter.loss.train_step`` (5-layer drafter, block 16, 512 anchors) on resident features;
- online: both in one loop, the captured features passed straight to the step (no copy, no host round trip).

Goal: online tokens/s >= 0.9 x 1/(1/capture + 1/train), i.e. nothing lost to the joining. The
frozen head and embeddings of the drafter are the target's own (as in real training). Needs only torch,
transformers, numpy (+ triton on GPU). Prints one JSON object on stdout; progress on stderr.

    python bench/online_training.py            # one GPU: batch 1, 2, 4
    python bench/online_training.py --quick    # tiny shapes on CPU (smoke test)
    python bench/online_training.py --dims smollm2-135m --batch-sizes 48 --seq 512 --anchors 384
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from bench.machine import gpu_info, machine_info  # noqa: E402
from dflash_assets.drafter.data import Batch, sample_anchors  # noqa: E402
from dflash_assets.drafter.loss import train_step  # noqa: E402
from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, TargetHead  # noqa: E402
from dflash_assets.target_model.conventions import dflash_target_layer_ids  # noqa: E402
from dflash_assets.target_model.layer_capture import LayerCapture  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def target_config(quick: bool, dims: str = "qwen3-8b"):
    from transformers import LlamaConfig, Qwen3Config

    if dims == "smollm2-135m" and not quick:  # the GPU study's target (SmolLM2-135M-Instruct's config)
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                           rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}, tie_word_embeddings=True)
    if quick:
        return Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps: int, warmup: int, device) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--anchors", type=int, default=None)
    p.add_argument("--dims", choices=["qwen3-8b", "smollm2-135m"], default="qwen3-8b", help="the target's shapes")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batch_sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 2, 4])
    seq, anchors = args.seq or (128 if args.quick else 3072), args.anchors or (8 if args.quick else 512)
    steps, warmup = args.steps or (2 if args.quick else 8), args.warmup if args.warmup is not None else (1 if args.quick else 3)
    compile_ok = args.compile and cuda

    from transformers import AutoModelForCausalLM

    tcfg = target_config(args.quick, args.dims)
    L, H = tcfg.num_hidden_layers, tcfg.hidden_size
    layer_ids = dflash_target_layer_ids(L, 5 if not args.quick else 2)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(tcfg, dtype=dtype, attn_implementation="sdpa").eval()
    target.requires_grad_(False)
    log(f"target built in {time.perf_counter() - t0:.1f}s: {sum(x.numel() for x in target.parameters()) / 1e9:.2f}B params")
    head = TargetHead.from_model(target)
    dcfg = DrafterConfig(vocab_size=tcfg.vocab_size, hidden_size=H, intermediate_size=tcfg.intermediate_size,
                         num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                         head_dim=tcfg.head_dim, target_layer_ids=layer_ids, num_target_layers=L,
                         num_hidden_layers=5 if not args.quick else 1, block_size=16 if not args.quick else 4,
                         mask_token_id=tcfg.vocab_size - 1)
    kw = dict(block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id, gamma=7.0,
              attention="flex" if cuda else "sdpa", grad_clip=1.0, compiled_loss=compile_ok)
    result = {"bench": "online DFlash training (capture + train in one process)", "quick": args.quick,
              "device": "cuda" if cuda else "cpu", "machine": machine_info("torch", "transformers", "safetensors", "numpy"), "gpu": gpu_info(),
              "config": {"dims": args.dims, "target_layers": L, "hidden": H, "captured": layer_ids, "seq": seq, "anchors": anchors,
                         "drafter_layers": dcfg.num_hidden_layers, "block": dcfg.block_size, "dtype": str(dtype),
                         "compile": compile_ok, "steps": steps, "warmup": warmup},
              "batches": []}
    rng = np.random.default_rng(0)
    with LayerCapture(target, layer_ids, cut=True) as cap:
        text_model = cap.text_model
        for b in batch_sizes:
            torch.manual_seed(1)
            drafter = DFlashDrafter(dcfg).to(device)
            if compile_ok:
                for layer in drafter.layers:
                    layer.compile()
            opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, **({"fused": True} if cuda else {}))
            lm = np.ones(seq, dtype=bool)
            lm[: seq // 10] = False
            ids = torch.from_numpy(rng.integers(0, tcfg.vocab_size - 1, (b, seq))).to(device)
            anchor_np = np.stack([sample_anchors(lm, dcfg.block_size, anchors, rng) for _ in range(b)])
            batch = Batch(input_ids=ids, loss_mask=torch.from_numpy(np.tile(lm, (b, 1))).to(device), hidden=None,
                          anchors=torch.from_numpy(anchor_np).to(device),
                          keep=torch.ones(b, anchor_np.shape[1], dtype=torch.bool, device=device), num_tokens=b * seq)

            @torch.no_grad()
            def capture():
                text_model(input_ids=ids, use_cache=False)
                return cap.features()

            resident = capture().clone()

            def train():
                return train_step(drafter, head, opt, batch, resident, **kw)

            def online():
                return train_step(drafter, head, opt, batch, capture(), **kw)

            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            cap_s = timed(capture, steps, warmup, device)
            train_s = timed(train, steps, warmup, device)
            online_s = timed(online, steps, warmup, device)
            tokens = b * seq
            joined = 1.0 / (1.0 / (tokens / cap_s) + 1.0 / (tokens / train_s))
            row = {"batch_size": b, "capture_tok_s": tokens / cap_s, "train_tok_s": tokens / train_s,
                   "online_tok_s": tokens / online_s, "ideal_joined_tok_s": joined,
                   "online_over_ideal": (tokens / online_s) / joined,
                   "capture_s": cap_s, "train_s": train_s, "online_s": online_s}
            if cuda:
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            log(json.dumps(row))
            result["batches"].append(row)
            drafter = opt = resident = None  # free them (a `del` would leave the closures above undefined names)
            if cuda:
                torch.cuda.empty_cache()
    result["goal"] = "online_over_ideal >= 0.9 at every batch size"
    result["goal_met"] = all(r["online_over_ideal"] >= 0.9 for r in result["batches"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
