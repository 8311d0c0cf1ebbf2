"""Promotion by tau per slice.

The decision rule of ``dflash_assets.drafter.promotion`` on measured candidates (best tau wins; a slice that
falls more than the margin below the promoted checkpoint's blocks it, and the reason names the slice with its
numbers), slices and pooled tau per slice, the promoted manifest in a real ``LocalStore``; then the whole demo
graph on the tiny target with learning-curve checkpoints: ``drafter_eval``'s blocking ``promotion`` check passes
on the first run and writes ``drafter_promoted/demo/manifest.json`` naming files that exist in the store, and
the metadata carries tau by slice and the per-slice learning-curve chart.
"""

from __future__ import annotations

import pytest

from dflash_assets.drafter.promotion import (
    Candidate,
    decide_promotion,
    length_bucket,
    prompt_slices,
    read_promoted,
    tau_by_slice,
    write_promoted,
)
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.store import layout


def previous_manifest(tau: float, slices: dict[str, float]) -> dict:
    return {"recipe": "demo-v1", "checkpoint": "final", "tau": tau, "slices": slices}


def test_first_checkpoint_is_promoted_and_the_best_tau_wins():
    cands = [Candidate("curve-step-00000002.safetensors", 100, 1.4, {"tools:without": 1.4}),
             Candidate("final", 300, 1.9, {"tools:without": 1.9}),
             Candidate("curve-step-00000004.safetensors", 200, 1.6, {"tools:without": 1.6})]
    decision = decide_promotion(cands, None)
    assert decision.promoted and decision.candidate.name == "final" and decision.reasons == []


def test_a_slice_that_regresses_beyond_the_margin_blocks_promotion_and_is_named():
    previous = previous_manifest(1.80, {"length:0-256": 1.9, "length:257-1024": 1.7, "category:code": 2.0})
    better_overall = Candidate("final", 500, 2.10, {"length:0-256": 2.3, "length:257-1024": 1.60,
                                                      "category:code": 2.5})
    decision = decide_promotion([better_overall], previous, margin=0.05)
    assert not decision.promoted
    assert [r["slice"] for r in decision.regressions] == ["length:257-1024"]
    meta = decision.to_metadata()
    assert meta["regressed_slices"] == ["length:257-1024: 1.700 -> 1.600 (drop 0.100 > margin 0.050)"]
    assert meta["previous_tau"] == 1.80 and meta["candidate_tau"] == 2.10
    # the same drop within a wider margin promotes
    assert decide_promotion([better_overall], previous, margin=0.15).promoted


def test_a_checkpoint_not_above_the_promoted_tau_is_not_promoted():
    previous = previous_manifest(1.80, {"tools:without": 1.8})
    decision = decide_promotion([Candidate("final", 10, 1.80, {"tools:without": 1.8})], previous)
    assert not decision.promoted and decision.regressions == []
    assert "not above" in decision.reasons[0]
    assert not decide_promotion([], previous).promoted
    with pytest.raises(ValueError):
        decide_promotion([Candidate("final", 1, 2.0, {})], None, margin=-0.1)


def test_the_promoted_checkpoint_itself_passes_without_being_promoted_again():
    """A re-run (a second `make demo`) evaluates the checkpoint that is promoted already: same tau, so it cannot
    beat it, but nothing regressed either; the check passes as already_promoted."""
    previous = previous_manifest(1.80, {"tools:without": 1.8})
    same = Candidate("final", 10, 1.80, {"tools:without": 1.8}, {"model.safetensors": "k"})
    decision = decide_promotion([same], previous, is_promoted=lambda c: c.files.get("model.safetensors") == "k")
    assert decision.already_promoted and decision.passed and not decision.promoted and decision.reasons == []
    meta = decision.to_metadata()
    assert (meta["already_promoted"], meta["passed"], meta["reasons"]) == (True, True, ["none"])
    other = decide_promotion([same], previous, is_promoted=lambda c: False)  # other weights, same tau: fails
    assert not other.passed and "not above" in other.reasons[0]


def test_slices_and_pooled_tau_by_slice():
    assert [length_bucket(n) for n in (1, 256, 257, 1024, 1025)] == ["0-256", "0-256", "257-1024", "257-1024",
                                                                      ">1024"]
    a = prompt_slices(thinking=True, has_tools=False, prompt_tokens=40, category="code")
    b = prompt_slices(thinking=True, has_tools=True, prompt_tokens=2000, category=None)
    assert a == ("thinking:on", "tools:without", "length:0-256", "category:code")
    assert b == ("thinking:on", "tools:with", "length:>1024", "category:unknown")
    rows = [{"slices": a, "accepted_tokens": 30, "verifications": 10},
            {"slices": b, "accepted_tokens": 10, "verifications": 10}]
    by_slice = tau_by_slice(rows)
    assert by_slice["thinking:on"] == 2.0  # pooled: 40 tokens / 20 verifications, not the mean of 3.0 and 1.0
    assert by_slice["tools:without"] == 3.0 and by_slice["tools:with"] == 1.0


