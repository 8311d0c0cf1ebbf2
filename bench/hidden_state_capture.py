#!/usr/bin/env python
"""Benchmark hidden-state capture for DFlash training; prints JSON.

Reads nothing but its arguments; writes scratch shards and a disk probe file
under ``--out-dir`` (removed afterwards). Needs only torch, transformers,
safetensors and numpy (triton / flash-linear-attention / causal-conv1d are
used when importable): it imports ``dflash_assets.hidden_states`` (batching,
packing, capture, format) without running the package's ``__init__``.

Sections (each in its own try/except; a one-line ``partial:`` JSON after each):
  peak    bf16 matmul TFLOP/s measured in this run (the MFU denominator)
  a       naive: full model, ``output_hidden_states=True``, select layers, ``.cpu()``
  b       hooks + cut, capture only (D2H into pinned buffers, no writes):
          packed row (varlen attention) and stacked rows (SDPA is_causal),
          plus compute alone (no D2H); MFU; exactness vs the naive states
  c       end to end into shards on local disk; raw write+fsync GB/s in the
          same run; ratio to min(capture, disk-bound)
  d       hybrid Qwen3.5-shaped target, with fla kernels if importable and
          without them (subprocess that blocks their import); ratio to dense
  e       two GPUs (one thread + model per GPU), if 2 are visible

MFU = flops / seconds / peak, flops = 2 * P_run * tokens + attention, where
P_run counts the 2-D weights of the decoder layers that actually run (for the
naive path: all layers + lm_head) and attention = sum over full-attention
layers run of 2 * n_heads * head_dim * sum_i(len_i^2) (causal QK^T and PV).
Gated DeltaNet recurrences and elementwise ops are not counted.

  python bench/hidden_state_capture.py              # H200: Qwen3-8B shapes, 16K-token batches
  python bench/hidden_state_capture.py --quick      # tiny shapes on CPU (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # machine.py, beside this script (stdlib only)

from machine import gpu_info, machine_info  # noqa: E402


class _BlockImports(importlib.abc.MetaPathFinder):
    """Make packages unimportable (to run the hybrid target without its kernels)."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname} blocked by the benchmark")
        return None


if "--no-kernels" in sys.argv:  # before transformers is imported: it resolves kernels at import time
    sys.meta_path.insert(0, _BlockImports(["fla", "causal_conv1d"]))
    importlib.util.find_spec = (lambda orig: (lambda name, *a: None if name.split(".")[0] in ("fla", "causal_conv1d") else orig(name, *a)))(importlib.util.find_spec)

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _load_library():
    """The capture modules as one namespace, without running ``dflash_assets/__init__`` (which may need more deps)."""
    if "dflash_assets" not in sys.modules:
        pkg = types.ModuleType("dflash_assets")
        pkg.__path__ = [str(ROOT / "dflash_assets")]
        sys.modules["dflash_assets"] = pkg
    import dflash_assets.hidden_states.batching as batching
    import dflash_assets.hidden_states.capture as capture
    import dflash_assets.hidden_states.format as hsf
    import dflash_assets.hidden_states.packing as packing
    import dflash_assets.target_model.packed_attention as packed_attention

    names = {}
    for module in (batching, packed_attention, packing, capture):  # private names too (_VARLEN_PARAMS, _forward, ...)
        names.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return types.SimpleNamespace(**names), hsf


hsc, hsf = _load_library()

# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------


def dense_config(quick: bool):
    from transformers import Qwen3Config

    if quick:
        return Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16), [1, 3]
    # Qwen3-8B
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       tie_word_embeddings=False), [1, 9, 17, 25, 33]


def hybrid_config(quick: bool):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    if quick:
        return Qwen3_5TextConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4), [1, 5]
    # Qwen3.5-9B-shaped: 32 layers (3 Gated DeltaNet : 1 full attention), hidden 4096
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                             max_position_embeddings=32768, tie_word_embeddings=False), [1, 8, 15, 22, 29]


def build_model(config, device, dtype, seed=0):
    from transformers import AutoModelForCausalLM

    hsc.register_packed_attention()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hsc.ATTN_IMPLEMENTATION)
    return model.eval()


