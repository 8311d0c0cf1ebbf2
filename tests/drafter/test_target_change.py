"""A refresh when the target changes.

1. The target's identity is in the code version of completions and everything downstream: the asset modules
   imported (in fresh interpreters) under two targets that differ, the tiny dense target against the same
   target with another chat template, and against a copy with one weight changed, give different code versions
   for completions, tokenized_samples, hidden_state_cache, drafter_checkpoint and drafter_eval. (The copy
   differs by its path and by its weights: the fingerprint samples the weight files too; one weight changed in
   place at the same path is ``tests/drafter/test_refresh.py``'s.)
2. Warm start (``init_weights``, what a recipe with ``init_from: promoted`` passes): a drafter trained on a
   small target, then a second run started from its published weights on a target that differs (one weight
   changed) starts from a lower loss than a random init; a drafter of other shapes is refused with a clear error.
   Through the store: a recipe with ``init_from: promoted`` trains from the checkpoint the family's promoted
   manifest names (metadata ``warm_start``).
3. ``refresh_drafter_job`` is registered for the drafter assets, and drafter_eval declares ``promotion``. The one
   action that runs the refresh, ``target_refresh_sensor``, is ``tests/drafter/test_refresh.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.training import train_drafter
from tests.drafter.test_model import (MINI_MASK, MINI_VOCAB, greedy_sequences, mini_target,  # noqa: F401
                                      publish_tiny_cache, write_cache)
from tests.drafter.test_training import mini_recipe

REPO = Path(__file__).resolve().parents[2]
TARGET_ASSETS = ("completions", "tokenized_samples", "hidden_state_cache", "drafter_checkpoint", "drafter_eval")

PRINT_CODE_VERSIONS = """
import json
from dagster_project.assets import drafter, generation, hidden_states, tokenization
print(json.dumps({k.to_user_string(): v for m in (generation, tokenization, hidden_states, drafter)
                  for a in vars(m).values() if hasattr(a, "code_versions_by_key")
                  for k, v in a.code_versions_by_key.items()}))
"""


def code_versions(env: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_TARGET_")}
    out = subprocess.run([sys.executable, "-c", PRINT_CODE_VERSIONS], env={**clean, "PYTHONPATH": str(REPO), **env},
                         capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def with_one_weight_changed(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    save_file(weights, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow
def test_two_targets_that_differ_give_other_code_versions_downstream(tiny_dense_target, tmp_path):
    template = tmp_path / "other.jinja"
    template.write_text((Path(tiny_dense_target) / "chat_template.jinja").read_text() + "{# another revision #}\n")
    finetuned = with_one_weight_changed(Path(tiny_dense_target), tmp_path / "finetuned")
    base = code_versions({"DFLASH_TARGET_MODEL": str(tiny_dense_target)})
    other_template = code_versions({"DFLASH_TARGET_MODEL": str(tiny_dense_target),
                                    "DFLASH_TARGET_CHAT_TEMPLATE": str(template)})
    other_weights = code_versions({"DFLASH_TARGET_MODEL": str(finetuned)})
    for name in TARGET_ASSETS:
        assert base[name] != other_template[name], name
        assert base[name] != other_weights[name], name
    assert base == code_versions({"DFLASH_TARGET_MODEL": str(tiny_dense_target)})  # stable for the same target


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory):
    """A small-vocab target and a copy with one weight changed, each with a cache of its own greedy outputs."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("refresh")
    out = {}
    for name, tdir in (("old", mini_target(base / "old")), ("new", None)):
        if tdir is None:
            tdir = with_one_weight_changed(out["old"]["target_dir"], base / "new")
        target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
        seqs = greedy_sequences(target, n=16, prompt_len=8, new_tokens=40, seed=0, vocab_hi=MINI_VOCAB - 12)
        out[name] = {"target_dir": Path(tdir), "cache": write_cache(base / f"{name}.safetensors", target, seqs,
                                                                    layer_ids=[1, 3])}
    return out


