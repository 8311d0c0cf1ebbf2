"""The drafter stages over the store (dflash_assets.drafter.stages): recipes stored under their names and read back
(a missing one named), the shards a recipe trains on, the objective as shown, the learning curve's best checkpoint
marked, held-out prompts disjoint from training, and checkpoints compared by their tensors. Training and evaluating a
recipe through these stages are tested in test_preflight.py, test_promotion.py, test_eval_workers.py and, end to end,
tests/test_end_to_end.py."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.drafter.stages import (_mark_curve, load_recipe, objective_of, recipe_from_json, save_recipe,
                                          torch_dtype, training_shards)
from dflash_assets.store import layout


def test_a_recipe_is_stored_under_its_name_and_read_back(local_store):
    recipe = DrafterRecipe(name="demo-v2", partitions=("shard-00000", "shard-00001"), block_size=8)
    assert save_recipe(local_store, recipe) == layout.drafter_recipe("demo-v2")
    assert load_recipe(local_store, "demo-v2") == recipe
    assert recipe_from_json(local_store.read_bytes(layout.drafter_recipe("demo-v2")).decode()) == recipe
    with pytest.raises(FileNotFoundError, match="no recipe 'demo-v3'.*register it first"):
        load_recipe(local_store, "demo-v3")
    with pytest.raises(ValueError, match="partition key without '/'"):
        save_recipe(local_store, DrafterRecipe(name="a/b"))


def test_training_shards_are_the_selection_else_every_shard_with_samples(local_store):
    assert training_shards(local_store, DrafterRecipe(name="r", partitions=("shard-00002",))) == ["shard-00002"]
    for shard in ("shard-00001", "shard-00000"):
        local_store.write_parquet(layout.tokenized_samples(shard), pa.table({"prompt_id": ["p"]}))
    assert training_shards(local_store, DrafterRecipe(name="r", online=True)) == ["shard-00000", "shard-00001"]
    assert training_shards(local_store, DrafterRecipe(name="r")) == []  # no hidden-state cache yet


def test_objective_and_dtype_names():
    assert objective_of(DrafterRecipe(name="r", objective="dflash")) == "dflash (gamma 7)"
    assert objective_of(DrafterRecipe(name="r")) == "dpace (alpha 0.5)"
    assert objective_of(DrafterRecipe(name="r", objective="dpace", dpace_alpha=0.25)) == "dpace (alpha 0.25)"
    assert torch_dtype(None) is None and torch_dtype("bfloat16") == torch.bfloat16


def test_the_best_checkpoint_is_marked_on_the_curve_up_to_the_last_step():
    curve = [{"step": s, "tokens": 100 * s, "file": f"ckpt/step-{s}.safetensors", "best": True} for s in (20, 10, 30)]
    result = SimpleNamespace(steps=20, tau_history=[{"step": 10, "tau": 1.4}, {"step": 20, "tau": 1.6}],
                             best={"step": 20, "tokens": 2000, "tau": 1.6})
    marked, best = _mark_curve(curve, result)
    assert [c["step"] for c in marked] == [10, 20]  # in order; step 30 is past the run's last step
    assert marked[0] == {"step": 10, "tokens": 1000, "file": "ckpt/step-10.safetensors", "tau_estimate": 1.4}
    assert marked[1]["best"] is True and best == {"step": 20, "tokens": 2000, "tau": 1.6,
                                                  "file": "ckpt/step-20.safetensors"}
    assert _mark_curve(curve, SimpleNamespace(steps=20, tau_history=[], best=None))[1] is None


def test_heldout_prompts_are_disjoint_from_training_by_id_and_by_text(tmp_path, tiny_dense_target):
    """ShareGPT repeats first turns under new ids: a held-out prompt whose text a trained shard holds is skipped."""
    import pyarrow as pa

    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import heldout_prompts
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec

    store = LocalStore(tmp_path / "store")

    def shard(name, rows):
        store.write_parquet(layout.raw_prompts(name), pa.Table.from_pylist(
            [{"prompt_id": pid, "system": None, "user_turns": turns, "category": None} for pid, turns in rows]))

    shard("shard-00000", [("a", ["hi", "tell me more"]), ("b", ["write a poem"])])
    shard("shard-00001", [("c", ["hi"]), ("d", ["tell me more"]), ("e", ["what is 2+2?"])])
    recipe = DrafterRecipe(name="r", partitions=("shard-00000",), online=True)
    prompts, held_out = heldout_prompts(store, recipe, TargetModelSpec(model_path=str(tiny_dense_target)), 8)
    assert held_out and [p.prompt_id for p in prompts] == ["e"]  # c and d repeat trained user turns
    assert prompts[0].category == "unknown" and len(prompts[0].input_ids) > 0




def test_same_weights_compares_tensors_not_bytes(local_store, tmp_path):
    import torch
    from safetensors.torch import save_file

    from dflash_assets.drafter.stages import _same_weights

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    variants = {
        "first": (tensors, {"format": "pt", "recipe": "x"}),
        "header": (tensors, {"recipe": "x", "format": "pt", "note": "saved again"}),
        "value": ({**tensors, "b": torch.full((4,), 2.0, dtype=torch.bfloat16)}, {"format": "pt"}),
        "dtype": ({**tensors, "a": tensors["a"].double()}, {"format": "pt"}),
        "names": ({"a": tensors["a"]}, {"format": "pt"}),
    }
    for name, (ts, meta) in variants.items():
        save_file(ts, str(tmp_path / f"{name}.safetensors"), metadata=meta)
        local_store.upload_file(f"w/{name}.safetensors", tmp_path / f"{name}.safetensors")
    local_store.write_bytes("w/garbage.safetensors", b"not a safetensors file")
    assert _same_weights(local_store, "w/first.safetensors", "w/header.safetensors")
    for other in ("value", "dtype", "names", "garbage", "missing"):
        assert not _same_weights(local_store, "w/first.safetensors", f"w/{other}.safetensors"), other
    assert not _same_weights(local_store, None, "w/first.safetensors")

