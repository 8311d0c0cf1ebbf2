"""What decides drafter_checkpoint's three blocking checks, and what a failure before training means for the others.

- ``decontamination`` (before any GPU time): the recipe's held-out and benchmark prompts against its trained shards
  (``drafter.decontamination``); contaminated means no training at all.
- ``preflight`` (on the GPU host, before the long run): its report, ``drafter_preflight/<recipe>.json``, counts only
  when this run wrote it; a run whose config turned it off gets a warning, not a pass.
- ``serving_match`` (after training): the published checkpoint against SGLang's loader rules and the served target;
  a checkpoint or target that cannot be read here is no match.

A gate that fails stops the run; the checks after it are reported as not run, each saying which gate stopped it
(``not_run_after``). Every decision comes back as a ``stage_io.CheckOutcome``; the Dagster layer only translates.

Reads, through the store: the preflight report and the published checkpoint. Writes nothing.
"""

from __future__ import annotations

from typing import Any

from dflash_assets.drafter.serving_match import ServedTarget, checkpoint_serving_match
from dflash_assets.drafter.stages import preflight_key
from dflash_assets.stage_io import CheckOutcome

__all__ = ["CHECKS", "decontamination_outcome", "preflight_report", "preflight_outcome", "serving_match_outcome",
           "not_run_after"]

CHECKS = ("decontamination", "preflight", "serving_match")  # in the order they decide


def decontamination_outcome(result: Any) -> CheckOutcome:
    """The ``decontamination`` check from ``drafter.decontamination``'s result (its ``summary()`` on failure)."""
    return CheckOutcome("decontamination", passed=result.passed, metadata=result.to_dict(),
                        description="" if result.passed else result.summary(), blocking=True)


def preflight_report(store: Any, recipe: str, run_id: str) -> dict | None:
    """This run's preflight report (``drafter_preflight/<recipe>.json``), or None (not written by this run)."""
    key = preflight_key(recipe)
    report = store.read_json(key) if store.exists(key) else None
    return report if report is not None and report.get("run") == run_id else None


def preflight_outcome(report: dict | None, requested: bool) -> CheckOutcome:
    """The ``preflight`` check from this run's report; without one, a warning saying why (turned off, or the
    training stage wrote none)."""
    if report is None:
        why = "not run: preflight is off in this run's config" if not requested else "no report from the training stage"
        return CheckOutcome("preflight", passed=False, severity="WARN", metadata={"summary": why}, blocking=True)
    values = {k: v for k, v in report.items() if k not in ("run", "recipe")}
    return CheckOutcome("preflight", passed=bool(report.get("passed")), metadata=values,
                        description=str(report.get("summary", "")), blocking=True)


def serving_match_outcome(store: Any, recipe: str, served: ServedTarget) -> CheckOutcome:
    """The ``serving_match`` check of the published checkpoint; one that cannot be read here is no match."""
    try:
        match = checkpoint_serving_match(store, recipe, served)
        passed, values = match.passed, {"problems": match.problems or ["none"], "checked": match.checked, **match.facts}
    except (OSError, ValueError) as e:
        passed, values = False, {"problems": [f"{type(e).__name__}: {e}"]}
    return CheckOutcome("serving_match", passed=passed, metadata=values, blocking=True)


def not_run_after(failed: str) -> list[CheckOutcome]:
    """The checks after the gate ``failed`` (one of ``CHECKS``): not run, since no checkpoint was trained."""
    later = CHECKS[CHECKS.index(failed) + 1:]
    out = []
    for name in later:
        if name == "preflight":
            out.append(CheckOutcome("preflight", passed=False, severity="WARN",
                                    metadata={"summary": f"not run: {failed} failed first"}, blocking=True))
        else:
            out.append(CheckOutcome(name, passed=False, blocking=True, metadata={"problems": [
                f"not checked: {failed} failed, so no checkpoint was trained"]}))
    return out