def make_samples(n, seq_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [hsc.TokenizedSample(f"s{i}", rng.integers(0, vocab, seq_len).astype(np.int32),
                                np.ones(seq_len, np.uint8)) for i in range(n)]


# ---------------------------------------------------------------------------
# FLOPs and timing
# ---------------------------------------------------------------------------


def run_flops(model, layers_run, lengths, with_lm_head=False):
    """2 * (2-D weights of the layers run) * tokens + causal attention of the full-attention layers run."""
    text, layers = hsc.decoder_stack(model)
    cfg = hsc.text_config(model.config)
    tokens = sum(lengths)
    params = sum(p.numel() for layer in layers[:layers_run] for p in layer.parameters() if p.ndim == 2)
    if with_lm_head:
        params += model.lm_head.weight.numel()
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    n_full = sum(1 for t in types_[:layers_run] if t == "full_attention")
    d_attn = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    attn = n_full * 2 * d_attn * sum(n * n for n in lengths)
    return {"flops": 2 * params * tokens + attn, "params_run": params, "attention_flops": attn,
            "layers_run": layers_run, "full_attention_layers_run": n_full}


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_matmul(device, dtype, quick):
    shapes = [(512, 512, 512)] if quick else [(8192, 8192, 8192), (16384, 4096, 12288), (16384, 12288, 4096)]
    best = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync(device)
        iters = 3 if quick else 30
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(device)
        tf = 2 * m * k * n * iters / (time.perf_counter() - t0) / 1e12
        best[f"{m}x{k}x{n}"] = round(tf, 1) if tf > 1 else round(tf, 4)
        del a, b
    return {"tflops_by_shape": best, "peak_tflops": max(best.values()), "dtype": str(dtype)}


def mfu(flops, seconds, peak_tflops):
    return round(flops / seconds / (peak_tflops * 1e12), 4)


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def naive(model, layer_ids, samples, iters, device, warmup):
    """Full model with ``output_hidden_states=True`` on [B, T] rows, select layers, ``.cpu()``."""
    ids = torch.from_numpy(np.stack([s.input_ids for s in samples])).long().to(device)
    cfgs = {id(c): c for c in (model.config, hsc.text_config(model.config))}
    saved = {k: c._attn_implementation for k, c in cfgs.items()}
    for c in cfgs.values():
        c._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            def step():
                out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
                return torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1).cpu()
            for _ in range(warmup):
                ref = step()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                ref = step()
            sync(device)
            dt = time.perf_counter() - t0
    finally:
        for k, c in cfgs.items():
            c._attn_implementation = saved[k]
    return dt, ref


def capture_only(model, layer_ids, samples, iters, packed, warmup):
    """Pipelined hooks + cut through ``capture_batches`` (D2H into pinned buffers, no writes)."""
    batch = hsc.Batch(tuple(range(len(samples))), tuple(s.num_tokens for s in samples), packed)
    hsc.capture_batches(model, samples, [batch] * warmup, layer_ids, None)
    stats = hsc.capture_batches(model, samples, [batch] * iters, layer_ids, None)
    return stats


def compute_alone(model, layer_ids, samples, iters, packed, device, warmup):
    """Hooks + cut forwards only: no D2H, no writer thread."""
    batch = hsc.Batch(tuple(range(len(samples))), tuple(s.num_tokens for s in samples), packed)
    hybrid = hsc.is_hybrid(model)
    with torch.inference_mode(), hsc.packed_attention(model), hsc.LayerCapture(model, layer_ids) as cap:
        target = torch.empty(batch.num_tokens, cap.hidden_size * len(layer_ids), dtype=model.dtype, device=device)
        inputs = hsc._batch_inputs(samples, batch, torch.device(device), hybrid)
        for _ in range(warmup):
            hsc._forward(cap, inputs, target)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            hsc._forward(cap, inputs, target)
        sync(device)
        dt = time.perf_counter() - t0
        return dt, target.float().cpu()


def states_diff(a, b, n_layers=1, first_len=None):
    """Mean |a-b| / mean |b| per captured layer (columns split in n_layers blocks), and max |a-b|.

    With ``first_len``: the same for the first sample's rows and for the rest. In a packed row the
    first sample cannot see any other, so if the others differ much more, attention leaks across samples.
    """
    a, b = a.float(), b.float()
    d = (a - b).abs()

    def rel(x, y):
        return round(float(x.mean() / y.abs().mean().clamp_min(1e-30)), 6)
    out = {"max_abs": float(d.max()), "ref_mean_abs": float(b.abs().mean()),
           "rel_mean_per_layer": [rel(x, y) for x, y in zip(d.chunk(n_layers, -1), b.chunk(n_layers, -1))]}
    if first_len:
        out["rel_mean_first_sample"] = rel(d[:first_len], b[:first_len])
        out["rel_mean_other_samples"] = rel(d[first_len:], b[first_len:])
    return out


def disk_write_gbps(out_dir, gib, quick):
    path = Path(out_dir) / "disk_probe.bin"
    chunk = np.random.default_rng(0).integers(0, 255, (64 if not quick else 4) * 2**20, dtype=np.uint8)
    total = int(gib * 2**30)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, chunk[: min(len(chunk), total - written)])
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"gib": gib, "seconds": round(dt, 3), "gb_per_s": round(written / dt / 1e9, 3)}


