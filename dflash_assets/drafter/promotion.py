"""Promotion of a drafter checkpoint by acceptance length tau, per slice of the held-out prompts.

A slice is a named subset of the evaluation prompts: ``thinking:on|off`` (the target's thinking mode, one per
evaluation), ``tools:with|without`` (the raw prompt carries tool definitions), ``length:<bucket>`` (rendered
prompt tokens) and ``category:<c>`` (the raw prompts' category; they have no language column, so language is
not a slice). :func:`decide_promotion` picks, among a training run's checkpoints (learning-curve ones and the
final one), the one with the best tau, and promotes it only if its tau beats the promoted checkpoint's and no
slice that both measured falls below the promoted one's by more than ``margin``.

Reads and writes (through ``store.layout``) ``drafter_promoted/<family>/manifest.json``: the store keys of the
promoted checkpoint's own copy (``drafter_promoted/<family>/<version>/``, so re-running or deleting the recipe's
checkpoints leaves it whole), tau, tau per slice, tokens trained and provenance (the serving side reads it). The
manifest is written after the copies, in one atomic ``write_json``: a reader sees the old manifest or the new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from dflash_assets.store import layout

__all__ = ["DEFAULT_MARGIN", "LENGTH_BUCKETS", "Candidate", "PromotionDecision", "prompt_slices", "tau_by_slice",
           "decide_promotion", "read_promoted", "write_promoted"]

DEFAULT_MARGIN = 0.05
LENGTH_BUCKETS = ((256, "0-256"), (1024, "257-1024"), (None, ">1024"))  # rendered prompt tokens


def length_bucket(num_tokens: int) -> str:
    for limit, name in LENGTH_BUCKETS:
        if limit is None or num_tokens <= limit:
            return name
    raise AssertionError("the last bucket has no limit")


def prompt_slices(*, thinking: bool, has_tools: bool, prompt_tokens: int, category: str | None) -> tuple[str, ...]:
    """The slices one evaluation prompt belongs to."""
    return (f"thinking:{'on' if thinking else 'off'}", f"tools:{'with' if has_tools else 'without'}",
            f"length:{length_bucket(prompt_tokens)}", f"category:{category or 'unknown'}")


def tau_by_slice(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Pooled tau (accepted tokens / verifications) per slice of per-prompt rows with ``slices``,
    ``accepted_tokens`` and ``verifications`` (``decoding.evaluate_drafter``'s rows)."""
    accepted: dict[str, int] = {}
    verifications: dict[str, int] = {}
    for row in rows:
        for s in row.get("slices", ()):
            accepted[s] = accepted.get(s, 0) + int(row["accepted_tokens"])
            verifications[s] = verifications.get(s, 0) + int(row["verifications"])
    return {s: round(accepted[s] / verifications[s], 4) for s in sorted(accepted) if verifications[s]}


@dataclass(frozen=True)
class Candidate:
    """One checkpoint of a training run, measured: ``name`` is ``final`` or a curve file name."""

    name: str
    tokens: int
    tau: float
    slices: Mapping[str, float]
    files: Mapping[str, str] = field(default_factory=dict)  # file name -> store key


@dataclass
class PromotionDecision:
    promoted: bool
    candidate: Candidate | None  # the best checkpoint of this run
    previous: dict[str, Any] | None  # the promoted manifest before this decision
    reasons: list[str]  # why not promoted (empty when promoted)
    regressions: list[dict[str, Any]]  # slices that fell by more than the margin
    already_promoted: bool = False  # the best checkpoint is the promoted one (a re-run): nothing to decide

    @property
    def passed(self) -> bool:
        """What the blocking ``promotion`` check reports: promoted now, or promoted already."""
        return self.promoted or self.already_promoted

    def to_metadata(self) -> dict[str, Any]:
        prev = self.previous or {}
        return {
            "promoted": self.promoted, "already_promoted": self.already_promoted, "passed": self.passed,
            "candidate": self.candidate.name if self.candidate else None,
            "candidate_tau": self.candidate.tau if self.candidate else None,
            "previous_tau": prev.get("tau"), "previous_checkpoint": prev.get("checkpoint"),
            "previous_recipe": prev.get("recipe"),
            "tau_delta": (round(self.candidate.tau - float(prev["tau"]), 4)
                          if self.candidate and prev.get("tau") is not None else None),
            "reasons": self.reasons or ["none"],
            "regressed_slices": [f"{r['slice']}: {r['previous']:.3f} -> {r['candidate']:.3f} "
                                 f"(drop {r['drop']:.3f} > margin {r['margin']:.3f})" for r in self.regressions]
            or ["none"],
        }


