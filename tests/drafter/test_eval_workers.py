"""drafter_eval over worker processes (`eval_workers.EvalWorkers`, `eval_recipe(workers=...)`): the same tau, rows
and learning curve as decoding in one process."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_assets.drafter.decoding import EvalPrompt, evaluate_drafter, load_target
from dflash_assets.drafter.eval_workers import EvalWorkers
from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.store import layout
from dflash_assets.target_model.conventions import mask_token_id_in_dir


def _without_wall(rows):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def _drafter(target_dir, seed: int) -> DFlashDrafter:
    cfg = DrafterConfig.from_target_config(load_target_config(target_dir), num_layers=1, block_size=4,
                                           mask_token_id=mask_token_id_in_dir(target_dir))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg)


def test_workers_give_the_rows_of_one_process_in_prompt_order(tmp_path, tiny_dense_target):
    torch.set_num_threads(1)  # as each of the two workers on this 2-core machine: the same kernels, the same sums
    ckpt = save_drafter(_drafter(tiny_dense_target, 0), tmp_path / "drafter", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [EvalPrompt(tuple(torch.randint(0, 248000, (12 + 3 * i,), generator=g).tolist()),
                          ("chat", "code")[i % 2], f"p{i}", ("category:" + ("chat", "code")[i % 2],))
               for i in range(5)]
    alone = evaluate_drafter(ckpt, load_target(tiny_dense_target, "cpu"), prompts, max_new_tokens=10)
    finished: list[int] = []
    with EvalWorkers(tiny_dense_target, 2, device="cpu") as pool:
        pool.start()  # both load the target now; returns once both have
        spread = pool.evaluate(ckpt, prompts, max_new_tokens=10, on_prompt=lambda i, row: finished.append(i))
        # a checkpoint rewritten in place is loaded again by the workers, not served from their last load
        save_drafter(_drafter(tiny_dense_target, 1), tmp_path / "drafter", dtype=torch.float32)
        other = pool.evaluate(ckpt, prompts[:2], max_new_tokens=10, check_lossless=False)
    assert spread.lossless and alone.lossless
    assert _without_wall(spread.per_prompt) == _without_wall(alone.per_prompt)
    assert [r["prompt_id"] for r in spread.per_prompt] == [p.prompt_id for p in prompts]
    assert sorted(finished) == list(range(5))
    assert (spread.tau, spread.acceptance_length_counts, spread.num_new_tokens) == \
        (alone.tau, alone.acceptance_length_counts, alone.num_new_tokens)
    rewritten = evaluate_drafter(ckpt, load_target(tiny_dense_target, "cpu"), prompts[:2], max_new_tokens=10,
                                 check_lossless=False)
    assert _without_wall(other.per_prompt) == _without_wall(rewritten.per_prompt)
    with pytest.raises(ValueError, match="at least 1"):
        EvalWorkers(tiny_dense_target, 0)
    with pytest.raises(ValueError, match="unknown dtype"):
        EvalWorkers(tiny_dense_target, 2, dtype="float33")
    # the rule is decoding.evaluation_dtype's: resolved once here, the same for every worker
    with EvalWorkers(tiny_dense_target, 1, device="cpu") as default, \
            EvalWorkers(tiny_dense_target, 1, device="cpu", dtype="bf16") as named:
        assert (default.dtype, named.dtype) == ("float32", "bfloat16")


@pytest.mark.slow
def test_eval_recipe_with_workers_reports_what_one_process_does(tmp_path, tiny_dense_target):
    """eval_recipe(workers=2) on a real store: tau, rows and the learning curve (each curve checkpoint in its own
    directory) equal eval_recipe's in one process; the metadata says how many workers ran."""
    import pyarrow as pa
    from safetensors.torch import save_file

    from dflash_assets.drafter.model import drafter_state_dict
    from dflash_assets.drafter.stages import eval_recipe, save_recipe
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.store.manifest import publish_files
    from dflash_assets.target_model.spec import TargetModelSpec

    torch.set_num_threads(1)
    store = LocalStore(tmp_path / "store")
    for shard, texts in (("shard-00000", ["write a poem"]),
                         ("shard-00001", ["what is 2+2?", "name three colors", "say hi", "count to five"])):
        store.write_parquet(layout.raw_prompts(shard), pa.Table.from_pylist(
            [{"prompt_id": f"{shard}-{i}", "system": None, "user_turns": [t], "category": "chat", "tools": None}
             for i, t in enumerate(texts)]))
    save_recipe(store, DrafterRecipe(name="demo-v1", partitions=("shard-00000",), online=True, num_layers=1,
                                     block_size=4))
    ckpt = save_drafter(_drafter(tiny_dense_target, 0), tmp_path / "ckpt")
    save_file({k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in drafter_state_dict(_drafter(tiny_dense_target, 1)).items()},
              str(ckpt / "curve-step-00000005.safetensors"))
    (ckpt / "train_metrics.json").write_text(json.dumps(
        {"curve": [{"step": 5, "tokens": 640, "file": "curve-step-00000005.safetensors"}]}))
    publish_files(store, layout.drafter_checkpoint_manifest("demo-v1"), layout.drafter_checkpoint_prefix("demo-v1"),
                  {f: ckpt / f for f in ("model.safetensors", "config.json", "train_metrics.json",
                                         "curve-step-00000005.safetensors")})
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")

    def run(workers):
        meta = eval_recipe(store, "demo-v1", spec, num_prompts=4, max_new_tokens=8, device="cpu", dtype="float32",
                           curve_prompts=2, workers=workers)
        return meta, json.loads(store.read_bytes(layout.drafter_eval("demo-v1")))

    (one, one_json), (two, two_json) = run(1), run(2)
    assert (one["workers"], two["workers"]) == (1, 2)
    assert one["num_prompts"] == two["num_prompts"] == 4 and one["lossless"] and two["lossless"]
    same = ("tau", "num_verifications", "num_new_tokens", "acceptance_by_position", "learning_curve")
    assert {k: two[k] for k in same} == {k: one[k] for k in same}
    assert _without_wall(two_json["per_prompt"]) == _without_wall(one_json["per_prompt"])
    assert len(one["learning_curve"]) == 1 and one["learning_curve"][0][0] == 640
    assert [c["tau"] for c in two_json["learning_curve"]] == [c["tau"] for c in one_json["learning_curve"]]