def test_promoted_manifest_round_trips_in_the_store(local_store):
    assert read_promoted(local_store, "demo") is None
    sources = {"model.safetensors": "drafter_checkpoint/demo-v1/v1/model.safetensors",
               "config.json": "drafter_checkpoint/demo-v1/v1/config.json"}
    for name, key in sources.items():
        local_store.write_bytes(key, f"bytes of {name}".encode())
    cand = Candidate("final", 123, 1.75, {"tools:without": 1.75}, sources)
    write_promoted(local_store, "demo", "demo-v1", cand, config_key=sources["config.json"])
    doc = read_promoted(local_store, "demo")
    assert doc["tau"] == 1.75 and doc["recipe"] == "demo-v1" and doc["source_files"] == sources
    assert set(doc["files"]) == set(sources)
    assert all(key.startswith(f"drafter_promoted/demo/{doc['version']}/") for key in doc["files"].values())
    assert doc["config"] == doc["files"]["config.json"]
    for name, key in sources.items():  # the recipe's checkpoint goes away (a re-run publishes a new version)
        local_store.delete(key)
    assert local_store.read_bytes(doc["files"]["model.safetensors"]) == b"bytes of model.safetensors"

    for name, key in sources.items():
        local_store.write_bytes(key, f"new bytes of {name}".encode())
    second = write_promoted(local_store, "demo", "demo-v2", cand)
    assert second["version"] > doc["version"]
    assert not any(local_store.exists(key) for key in doc["files"].values())  # the older copy is deleted
    assert local_store.read_bytes(second["files"]["model.safetensors"]) == b"new bytes of model.safetensors"
    assert local_store.exists("drafter_promoted/demo/manifest.json")
    with pytest.raises(ValueError):
        layout.drafter_promoted_manifest("a/b")


def test_recipe_family_and_init_from():
    assert DrafterRecipe(name="demo-v3").family_name == "demo"
    assert DrafterRecipe(name="x", family="qwen3").family_name == "qwen3"
    # unset fields keep the fingerprint of recipes written without them
    assert DrafterRecipe(name="demo-v1").fingerprint() == DrafterRecipe.from_dict(
        {k: v for k, v in DrafterRecipe(name="demo-v1").to_dict().items() if k not in ("family", "init_from")}
    ).fingerprint()
    assert DrafterRecipe(name="demo-v1", init_from="promoted").fingerprint() != DrafterRecipe(name="demo-v1").fingerprint()
    with pytest.raises(ValueError, match="init_from"):
        DrafterRecipe.from_dict({"name": "demo-v1", "init_from": "latest"})