def free_cuda():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--sections", default="peak,a,b,c,d,e")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048; quick 64)")
    ap.add_argument("--samples-per-batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=None, help="timed batches per measurement (default 10; quick 2)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--e2e-batches", type=int, default=None, help="batches written in section c (default 12)")
    ap.add_argument("--disk-gib", type=float, default=None, help="raw disk probe size (default 4)")
    ap.add_argument("--out-dir", default=None, help="scratch dir for shards (default: a temp dir)")
    ap.add_argument("--json-out", default=None, help="also write the final JSON to this file")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants of section b")
    ap.add_argument("--no-kernels", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hybrid-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    quick = args.quick
    device = args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda:0")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seq = args.seq_len or (64 if quick else 2048)
    nb = args.samples_per_batch
    iters = args.iters or (2 if quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    sections = set(args.sections.split(","))
    out_root = Path(args.out_dir or tempfile.mkdtemp(prefix="dflash-bench-"))
    out_root.mkdir(parents=True, exist_ok=True)

    res = {"env": {"device": device, "dtype": str(dtype), "quick": quick,
                   "tokens_per_batch": seq * nb, "samples_per_batch": nb, "seq_len": seq, "iters": iters,
                   "varlen_attn": sorted(hsc._VARLEN_PARAMS) if hsc._varlen_attn is not None else None, "kernels": hsc.linear_attention_kernels()}}
    res["env"]["machine"] = machine_info("torch", "transformers", "safetensors", "numpy",
                                         "flash-linear-attention", "causal-conv1d")
    res["env"]["gpu"] = gpu_info()

    def section(name, fn):
        try:
            res[name] = fn()
        except BaseException as e:  # keep going; report the failure
            if isinstance(e, KeyboardInterrupt):
                raise
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        free_cuda()
        print("partial: " + json.dumps(res, separators=(",", ":")), flush=True)

    if args.hybrid_only:  # child process of section d
        section("hybrid", lambda: hybrid_section(quick, device, dtype, seq, nb, iters, warmup,
                                                 not (quick or device == "cpu" or args.no_compile)))
        return

    peak = {"peak_tflops": None}
    if "peak" in sections:
        section("peak", lambda: peak_matmul(device, torch.bfloat16 if device != "cpu" else torch.float32, quick))
        peak = res["peak"] if "error" not in res["peak"] else peak
    P = peak.get("peak_tflops")

    cfg, layer_ids = dense_config(quick)
    model = None
    try:
        model = build_model(cfg, device, dtype)
    except BaseException as e:
        res["model"] = {"error": f"{type(e).__name__}: {e}"}
    samples = make_samples(nb, seq, cfg.vocab_size)
    lengths = [seq] * nb
    tokens = seq * nb
    layers_run = max(layer_ids) + 1
    cap_flops = run_flops(model, layers_run, lengths) if model is not None else None
    ref = {}

    if model is not None and "a" in sections:
        def sec_a():
            dt, states = naive(model, layer_ids, samples, iters, device, warmup)
            ref["naive"] = states.float().reshape(-1, states.shape[-1])
            fl = run_flops(model, cfg.num_hidden_layers, lengths, with_lm_head=True)
            out = {"tok_per_s": round(tokens * iters / dt), "seconds_per_batch": round(dt / iters, 4), **fl}
            if P:
                out["mfu_of_work_done"] = mfu(fl["flops"] * iters, dt, P)
            return out
        section("a_naive", sec_a)

    if model is not None and "b" in sections:
        def sec_b():
            out = {"flops_per_batch": cap_flops}
            if P:
                out["roofline_tok_per_s"] = round(P * 1e12 / (cap_flops["flops"] / tokens))
            variants = [("", False)]
            if not quick and device != "cpu" and not args.no_compile:
                variants.append(("compiled_", True))
            for prefix, comp in variants:
                if comp:
                    t0 = time.perf_counter()
                    out["compiled_modules"] = hsc.compile_elementwise(model)
                    hsc.capture_batches(model, samples, [hsc.Batch(tuple(range(nb)), tuple(lengths), True)],
                                        layer_ids, None)
                    hsc.capture_batches(model, samples, [hsc.Batch(tuple(range(nb)), tuple(lengths), False)],
                                        layer_ids, None)
                    out["compile_seconds"] = round(time.perf_counter() - t0, 1)
                for label, packed in (("packed_varlen", True), ("stacked_sdpa", False)):
                    st = capture_only(model, layer_ids, samples, iters, packed, warmup)
                    r = {"tok_per_s": round(st.tokens_per_second), "seconds_per_batch": round(st.seconds / iters, 4),
                         "wait_for_writer_s": round(st.wait_for_writer_s, 4)}
                    if P:
                        r["mfu"] = mfu(cap_flops["flops"] * iters, st.seconds, P)
                    out[prefix + label] = r
                    dt, states = compute_alone(model, layer_ids, samples, iters, packed, device, warmup)
                    r = {"tok_per_s": round(tokens * iters / dt), "seconds_per_batch": round(dt / iters, 4)}
                    if P:
                        r["mfu"] = mfu(cap_flops["flops"] * iters, dt, P)
                    out[prefix + label + "_compute_only"] = r
                    if "naive" in ref:
                        out[prefix + label + "_vs_naive"] = states_diff(states, ref["naive"], len(layer_ids), seq)
            best = max((v["tok_per_s"], k) for k, v in out.items()
                       if isinstance(v, dict) and "tok_per_s" in v and not k.endswith("compute_only"))
            out["best"] = {"variant": best[1], "tok_per_s": best[0]}
            res["env"]["model_compiled_for_c_e"] = bool(out.get("compiled_modules"))
            out["goal_tok_per_s"] = 37700 if not quick else None
            return out
        section("b_hooks_cut", sec_b)

    if model is not None and "c" in sections:
        def sec_c():
            disk = disk_write_gbps(out_root, args.disk_gib or (0.02 if quick else 4.0), quick)
            n_batches = args.e2e_batches or (3 if quick else 12)
            e2e_samples = make_samples(nb * n_batches, seq, cfg.vocab_size, seed=1)
            spec = hsc.CaptureSpec(target="random-qwen3-8b-shaped", layer_ids=tuple(layer_ids),
                                   dtype=str(dtype).removeprefix("torch."), tokens_per_batch=tokens,
                                   max_part_bytes=8 * 2**30)
            shard_dir = out_root / "shards"
            # warm up the pipeline once (allocators, kernels), not timed
            hsc.capture_partition(e2e_samples[:nb], spec, shard_dir, stem="warm", devices=[device], models=[model])
            r = hsc.capture_partition(e2e_samples, spec, shard_dir, stem="e2e", devices=[device], models=[model])
            bpt = hsf.bytes_per_token(len(layer_ids), cfg.hidden_size, dtype)
            disk_bound = disk["gb_per_s"] * 1e9 / bpt
            b = res.get("b_hooks_cut", {})
            cap = b.get("compiled_packed_varlen", b.get("packed_varlen", {})).get("tok_per_s")  # model's current state
            bound = min(x for x in (cap, disk_bound) if x)
            shutil_rm(shard_dir)
            return {"disk": disk, "bytes_per_token": bpt, "disk_bound_tok_per_s": round(disk_bound),
                    "capture_only_tok_per_s": cap, "e2e_tok_per_s": round(r.tokens_per_second),
                    "e2e_seconds": round(r.seconds, 3), "tokens": r.num_tokens, "gb_written": round(r.bytes / 1e9, 3),
                    "parts": len(r.paths), "storage_wait_s": round(sum(w.wait_for_writer_s for w in r.workers), 3),
                    "writer_busy_s": round(sum(w.write_s for w in r.workers), 3),
                    "ratio_to_min_capture_disk": round(r.tokens_per_second / bound, 3)}
        section("c_end_to_end", sec_c)

    b_res = res.get("b_hooks_cut", {})
    # references: the packed path the model is now in (compiled if section b compiled it), and eager stacked
    packed_ref = b_res.get("compiled_packed_varlen", b_res.get("packed_varlen", {})).get("tok_per_s")
    dense_tok_s = b_res.get("stacked_sdpa", {}).get("tok_per_s")
    if "e" in sections and model is not None:
        def sec_e():
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if quick and device == "cpu":
                devs = ["cpu", "cpu"]
            elif n >= 2:
                devs = ["cuda:0", "cuda:1"]
            else:
                return {"skipped": f"{n} GPU(s) visible"}
            models = [model] + [build_model(cfg, d, dtype) for d in devs[1:]]
            if res["env"].get("model_compiled_for_c_e"):
                for m in models[1:]:
                    hsc.compile_elementwise(m)
            batch = hsc.Batch(tuple(range(nb)), tuple(lengths), True)
            for m in models:  # warm up each device
                hsc.capture_batches(m, samples, [batch] * warmup, layer_ids, None)
            import queue as _q
            import threading

            work = _q.SimpleQueue()
            for _ in range(iters * len(devs)):
                work.put(batch)

            def pull():
                while True:
                    try:
                        yield work.get_nowait()
                    except _q.Empty:
                        return
            stats = [None] * len(devs)

            def run(k):
                stats[k] = hsc.capture_batches(models[k], samples, pull(), layer_ids, None)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=run, args=(k,)) for k in range(len(devs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
            total = sum(s.tokens for s in stats)
            single = packed_ref
            del models[1:]
            return {"devices": devs, "tok_per_s": round(total / dt), "batches_per_device": [s.batches for s in stats],
                    "single_device_tok_per_s": single, "scaling": round(total / dt / single, 3) if single else None}
        section("e_two_gpus", sec_e)

    model = None  # free it (a `del` would leave the name undefined for the section closures above)
    free_cuda()

    if "d" in sections:
        section("d_hybrid", lambda: hybrid_section(quick, device, dtype, seq, nb, iters, warmup,
                                                   not (quick or device == "cpu" or args.no_compile)))
        h = res["d_hybrid"]
        if "error" not in h:
            if dense_tok_s and h.get("stacked", {}).get("tok_per_s"):
                h["ratio_to_dense"] = round(h["stacked"]["tok_per_s"] / dense_tok_s, 3)  # both eager, stacked rows
            if any(v is True for v in h.get("kernels", {}).values()):  # also without the kernels, fresh process
                cmd = [sys.executable, __file__, "--hybrid-only", "--no-kernels", "--device", device,
                       "--seq-len", str(seq), "--samples-per-batch", str(nb), "--iters", str(iters),
                       "--warmup", str(warmup)] + (["--quick"] if quick else [])
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("partial: ")]
                    h["without_kernels"] = json.loads(lines[-1][len("partial: "):]).get("hybrid") if lines \
                        else {"error": p.stderr[-1500:]}
                except Exception as e:
                    h["without_kernels"] = {"error": repr(e)}
                wk = h.get("without_kernels") or {}
                if dense_tok_s and wk.get("stacked", {}).get("tok_per_s"):
                    wk["ratio_to_dense"] = round(wk["stacked"]["tok_per_s"] / dense_tok_s, 3)
        print("partial: " + json.dumps(res, separators=(",", ":")), flush=True)

    if not args.out_dir:
        shutil_rm(out_root)
    print(json.dumps(res, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


def hybrid_section(quick, device, dtype, seq, nb, iters, warmup, compile_ok=False):
    cfg, layer_ids = hybrid_config(quick)
    model = build_model(cfg, device, dtype)
    samples = make_samples(nb, seq, cfg.vocab_size, seed=2)
    lengths = [seq] * nb
    kernels = hsc.linear_attention_kernels()
    try:  # what transformers will actually resolve for the Gated DeltaNet layers
        import fla.ops.gated_delta_rule as gdr

        kernels["fla_ops_import"] = "ok" if hasattr(gdr, "chunk_gated_delta_rule") else "no chunk_gated_delta_rule"
    except Exception as e:
        kernels["fla_ops_import"] = f"{type(e).__name__}: {e}"[:200]
    out = {"kernels": kernels, "layer_ids": layer_ids, "flops_per_batch": run_flops(model, max(layer_ids) + 1, lengths)}
    # Equal-length samples stack as rows: exact with or without kernels.
    st = capture_only(model, layer_ids, samples, iters, False, warmup)
    out["stacked"] = {"tok_per_s": round(st.tokens_per_second), "seconds_per_batch": round(st.seconds / iters, 4)}
    _, stacked_states = compute_alone(model, layer_ids, samples, 1, False, device, 0)
    if hsc.resolve_packing(model, device, "auto"):  # fla + causal-conv1d on CUDA: packed rows with cu_seqlens
        st = capture_only(model, layer_ids, samples, iters, True, warmup)
        out["packed"] = {"tok_per_s": round(st.tokens_per_second), "seconds_per_batch": round(st.seconds / iters, 4)}
        _, packed_states = compute_alone(model, layer_ids, samples, 1, True, device, 0)
        out["packed_vs_stacked"] = states_diff(packed_states, stacked_states, len(layer_ids), seq)
    else:
        out["packed"] = {"skipped": "needs flash-linear-attention and causal-conv1d on CUDA"}
    if compile_ok:
        out["compiled_modules"] = hsc.compile_elementwise(model)
        st = capture_only(model, layer_ids, samples, iters, False, warmup + 1)
        out["compiled_stacked"] = {"tok_per_s": round(st.tokens_per_second),
                                   "seconds_per_batch": round(st.seconds / iters, 4)}
    del model
    return out


def shutil_rm(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
