"""Benchmark: drafter_eval's speculative decoding in one process against `--workers` processes (`EvalWorkers`).

The same held-out prompts (first user turns rendered with the target's chat template: from a work store's last
raw_prompts shard with ``--store``, else the embedded ShareGPT file), the same drafter checkpoint (``--drafter``;
default: an untrained 5-layer one, so tau is ~1 and every verification yields one token), greedy, float32, each
prompt decoded at batch 1 with the lossless check, as ``eval_recipe`` does. The peer is ``workers=1`` in the
same invocation (``evaluate_drafter`` in this process). Batch-1 decoding is bound by the host launching kernels,
so on a GPU the question is how many processes one device serves before it becomes the bound.

Prints one JSON object: per worker count the wall time, verifications/s, the speedup over one process, and
whether the rows equal the one-process rows; the machine.

    .venv/bin/python bench/eval_workers.py --prompts 8 --new-tokens 32 --workers 1 2
    # on the GPU host, over the product bench's work directory:
    python3 bench/eval_workers.py --target "$(cat /tmp/smollm2-product/target_dir)" \\
        --store /tmp/smollm2-product/store --drafter DIR --prompts 32 --new-tokens 128 --workers 1 4 8

Reads: the target model dir, a drafter checkpoint dir, a store or the embedded ShareGPT file. Writes a
temporary drafter checkpoint when none is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402


def user_turns(n: int, store_dir: str | None) -> list[str]:
    if store_dir:
        from dflash_assets.store import layout
        from dflash_assets.store.backends import LocalStore

        store = LocalStore(store_dir)
        table = store.read_parquet(layout.raw_prompts(layout.list_raw_prompt_shards(store)[-1]))
        return [row["user_turns"][0] for row in table.to_pylist()[:n]]
    from dflash_assets.prompts.sources import sharegpt_records

    out = []
    for record in sharegpt_records(4 * n):
        text = next((t.get("value") for t in record.get("conversations") or [] if t.get("from") == "human"), None)
        if isinstance(text, str) and text.strip():
            out.append(text)
        if len(out) == n:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="model dir (default: the converted SmolLM2)")
    parser.add_argument("--store", default=None, help="a local store whose last raw_prompts shard gives the prompts")
    parser.add_argument("--drafter", default=None, help="drafter checkpoint dir (default: untrained, 5 layers)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    import torch

    from dflash_assets.drafter.decoding import EvalPrompt, evaluate_drafter, load_target
    from dflash_assets.drafter.eval_workers import EvalWorkers
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
    from dflash_assets.target_model.conventions import mask_token_id_in_dir
    from dflash_assets.target_model.spec import TargetModelSpec

    if args.target is None:
        from dflash_assets.embedded.smollm2 import smollm2_target_path

        args.target = str(smollm2_target_path())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chat = TargetModelSpec(model_path=args.target, dtype="float32").chat()
    prompts = [EvalPrompt(tuple(chat.encode(chat.render([{"role": "user", "content": text}],
                                                        add_generation_prompt=True))[-1024:]), "chat", f"p{i}")
               for i, text in enumerate(user_turns(args.prompts, args.store))]
    stop = sorted(chat.stop_ids)
    with tempfile.TemporaryDirectory(prefix="eval-workers-") as tmp:
        drafter_dir = args.drafter
        if drafter_dir is None:
            cfg = DrafterConfig.from_target_config(load_target_config(args.target), num_layers=5,
                                                   mask_token_id=mask_token_id_in_dir(args.target))
            torch.manual_seed(0)
            drafter_dir = str(save_drafter(DFlashDrafter(cfg), Path(tmp) / "drafter", dtype=torch.float32))
        runs, reference = [], None
        for workers in args.workers:
            t0 = time.perf_counter()
            if workers == 1:
                target = load_target(args.target, device, torch.float32)
                evaluate_drafter(drafter_dir, target, prompts[:1], max_new_tokens=4, stop_token_ids=stop)  # warm
                start = time.perf_counter()
                result = evaluate_drafter(drafter_dir, target, prompts, max_new_tokens=args.new_tokens,
                                          stop_token_ids=stop)
                del target
            else:
                with EvalWorkers(args.target, workers, device=device, dtype="float32") as pool:
                    pool.start()  # every worker loaded its target
                    pool.evaluate(drafter_dir, prompts[:workers], max_new_tokens=4, stop_token_ids=stop)  # warm
                    start = time.perf_counter()
                    result = pool.evaluate(drafter_dir, prompts, max_new_tokens=args.new_tokens, stop_token_ids=stop)
            wall = time.perf_counter() - start
            rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in result.per_prompt]
            reference = reference if reference is not None else rows
            runs.append({"workers": workers, "wall_s": round(wall, 2), "load_s": round(start - t0, 2),
                         "verifications": result.num_verifications, "new_tokens": result.num_new_tokens,
                         "verifications_per_s": round(result.num_verifications / wall, 1),
                         "tau": round(result.tau, 4), "lossless": result.lossless,
                         "rows_equal_first_run": rows == reference})
    base = runs[0]["verifications_per_s"]
    for run in runs:
        run["speedup_over_first"] = round(run["verifications_per_s"] / base, 2) if base else None
    print(json.dumps({"benchmark": "eval_workers", "target": Path(args.target).name, "device": device,
                      "prompts": len(prompts), "new_tokens": args.new_tokens, "runs": runs,
                      "machine": machine_info("torch", "transformers")}, indent=2))


if __name__ == "__main__":
    main()