def decide_promotion(candidates: list[Candidate], previous: Mapping[str, Any] | None,
                     margin: float = DEFAULT_MARGIN,
                     is_promoted: Callable[[Candidate], bool] | None = None) -> PromotionDecision:
    """Promote the best candidate if it beats ``previous`` (the promoted manifest, or None) and no slice both
    measured drops by more than ``margin`` below the previous promoted checkpoint's tau on that slice.

    ``is_promoted(candidate)``: whether the candidate is the promoted checkpoint itself (the same weights: a
    re-run of the recipe that was promoted, or of an unchanged checkpoint). Then nothing is decided and the
    check passes (``already_promoted``): a checkpoint cannot beat itself, and re-running must not fail."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not candidates:
        return PromotionDecision(False, None, dict(previous) if previous else None, ["no checkpoint measured"], [])
    best = max(candidates, key=lambda c: (c.tau, c.tokens))  # ties: the one trained longer
    if previous is None:
        return PromotionDecision(True, best, None, [], [])
    if is_promoted is not None and is_promoted(best):
        return PromotionDecision(False, best, dict(previous), [], [], already_promoted=True)
    reasons: list[str] = []
    if best.tau <= float(previous["tau"]):
        reasons.append(f"tau {best.tau:.4f} is not above the promoted checkpoint's {float(previous['tau']):.4f}")
    regressions = []
    for name, old in sorted((previous.get("slices") or {}).items()):
        new = best.slices.get(name)
        if new is not None and old - new > margin:
            regressions.append({"slice": name, "previous": float(old), "candidate": float(new),
                                "drop": round(float(old) - float(new), 4), "margin": margin})
    if regressions:
        reasons.append("slice regressed: " + ", ".join(f"{r['slice']} {r['previous']:.3f} -> {r['candidate']:.3f}"
                                                      for r in regressions))
    return PromotionDecision(not reasons, best, dict(previous), reasons, regressions)


def read_promoted(store: Any, family: str) -> dict[str, Any] | None:
    key = layout.drafter_promoted_manifest(family)
    return store.read_json(key) if store.exists(key) else None


def write_promoted(store: Any, family: str, recipe: str, candidate: Candidate, *,
                   provenance_key: str | None = None, config_key: str | None = None) -> dict[str, Any]:
    """Copy ``candidate``'s files to ``drafter_promoted/<family>/<version>/``, then point
    ``drafter_promoted/<family>/manifest.json`` at the copies (one atomic write); returns the manifest.

    The promoted drafter owns its bytes: re-running its recipe publishes a new checkpoint version and deletes the
    old one, and that must not delete what serving reads. Older promoted versions are deleted after the switch.
    ``source_files`` keeps the checkpoint keys the copies came from."""
    from dflash_assets.store.manifest import delete_older_versions, new_version

    prefix = layout.drafter_promoted_prefix(family)
    version = new_version()
    copies = {name: f"{prefix}/{version}/{name}" for name in candidate.files}
    for name, source in candidate.files.items():
        store.upload_file(copies[name], store.local_path(source))
    by_source = {source: copies[name] for name, source in candidate.files.items()}
    doc = {"family": family, "recipe": recipe, "checkpoint": candidate.name, "tokens": candidate.tokens,
           "tau": candidate.tau, "slices": dict(candidate.slices), "files": copies,
           "source_files": dict(candidate.files), "version": version,
           "config": by_source.get(config_key, config_key), "provenance": by_source.get(provenance_key, provenance_key),
           "promoted_at": time.time()}
    store.write_json(layout.drafter_promoted_manifest(family), doc)  # the switch
    delete_older_versions(store, prefix, version)
    return doc
