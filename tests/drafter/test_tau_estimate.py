"""tau while training: the teacher-forced estimate against decoding, the slice on disk, the history and the best
checkpoint inside a run (and after a resume), the early stop, and what train_recipe publishes."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_assets.drafter.decoding import EvalPrompt, evaluate_drafter
from dflash_assets.drafter.model import TargetHead, load_drafter
from dflash_assets.drafter.tau_estimate import (
    TauWatch,
    build_slice,
    estimate_tau,
    load_slice,
    save_slice,
    teacher_forced_tau,
)
from dflash_assets.drafter.training import train_drafter
from tests.drafter.test_training import mini, mini_recipe  # noqa: F401


@pytest.fixture(scope="module")
def heldout(mini):
    """8 random prompts the mini drafter never trained on, with the target's greedy continuations (layers 1, 3)."""
    g = torch.Generator().manual_seed(123)
    prompts = [EvalPrompt(tuple(torch.randint(0, 500, (8,), generator=g).tolist()), "chat", f"h{i}")
               for i in range(8)]
    return build_slice(mini["target"], prompts, [1, 3], max_new_tokens=20)


@pytest.fixture(scope="module")
def seen(mini):
    """A slice of 8 prompts the mini drafter trains on: there the estimate moves within a few steps."""
    prompts = [EvalPrompt(tuple(ids[:8]), "chat", f"p{i}") for i, (ids, _) in enumerate(mini["seqs"][:8])]
    return build_slice(mini["target"], prompts, [1, 3], max_new_tokens=24)


def test_the_slice_round_trips_through_its_file(heldout, tmp_path):
    assert len(heldout) == 8 and heldout.continuation_tokens == 8 * 20
    back = load_slice(save_slice(tmp_path / "slice.safetensors", heldout))
    assert back.layer_ids == (1, 3) and back.prompt_ids == heldout.prompt_ids and back.prompt_lens == [8] * 8
    for a, b in zip(heldout.input_ids, back.input_ids):
        assert torch.equal(a, b)
    for a, b in zip(heldout.hidden, back.hidden):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temp file, renamed


def test_the_estimate_walks_to_the_decoded_tau(mini, tmp_path):
    """A drafter trained on the mini target's continuations, on 8 of those prompts: the teacher-forced predictions
    walked as a greedy decode verifies give the decoded tau exactly; the expected tau over every anchor is the sum
    of the acceptance shares, and the accuracy at position 1 bounds the share accepting it."""
    r = train_drafter(mini_recipe(epochs=6, tau_prompts=0), [mini["cache"]], mini["target_dir"], tmp_path, device="cpu")
    drafter = load_drafter(r.checkpoint_dir, dtype=torch.float32)
    prompts = [EvalPrompt(tuple(ids[:8]), "chat", f"p{i}") for i, (ids, _) in enumerate(mini["seqs"][:8])]
    decoded = evaluate_drafter(str(r.checkpoint_dir), mini["target"], prompts, max_new_tokens=24)
    est = teacher_forced_tau(mini["target"], drafter, prompts, max_new_tokens=24)
    assert decoded.lossless and decoded.tau > 1.5, decoded.tau  # the drafter learned these continuations
    assert est.walk_tau == pytest.approx(decoded.tau, abs=1e-6)
    assert est.anchors == 8 * 23 and est.sequences == 8
    assert est.acceptance_by_position[0] == 1.0 and est.tau == pytest.approx(sum(est.acceptance_by_position))
    assert est.acceptance_by_position[1] <= est.accuracy_by_position[0] + 1e-9
    assert all(a >= b for a, b in zip(est.acceptance_by_position, est.acceptance_by_position[1:]))


def test_an_untrained_drafter_estimates_near_one(mini, heldout):
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(load_target_config(mini["target_dir"]), num_layers=1, block_size=8,
                                           mask_token_id=511, target_layer_ids=[1, 3])
    est = estimate_tau(DFlashDrafter(cfg), TargetHead.from_model(mini["target"]), heldout)
    assert 1.0 <= est.tau < 1.2 and est.walk_tau < 1.2


def test_tau_while_training_marks_the_best_and_survives_a_resume(mini, seen, tmp_path):
    """Every save_every steps and at the end the estimate joins the history; the best is its highest; a run
    stopped half-way and resumed has the same history, best and final weights as one that ran through."""
    r = mini_recipe(tau_prompts=8)
    full = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "full", heldout=seen)
    steps = [h["step"] for h in full.tau_history]
    assert steps == list(range(r.save_every, full.total_steps + 1, r.save_every)), steps
    best = max(full.tau_history, key=lambda h: h["tau"])
    assert full.best == {"step": best["step"], "tokens": best["tokens"], "tau": best["tau"]}
    assert full.tau_history[-1]["tau"] > full.tau_history[0]["tau"] + 0.2  # it learned these continuations
    assert full.stop_reason == "completed"

    part = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", heldout=seen, max_steps=7)
    assert part.checkpoint_dir is None and [h["step"] for h in part.tau_history] == [2, 4, 6]
    assert part.stop_reason == ""
    rest = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", heldout=seen)
    assert rest.resumed_from_step == 7  # the state saved where max_steps stopped it
    assert rest.tau_history == full.tau_history and rest.best == full.best
    assert rest.losses == pytest.approx(full.losses)


def test_early_stop_after_k_evaluations_without_improvement(mini, heldout, tmp_path):
    """lr 1e-12: the drafter's predictions never change, so no estimate beats the first; with patience 2 the run
    ends at the third evaluation, publishes that drafter, and says why, also to a resume of the finished run."""
    r = mini_recipe(lr=1e-12, tau_prompts=8, early_stop_patience=2)
    assert r.fingerprint() != mini_recipe(lr=1e-12, tau_prompts=8).fingerprint()  # the stop changes the run
    res = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path, heldout=heldout)
    assert [h["step"] for h in res.tau_history] == [2, 4, 6] and res.best["step"] == 2
    assert res.steps == 6 and res.total_steps == 6 and res.finished and res.checkpoint_dir is not None
    assert res.stop_reason.startswith("early stop: the held-out tau estimate has not improved for 2 evaluations")
    again = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path, heldout=heldout)
    assert again.steps == 6 and again.stop_reason == res.stop_reason and again.tau_history == res.tau_history


def test_watch_state_round_trips():
    w = TauWatch(heldout=None, head=None, every=2, patience=1)
    w.restore({"history": [{"step": 2, "tau": 1.5}], "best": {"step": 2, "tokens": 10, "tau": 1.5}, "since_best": 1})
    assert w.stop_reason and "best 1.500 at step 2" in w.stop_reason
    assert json.loads(json.dumps(w.state())) == w.state()
