"""`make demo` as a user runs it: a fresh Dagster home, the real command, its console and its exit status.

These run the tiny target (`--target tiny`, the thinking format); `tests/embedded/test_smollm2.py` runs the
default, SmolLM2. The session's one tiny demo (the `tiny_demo` fixture, tests/demo_run.py), its console
included, is read in tests/test_end_to_end.py with the other tests of the whole graph; `assert_quiet` and
`STAGE_LINE` here are what its console is held to.

The tiny target's trained bytes differ between CPU kernel levels, and so do its answers: under a second level
(`ATEN_CPU_CAPABILITY`) the demo's per-shard stages, at the demo's own sizes, build their own tiny target and pass
every check. When a check fails (here: every answer cut at 8 new tokens, so the reasoning never closes and every
answer is empty), its last lines say which check failed on which partition, what that means and what to do, and
the exit status is 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import dagster as dg
import pytest

from tests.demo_run import REPO, run_demo_command

STAGE_LINE = re.compile(r"^  (shard-\d{5}|demo-v1|) +(\w+) +(ok|failed|skipped) +(\d+ s|-)")


def assert_quiet(console: str) -> None:
    for noise in (" - DEBUG - ", "DEBUG", "alembic", "Traceback", "Warning", "warnings.warn", "Loading weights",
                  "Writing model shards"):
        assert noise not in console, f"{noise!r} in the demo's console:\n{console}"


def second_kernel_level() -> str:
    """A CPU kernel level this CPU runs other than the one torch picks by itself: avx2 on an AVX-512 machine,
    default (no vector extensions) elsewhere. The tiny target built under it has other trained bytes."""
    import torch

    return "avx2" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "default"


# The demo's per-shard stages in a process of their own, so that ATEN_CPU_CAPABILITY (read when torch loads) and
# the oneDNN cap the demo sets (cap_onednn_to_kernel_level) hold in it and in every process it starts.
PER_SHARD_DEMO = """
import json, sys
from dflash_assets.embedded.tiny_targets import cap_onednn_to_kernel_level
cap_onednn_to_kernel_level()
import dagster as dg
from dagster_project.demo import TARGET_DEFAULTS, run_demo
from dagster_project.resources import StoreResource
from dflash_assets.embedded.defaults import embedded_default_target
tiny = TARGET_DEFAULTS["tiny"]
target = embedded_default_target()
with dg.instance_for_test() as instance:
    summary = run_demo(instance, prompts=tiny["prompts"], shard_size=tiny["shard_size"],
                       max_new_tokens=tiny["max_new_tokens"], max_empty_ratio=tiny["max_empty_ratio"],
                       engine=tiny["engine"], engine_concurrency=2, pilot_prompts=0, drafter=False,
                       store=StoreResource(uri=sys.argv[1]))
print(json.dumps({"target": str(target), "summary": summary.to_dict()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_second_kernel_level_builds_its_own_target_whose_shards_pass_every_check(tmp_path, tiny_dense_target):
    """The demo's shards, as `make demo --target tiny` runs them (its prompts, shard size, new tokens, engine and
    gate), under a second CPU kernel level: that process builds its own tiny target (the cache key names the
    level), whose trained bytes and answers differ, and every check of both shards passes. The part that
    depends on the kernel level ends there: the target's build and format check, `transformers serve`, the
    answers and their gate, the hidden states. The drafter's stages, which read the cache whatever built it,
    and the console run once, in the session's demo (`test_demo_passes_every_check_with_a_short_console`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "DFLASH_STORE")}
    done = subprocess.run([sys.executable, "-c", PER_SHARD_DEMO, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=1100, cwd=REPO, env={**env, "ATEN_CPU_CAPABILITY": second_kernel_level()})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["target"] != str(tiny_dense_target)  # its own build, under its own cache key
    summary = result["summary"]
    assert summary["ok"] and summary["shards"] == ["shard-00000", "shard-00001"], summary["failures"]
    assert summary["failed_shards"] == [] and summary["recipe"] is None  # no drafter: the session's demo trains one
    stages = [(s["partition"], s["asset"], s["status"]) for s in summary["stages"]]
    assert [a for p, a, _ in stages if p == "shard-00001"] == ["raw_prompts", "completions", "tokenized_samples",
                                                              "hidden_state_cache"]
    assert len(stages) == 9 and all(status == "ok" for _, _, status in stages), stages  # + prompt_corpus
    for shard in summary["shards"]:
        checks = summary["checks"][shard]
        assert len(checks) == 4 and all(c["passed"] for c in checks.values()), (shard, checks)
        assert "empty_response_ratio" in checks and checks["empty_response_ratio"]["blocking"]


@pytest.mark.slow
def test_a_failed_check_says_what_and_exits_non_zero(tmp_path, tiny_dense_target):
    done = run_demo_command(tmp_path / "home", "--target", "tiny", "--prompts", "8", "--shard-size", "4",
                            "--max-new-tokens", "8")
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    assert_quiet(console)
    tail = done.stdout[done.stdout.index("\nFAILED ("):]
    for shard in ("shard-00000", "shard-00001"):
        assert re.search(rf"{shard}: blocking check empty_response_ratio failed: \d+/\d+ samples", tail), tail
    assert "What it means:" in tail and "Next:" in tail and "max_new_tokens" in tail
    assert "no shard passed its checks, so no drafter was trained" in tail
    assert re.search(r"  shard-00000 +tokenized_samples +failed", done.stdout)
    assert re.search(r"  shard-00000 +hidden_state_cache +skipped", done.stdout)


@pytest.mark.slow
def test_demo_generates_in_process_when_asked(tmp_path, tiny_dense_target, monkeypatch):
    """`--engine inprocess`: no server; each completions step batches its requests into generate calls."""
    from dagster_project.demo import run_demo
    from dagster_project.resources import StoreResource
    from dflash_assets.store.backends import LocalStore

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    store = StoreResource(uri=str(tmp_path / "store"))
    with dg.instance_for_test() as instance:
        summary = run_demo(instance, prompts=6, shard_size=6, max_new_tokens=32, max_turns=1, drafter=False,
                           pilot_prompts=0, store=store, engine="inprocess", engine_concurrency=4)
    assert summary.failed_shards == [] and summary.shards == ["shard-00000"], summary.failures
    assert all(c.passed for c in summary.checks["shard-00000"])
    table = LocalStore(str(tmp_path / "store")).read_parquet("completions/shard-00000.parquet")
    assert table.num_rows == 6 and set(table["endpoint"].to_pylist()) == {f"inprocess://{tiny_dense_target}"}
    with pytest.raises(ValueError, match="engine must be"):
        run_demo(instance, engine="vllm")
