"""``drafter.step_profile``: a profiled window of a real (tiny) training run reports its steps' wall and busy time
and the kernels that took it, and changes nothing trained."""

from __future__ import annotations

import pytest

from dflash_assets.drafter.step_profile import parse_step_window
from dflash_assets.drafter.training import train_drafter
from tests.drafter.test_training import mini, mini_recipe  # noqa: F401


def test_a_profiled_window_reports_where_its_steps_went(mini, tmp_path):
    r = mini_recipe(epochs=1, save_every=100)
    plain = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "plain")
    profiled = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", profile_steps=(2, 5))
    assert plain.profile is None and profiled.losses == plain.losses  # watching changes nothing trained
    p = profiled.profile
    assert p["steps"] == [3, 5] and 0 < p["busy_ms_per_step"] and 0 < p["wall_ms_per_step"]
    kernels = [k["name"] for k in p["kernels"]]
    assert any("mm" in k for k in kernels) and p["kernels"][0]["ms_per_step"] >= p["kernels"][-1]["ms_per_step"]
    with pytest.raises(ValueError, match="not a step window"):
        parse_step_window("300-320")
    assert parse_step_window("300:320") == (300, 320)


def test_a_window_past_the_run_s_end_closes_with_it(mini, tmp_path):
    r = mini_recipe(epochs=1, save_every=100)
    run = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", profile_steps=(4, 10_000))
    assert run.profile["steps"] == [5, run.steps] and run.profile["kernels"]
    never = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "n", profile_steps=(10_000, 10_001))
    assert never.profile is None
