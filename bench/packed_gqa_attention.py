"""One decode step's attention, compiled: Transformers' SDPA path against `generation.packed_gqa`.

The in-process engine's static cache decodes with a compiled step, and under torch.compile Transformers' SDPA
path copies the KV cache to every query head (`repeat_kv`) before attending. This times that attention alone,
both ways, at SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head dim 64), one query token per
row over `--cache` cached tokens with a left-padding mask, for each `--rows`: both functions compiled with
`fullgraph=True`, warmed, then `--iters` calls timed (CUDA synchronized), outputs compared. One layer's
attention: the model's step runs 30 of them. Prints one JSON object (also to `--out`).

    python bench/packed_gqa_attention.py --rows 64 256 --out /tmp/attention.json   # here, float32
    python3 bench/packed_gqa_attention.py --rows 256 1024 4096                      # a GPU host, bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dflash_assets from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py (stdlib only)

from machine import print_report  # noqa: E402


def main() -> int:
    import torch
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash_assets.generation.packed_gqa import packed_gqa_sdpa
    from machine import gpu_info, machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--cache", type=int, default=512, help="cached tokens per row (the static cache's length)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))

    class Attention:  # what the attention functions read of their module
        num_key_value_groups = args.heads // args.kv_heads
        training = False

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, *inputs) -> tuple[float, torch.Tensor]:
        out = fn(*inputs)  # compiles
        fn(*inputs)
        sync()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn(*inputs)
        sync()
        return (time.perf_counter() - t) / args.iters * 1e3, out

    stock = torch.compile(lambda *t: sdpa_attention_forward(Attention(), *t, scaling=0.125)[0], fullgraph=True)
    packed = torch.compile(lambda *t: packed_gqa_sdpa(Attention(), *t, scaling=0.125)[0], fullgraph=True)
    report = {"bench": "one decode step's attention, compiled: Transformers' SDPA path vs packed GQA",
              "machine": machine_info("torch", "transformers"), "gpu": gpu_info(), "device": device,
              "transformers": transformers.__version__, "dtype": str(dtype),
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "cache": args.cache,
              "iters": args.iters, "cases": []}
    g = torch.Generator(device=device).manual_seed(0)
    for rows in args.rows:
        q = torch.randn(rows, args.heads, 1, args.head_dim, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(rows, args.kv_heads, args.cache, args.head_dim, generator=g, device=device, dtype=dtype)
                for _ in range(2))
        mask = torch.ones(rows, 1, 1, args.cache, dtype=torch.bool, device=device)
        mask[: rows // 4, :, :, : args.cache // 4] = False  # a quarter of the rows left-padded
        stock_ms, expected = timed(stock, q, k, v, mask)
        packed_ms, out = timed(packed, q, k, v, mask)
        case = {"rows": rows, "transformers_sdpa_ms": round(stock_ms, 3), "packed_gqa_ms": round(packed_ms, 3),
                "speedup": round(stock_ms / packed_ms, 2),
                "max_abs_diff": float((out.float() - expected.float()).abs().max())}
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