@pytest.mark.slow
def test_eval_recipe_promotes_the_first_checkpoint_and_not_one_that_does_not_beat_it(tmp_path, tiny_dense_target):
    """eval_recipe on a real store and the tiny target: tau by slice (tools with/without from the raw prompts'
    tools column), the promoted manifest naming store keys that exist, then a second recipe of the family whose
    checkpoint does not beat the promoted one (re-measured on the same prompts) is not promoted."""
    import shutil

    import pyarrow as pa
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
    from dflash_assets.drafter.stages import eval_recipe, save_recipe
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.store.manifest import publish_files
    from dflash_assets.target_model.spec import TargetModelSpec
    from dflash_assets.target_model.conventions import mask_token_id_in_dir

    store = LocalStore(tmp_path / "store")
    tools = '[{"type": "function", "function": {"name": "get_time", "parameters": {}}}]'
    for shard, rows in (("shard-00000", [("a", "write a poem", None)]),
                        ("shard-00001", [("b", "what is 2+2?", None), ("c", "what time is it?", tools),
                                         ("d", "name three colors", None)])):
        store.write_parquet(layout.raw_prompts(shard), pa.Table.from_pylist(
            [{"prompt_id": pid, "system": None, "user_turns": [text], "category": "chat", "tools": t}
             for pid, text, t in rows]))
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    cfg = DrafterConfig.from_target_config(load_target_config(tiny_dense_target), num_layers=1,
                                           mask_token_id=mask_token_id_in_dir(tiny_dense_target))
    for seed, name in ((0, "demo-v1"), (1, "demo-v2")):
        save_recipe(store, DrafterRecipe(name=name, partitions=("shard-00000",), online=True, num_layers=1))
        torch.manual_seed(seed)
        ckpt = save_drafter(DFlashDrafter(cfg), tmp_path / name)
        publish_files(store, layout.drafter_checkpoint_manifest(name), layout.drafter_checkpoint_prefix(name),
                      {f: ckpt / f for f in ("model.safetensors", "config.json")})

    first = eval_recipe(store, "demo-v1", spec, num_prompts=3, max_new_tokens=6, device="cpu", dtype="float32",
                        promotion_margin=0.05)
    assert {"tools:with", "tools:without", "thinking:on", "category:chat"} <= set(first["tau_by_slice"])
    assert first["promotion"]["promoted"] is True and first["promotion"]["family"] == "demo"
    promoted = read_promoted(store, "demo")
    assert promoted["recipe"] == "demo-v1" and promoted["tau"] == first["promotion"]["candidate_tau"]
    assert all(store.exists(key) for key in promoted["files"].values())

    # A re-run of the promoted recipe (a second `make demo`) publishes the same weights as a new checkpoint
    # version, which deletes the old version's files; the promoted drafter keeps its own copy, and passes.
    # Saved again, the same tensors need not be the same bytes (safetensors orders the metadata map freely).
    again_dir = tmp_path / "demo-v1-again"
    again_dir.mkdir()
    save_file(load_file(tmp_path / "demo-v1" / "model.safetensors"), str(again_dir / "model.safetensors"),
              metadata={"saved": "again", "format": "pt"})
    shutil.copy(tmp_path / "demo-v1" / "config.json", again_dir / "config.json")
    assert (again_dir / "model.safetensors").read_bytes() != (tmp_path / "demo-v1" / "model.safetensors").read_bytes()
    publish_files(store, layout.drafter_checkpoint_manifest("demo-v1"), layout.drafter_checkpoint_prefix("demo-v1"),
                  {f: again_dir / f for f in ("model.safetensors", "config.json")})
    assert not any(store.exists(key) for key in promoted["source_files"].values())
    assert all(store.exists(key) for key in read_promoted(store, "demo")["files"].values())
    again = eval_recipe(store, "demo-v1", spec, num_prompts=3, max_new_tokens=6, device="cpu", dtype="float32",
                        promotion_margin=0.05)  # a re-run of the promoted recipe passes: same weights
    assert again["promotion"]["already_promoted"] is True and again["promotion"]["passed"] is True
    assert again["promotion"]["remeasured_previous"] is True
    assert again["promotion"]["promoted"] is False and read_promoted(store, "demo")["recipe"] == "demo-v1"

    # A promoted manifest that names the checkpoint's own keys (not copies), which a re-run deleted: the next
    # evaluation replaces the ghost instead of failing against its recorded tau.
    ghost = {**read_promoted(store, "demo"), "files": dict(promoted["source_files"])}
    store.write_json(layout.drafter_promoted_manifest("demo"), ghost)
    repaired = eval_recipe(store, "demo-v1", spec, num_prompts=3, max_new_tokens=6, device="cpu", dtype="float32",
                           promotion_margin=0.05)
    assert repaired["promotion"]["promoted"] is True and repaired["promotion"]["passed"] is True
    assert repaired["promotion"]["replaced_missing_previous"]["recipe"] == "demo-v1"
    assert all(store.exists(key) for key in read_promoted(store, "demo")["files"].values())

    second = eval_recipe(store, "demo-v2", spec, num_prompts=3, max_new_tokens=6, device="cpu", dtype="float32",
                         promotion_margin=0.05, serving_speed_prompts=2)
    served = second["serving_speed"]  # the served path (bfloat16, static caches; eager on a CPU) beside tau
    assert (served["num_prompts"], served["dtype"], served["graphs"]) == (2, "bfloat16", False)
    assert served["target_tokens"] == served["speculative_tokens"] == 12 and served["speedup"] > 0
    p = second["promotion"]
    assert p["remeasured_previous"] is True and p["previous_recipe"] == "demo-v1"
    assert p["tau_delta"] == round(p["candidate_tau"] - p["previous_tau"], 4)
    assert p["already_promoted"] is False  # other weights
    if p["candidate_tau"] <= p["previous_tau"]:
        assert p["promoted"] is False and read_promoted(store, "demo")["recipe"] == "demo-v1"
    else:  # an untrained drafter can beat another by chance; then it must be the one promoted
        assert read_promoted(store, "demo")["recipe"] == ("demo-v2" if p["promoted"] else "demo-v1")


def test_learning_curve_by_slice_is_drawn_as_a_chart_with_one_line_per_slice():
    from dagster_project.metadata import PIPES_CHARTS

    value = PIPES_CHARTS["learning_curve_by_slice"]({"tools:with": [[1e6, 1.2], [2e6, 1.5]],
                                                      "tools:without": [[1e6, 1.3], [2e6, 1.9]]})
    assert value.md_str.startswith("![learning curve by slice](data:image/png;base64,")
    assert "2 slices; last checkpoint: tools:with 1.50, tools:without 1.90." in value.md_str