@pytest.mark.slow
def test_warm_start_from_the_old_targets_drafter_starts_lower_and_other_shapes_are_refused(two_targets, tmp_path):
    old, new = two_targets["old"], two_targets["new"]
    promoted = train_drafter(mini_recipe(), [old["cache"]], old["target_dir"], tmp_path / "old", resume=False,
                             device="cpu")
    weights = Path(promoted.checkpoint_dir) / "model.safetensors"
    cold = train_drafter(mini_recipe(epochs=1), [new["cache"]], new["target_dir"], tmp_path / "cold", resume=False,
                         device="cpu")
    warm = train_drafter(mini_recipe(epochs=1), [new["cache"]], new["target_dir"], tmp_path / "warm", resume=False,
                         device="cpu", init_weights=weights)
    assert warm.losses[0] < cold.losses[0] * 0.9, (warm.losses[0], cold.losses[0])
    with pytest.raises(ValueError, match="other tensors or shapes"):
        train_drafter(mini_recipe(num_layers=1), [new["cache"]], new["target_dir"], tmp_path / "other", resume=False,
                      device="cpu", init_weights=weights)


def test_refresh_job_is_registered_for_the_drafter_assets_per_recipe():
    import dagster as dg

    from dagster_project.definitions import defs

    job = defs.resolve_job_def("refresh_drafter_job")
    keys = {k.to_user_string() for k in job.asset_layer.executable_asset_keys}
    assert keys == {"drafter_checkpoint", "drafter_eval"}
    assert job.partitions_def is not None and job.tags["dflash/refresh"] == "true"
    checks = {k.name for k in defs.resolve_asset_graph().asset_check_keys if k.asset_key == dg.AssetKey("drafter_eval")}
    assert "promotion" in checks


@pytest.mark.slow
def test_a_recipe_with_init_from_promoted_trains_from_the_promoted_checkpoint_in_the_store(tmp_path,
                                                                                        tiny_dense_target):
    """train_recipe through the store: the family's promoted manifest names the first recipe's published
    checkpoint; the next recipe (init_from promoted) downloads it, starts from a lower loss, and says so; one of
    other shapes trains from a random init and says why."""
    from dflash_assets.drafter.promotion import Candidate, write_promoted
    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import save_recipe, train_recipe
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec

    torch.set_num_threads(1)
    store = LocalStore(tmp_path / "store")
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    publish_tiny_cache(store, tmp_path, tiny_dense_target)
    base = dict(partitions=("shard-00000",), num_layers=1, block_size=8, epochs=2, batch_size=2, max_anchors=8,
                lr=3e-3, save_every=2, compile=False)
    save_recipe(store, DrafterRecipe(name="tiny-v1", **base))
    first = train_recipe(store, "tiny-v1", spec, work_dir=str(tmp_path / "work"), device="cpu")
    assert "warm_start" not in first
    write_promoted(store, "tiny", "tiny-v1", Candidate("final", first["sequence_tokens"], 1.5, {},
                                                       layout.drafter_checkpoint_files(store, "tiny-v1")))
    save_recipe(store, DrafterRecipe(name="tiny-v2", init_from="promoted", **base))
    second = train_recipe(store, "tiny-v2", spec, work_dir=str(tmp_path / "work"), device="cpu")
    assert second["warm_start"] == {"recipe": "tiny-v1", "checkpoint": "final", "tau": 1.5}
    assert second["first_loss"] < 0.9 * first["first_loss"], (second["first_loss"], first["first_loss"])
    # a recipe of other shapes in the family: the promoted weights do not fit, so it trains from a random init
    save_recipe(store, DrafterRecipe(name="tiny-v3", init_from="promoted", **{**base, "num_layers": 2}))
    third = train_recipe(store, "tiny-v3", spec, work_dir=str(tmp_path / "work"), device="cpu")
    assert third["warm_start"] == {"recipe": "tiny-v1", "checkpoint": "final", "tau": 1.5, "skipped": "shapes differ"}
    assert third["steps"] == third["total_steps"] and third["first_loss"] > second["first_loss"]
