"""Benchmark: the in-process Transformers engine, one request at a time against its batches.

The same real ShareGPT prompts (the first ``--prompts`` valid ones, first user turn,
``--max-new-tokens`` each, greedy) go through ``TransformersEngine`` twice in one
process: with ``max_concurrency=1`` (one ``generate`` per request, as the engine did
before it batched) and with ``max_concurrency=--batch`` (the requests in flight
batched into one left-padded ``generate``). Both runs send every request at once;
the engine decides how many share a call. The peer is the one-at-a-time run, so the
ratio is measured on the same machine, model, prompts and load. The target is
SmolLM2-135M-Instruct (``make smollm2``) unless ``--target`` names another model dir.

Prints one JSON object: per mode the wall time, generated tokens, tokens/s, the
generate calls and their rows; the speedup; how many answers were identical; and the machine.

    .venv/bin/python bench/inprocess_engine.py --prompts 64 --batch 32 --max-new-tokens 64

Reads: the model dir, the embedded ShareGPT file. Writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402


def first_user_turns(n: int) -> list[str]:
    from dflash_assets.prompts.sources import sharegpt_records

    out = []
    for record in sharegpt_records(4 * n):
        turns = record.get("conversations") or []
        text = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if isinstance(text, str) and text.strip() and len(text) < 2000:
            out.append(text)
        if len(out) == n:
            break
    return out


async def run_mode(target: str, questions: list[str], concurrency: int, max_new_tokens: int) -> dict:
    from dflash_assets.generation.engines import GenerationConfig, TransformersEngine

    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, enable_thinking=False)
    async with TransformersEngine(target, dtype="float32", max_concurrency=concurrency) as engine:
        await engine.probe()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.chat([{"role": "user", "content": q}], gen) for q in questions))
        wall = time.perf_counter() - t0
        tokens = sum(r.completion_tokens for r in results)
        return {"concurrency": concurrency, "wall_s": round(wall, 2), "generated_tokens": tokens,
                "tokens_per_s": round(tokens / wall, 1), "generate_calls": len(engine.batch_sizes),
                "rows_per_call": engine.batch_sizes if concurrency > 1 else 1,
                "answers": [r.content for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="model dir (default: the converted SmolLM2)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    if args.target is None:
        from dflash_assets.embedded.smollm2 import smollm2_target_path

        args.target = str(smollm2_target_path())
    questions = first_user_turns(args.prompts)
    single = asyncio.run(run_mode(args.target, questions, 1, args.max_new_tokens))
    batched = asyncio.run(run_mode(args.target, questions, args.batch, args.max_new_tokens))
    same = sum(a == b for a, b in zip(single.pop("answers"), batched.pop("answers")))
    print(json.dumps({
        "benchmark": "inprocess_engine", "target": Path(args.target).name, "prompts": len(questions),
        "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(),
        "one_at_a_time": single, "batched": batched,
        "speedup": round(batched["tokens_per_s"] / single["tokens_per_s"], 2),
        "identical_answers": same, "machine": machine_info("torch", "transformers"),
    }, indent=2))


if __name__ == "__main__":
    main()
