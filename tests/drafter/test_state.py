"""Resumable training state (dflash_assets.drafter.state): a state directory of safetensors and JSON (no pickle)
written atomically, ``latest`` pointing at it, older states pruned, and a load that gives back the drafter, the
optimizer, the scheduler, the random generators and the history."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.state import latest_state_dir, load_training_state, save_training_state
from tests.drafter.test_model import one_thread, small_config  # noqa: F401


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = DFlashDrafter(small_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler) -> None:
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def test_a_saved_state_loads_back_whole_and_older_ones_are_pruned(tmp_path):
    model, optimizer, scheduler = _trainer(0)
    root = tmp_path / "state"
    for step in (1, 2, 3):
        _step(model, optimizer, scheduler)
        history = {"loss": torch.arange(step, dtype=torch.float32)}
        dest = save_training_state(root, step, model, optimizer, scheduler, {"epoch": 0, "note": "x"}, history,
                                   keep=2)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert (root / "latest").read_text().strip() == "step-00000003" and latest_state_dir(root) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["drafter.safetensors", "history.safetensors",
                                                      "optimizer.safetensors", "trainer.json"]
    draws = (random.random(), np.random.rand(), torch.rand(3))  # what the generators give right after the save

    other, other_opt, other_sched = _trainer(1)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    doc, history = load_training_state(dest, other, other_opt, other_sched, "cpu")
    assert doc["step"] == 3 and doc["epoch"] == 0 and doc["note"] == "x"
    assert torch.equal(history["loss"], torch.arange(3.0))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert other_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 3
    saved, loaded = optimizer.state_dict(), other_opt.state_dict()
    assert loaded["param_groups"][0]["betas"] == (0.9, 0.95)
    for k, state in saved["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(loaded["state"][k][name]))
                   for name, v in state.items())
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(3), draws[2])
    json.loads((dest / "trainer.json").read_text())  # plain JSON


def test_latest_falls_back_to_the_newest_complete_state(tmp_path):
    root = tmp_path / "state"
    assert latest_state_dir(root) is None
    model, optimizer, scheduler = _trainer(0)
    _step(model, optimizer, scheduler)
    done = save_training_state(root, 5, model, optimizer, scheduler, {}, {})
    (root / "step-00000009").mkdir()  # a state without its trainer.json: not complete
    (root / "latest").write_text("step-00000009")
    assert latest_state_dir(root) == done
