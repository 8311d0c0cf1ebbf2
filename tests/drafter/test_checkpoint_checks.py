"""drafter_checkpoint's gates decided in the library: decontamination from its result, the preflight from this run's
own report only (a report of another run, or none, is a warning, not a pass), serving_match as no match when the
checkpoint cannot be read, and the checks after a failed gate reported as not run, naming the gate."""

from __future__ import annotations

from dflash_assets.drafter.checkpoint_checks import (CHECKS, decontamination_outcome, not_run_after, preflight_outcome,
                                                     preflight_report, serving_match_outcome)
from dflash_assets.drafter.decontamination import DecontaminationReport
from dflash_assets.drafter.serving_match import ServedTarget
from dflash_assets.drafter.stages import preflight_key


def test_decontamination_passes_only_clean_held_out_prompts():
    clean = decontamination_outcome(DecontaminationReport(eval_prompts=4, training_turns=10))
    assert clean.passed and clean.blocking and clean.metadata["summary"].startswith("clean")
    dirty = decontamination_outcome(DecontaminationReport(eval_prompts=4, training_turns=10, exact=1))
    assert not dirty.passed and dirty.description.startswith("1 evaluation prompts appear in training data")


def test_the_preflight_counts_only_this_runs_report(local_store):
    assert preflight_report(local_store, "r1", "run-a") is None
    local_store.write_json(preflight_key("r1"), {"run": "run-a", "recipe": "r1", "passed": False, "summary": "bad"})
    assert preflight_report(local_store, "r1", "run-b") is None  # another run's report
    failed = preflight_outcome(preflight_report(local_store, "r1", "run-a"), requested=True)
    assert not failed.passed and failed.severity == "ERROR" and failed.metadata == {"passed": False, "summary": "bad"}
    off = preflight_outcome(None, requested=False)
    assert not off.passed and off.severity == "WARN" and "off in this run's config" in off.metadata["summary"]
    assert "no report" in preflight_outcome(None, requested=True).metadata["summary"]


def test_a_checkpoint_that_cannot_be_read_is_no_match(local_store):
    served = ServedTarget("t", num_layers=4, hidden_size=8, vocab_size=16, layer_ids=(1,), token_ids={},
                          template_hash="h", thinking=True)
    outcome = serving_match_outcome(local_store, "never-trained", served)
    assert not outcome.passed and outcome.metadata["problems"][0].startswith("FileNotFoundError")


def test_the_checks_after_a_failed_gate_are_not_run_and_say_which_gate():
    assert [o.name for o in not_run_after("decontamination")] == list(CHECKS[1:])
    preflight, match = not_run_after("decontamination")
    assert preflight.severity == "WARN" and preflight.metadata["summary"] == "not run: decontamination failed first"
    assert match.metadata["problems"] == ["not checked: decontamination failed, so no checkpoint was trained"]
    (after_preflight,) = not_run_after("preflight")
    assert after_preflight.name == "serving_match" and not after_preflight.passed
    assert not_run_after("serving_match") == []
