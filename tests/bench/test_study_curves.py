"""``bench/study_curves.py``: two studies' curves at equal tokens, the slope per doubling of tokens, and where that
line reaches the goal (or says it does not within reach); a study without a curve is refused with the reason."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("study_curves", REPO / "bench" / "study_curves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study(root: Path, name: str, points, tokens_per_s=None, warm_tokens_per_s=None) -> Path:
    d = root / name
    d.mkdir()
    (d / "study.json").write_text(json.dumps({
        "training": {"tau_by_tokens": points, "sequence_tokens": points[-1][0] if points else 0,
                     "steps_tokens_per_s": tokens_per_s, "warm_tokens_per_s": warm_tokens_per_s},
        "evaluation": {"tau": 1.5}, "self_prompts": {"weight": 0.0}}))
    return d


def test_curves_compare_at_equal_tokens_and_read_the_goal_off_the_line(tmp_path):
    bench = _bench()
    doubling = [[int(1e6 * 2 ** k), 1.0 + 0.2 * k] for k in range(4)]  # +0.2 tau per doubling, 1M to 8M tokens
    a = _study(tmp_path, "a", doubling, tokens_per_s=10_000)
    b = _study(tmp_path, "b", [[1_000_000, 1.1], [5_000_000, 1.5]])
    flat = _study(tmp_path, "flat", [[1_000_000, 1.2], [2_000_000, 1.2], [4_000_000, 1.21]])
    out = tmp_path / "curves.json"
    assert bench.main([str(a), str(b), str(flat), "--goal-tau", "1.8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["studies"]
    ra, rb, rf = report[str(a)], report[str(b)], report[str(flat)]
    assert ra["per_doubling"] == pytest.approx(0.2) and ra["fit_points"] == 2
    assert ra["tokens_for_goal"] == pytest.approx(16e6, rel=1e-6)  # two more doublings past 8M (tau 1.6)
    assert ra["times_the_tokens_trained"] == 2.0 and ra["gpu_hours_for_goal"] == round(16e6 / 1e4 / 3600, 1)
    assert ra["gpu_hours_for_goal"] is not None and rb["gpu_hours_for_goal"] is None  # b has no tokens/s
    # at each other study's last token count, linear between this curve's points; past its end, none
    assert ra["at_tokens"] == {f"5000000 ({b})": pytest.approx(1.45), f"4000000 ({flat})": pytest.approx(1.4)}
    assert rb["at_tokens"] == {f"4000000 ({flat})": pytest.approx(1.4)}
    assert rf["tokens_for_goal"] is None and "not within 1000x" in rf["goal"]
    assert math.isclose(rf["per_doubling"], 0.01, abs_tol=1e-9)


def test_a_study_without_a_curve_is_refused(tmp_path):
    bench = _bench()
    with pytest.raises(SystemExit, match="tau_by_tokens has 0 points; train with --tau-every"):
        bench.main([str(_study(tmp_path, "none", []))])
    with pytest.raises(SystemExit, match="no study.json"):
        bench.main([str(tmp_path / "missing")])


def test_gpu_hours_are_read_at_the_warm_training_rate(tmp_path):
    """A study that reports the rate past its compiles is read at that rate, not at the steps' average."""
    bench = _bench()
    doubling = [[int(1e6 * 2 ** k), 1.0 + 0.2 * k] for k in range(4)]
    warm = _study(tmp_path, "warm", doubling, tokens_per_s=10_000, warm_tokens_per_s=40_000)
    report = bench.main([str(warm), "--goal-tau", "1.8", "--out", str(tmp_path / "c.json")])
    assert report == 0
    reading = json.loads((tmp_path / "c.json").read_text())["studies"][str(warm)]
    assert reading["gpu_hours_for_goal"] == round(16e6 / 4e4 / 3600, 1)
