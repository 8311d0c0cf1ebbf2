"""Learning curves of SmolLM2 studies side by side: tau against training tokens, and what reaching a goal would take.

Reads each study directory's ``study.json`` (``bench/smollm2_study.py --out DIR``): ``training.tau_by_tokens``
(held-out tau estimates against the sequence tokens trained by then), the loop's tokens/s, and the evaluation's
decoded tau. For each study it prints:

- ``points``: the curve as trained;
- ``at_tokens``: tau at each of the other studies' last token counts that this curve reaches (linear between
  points), so two prompt mixes compare at equal tokens;
- ``per_doubling``: the least-squares slope of tau against log2(tokens) over the curve's later ``--tail`` share of
  points (the early steps of warm-up and the first passes rise faster), and ``tokens_for_goal``: where that line
  crosses ``--goal-tau`` (unless past `FARTHEST` times the tokens trained), with the GPU hours at the study's
  warm training rate (``warm_tokens_per_s``: the steps past the first of each batch shape, compiles left out; else
  the steps' tokens/s). A straight line on a log scale is a reading of the curve, not a promise: a curve that bends
  down needs more.

Prints one JSON object (also to ``--out``). Reads the studies' ``study.json``; writes nothing else.

    python bench/study_curves.py A B --goal-tau 3.0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import print_report  # noqa: E402


FARTHEST = 1000  # a line read further than this many times the tokens trained says nothing useful


def read_curve(directory: Path) -> dict:
    """A study's curve and rates from its ``study.json`` (a clear error when it has no curve)."""
    path = directory / "study.json"
    if not path.exists():
        raise SystemExit(f"{path}: no study.json (run bench/smollm2_study.py --out {directory} first)")
    study = json.loads(path.read_text())
    training = study.get("training") or {}
    points = [(int(t), float(tau)) for t, tau in training.get("tau_by_tokens") or []]
    if len(points) < 2:
        raise SystemExit(f"{path}: training.tau_by_tokens has {len(points)} points; train with --tau-every")
    return {"points": sorted(points), "sequence_tokens": training.get("sequence_tokens"),
            "tokens_per_s": (training.get("warm_tokens_per_s") or training.get("steps_tokens_per_s")
                             or training.get("tokens_per_s")),
            "decoded_tau": (study.get("evaluation") or {}).get("tau"),
            "self_prompts": study.get("self_prompts")}


def tau_at(points: list[tuple[int, float]], tokens: int) -> float | None:
    """tau at `tokens`, linear between the two points around it (None outside the curve)."""
    for (t0, a), (t1, b) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return a + (b - a) * (tokens - t0) / max(1, t1 - t0)
    return None


def log_fit(points: list[tuple[int, float]], tail: float) -> tuple[float, float, int]:
    """(slope per doubling, intercept, points used): least squares of tau on log2(tokens) over the last `tail`
    share of the points (at least two)."""
    used = points[-max(2, math.ceil(tail * len(points))):]
    xs, ys = [math.log2(t) for t, _ in used], [tau for _, tau in used]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx, len(used)


def reading(curve: dict, goal: float, tail: float) -> dict:
    """The fitted line's slope and where it reaches `goal` (None when it does not rise)."""
    slope, intercept, used = log_fit(curve["points"], tail)
    out = {"per_doubling": round(slope, 4), "fit_points": used, "tokens_for_goal": None, "gpu_hours_for_goal": None}
    last_tokens, last_tau = curve["points"][-1]
    if last_tau >= goal:
        out["tokens_for_goal"] = next(t for t, tau in curve["points"] if tau >= goal)
    elif slope > 0 and (goal - last_tau) / slope <= math.log2(FARTHEST):
        out["tokens_for_goal"] = int(2 ** ((goal - intercept) / slope))
    else:
        out["goal"] = f"not within {FARTHEST}x the tokens trained at this slope"
    if out["tokens_for_goal"] is not None:
        out["times_the_tokens_trained"] = round(out["tokens_for_goal"] / last_tokens, 1)
        if curve["tokens_per_s"]:
            out["gpu_hours_for_goal"] = round(out["tokens_for_goal"] / curve["tokens_per_s"] / 3600, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="study directories (bench/smollm2_study.py --out)")
    p.add_argument("--goal-tau", type=float, default=3.0)
    p.add_argument("--tail", type=float, default=0.5, help="share of each curve's last points the line is fit to")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    curves = {str(d): read_curve(d) for d in args.studies}
    ends = {name: c["points"][-1][0] for name, c in curves.items()}
    report: dict = {"goal_tau": args.goal_tau, "tail": args.tail, "studies": {}}
    for name, curve in curves.items():
        at = {other: tau_at(curve["points"], tokens) for other, tokens in ends.items() if other != name}
        report["studies"][name] = {
            "points": [[t, tau] for t, tau in curve["points"]], "decoded_tau": curve["decoded_tau"],
            "self_prompts": curve["self_prompts"],
            "at_tokens": {f"{ends[o]} ({o})": round(v, 4) for o, v in at.items() if v is not None},
            **reading(curve, args.goal_tau, args.tail)}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
