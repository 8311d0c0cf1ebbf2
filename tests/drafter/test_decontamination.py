"""Decontamination: evaluation prompts never appear in the shards a recipe trains on.

Prompts go through the real ingest (`ingest_prompt_source`, `materialize_prompt_shard`) into a local store;
the held-out shard holds a planted exact duplicate (case, spacing and punctuation changed) and a planted near
duplicate (one word changed): they are left out of evaluation and counted; a clean corpus passes. Through
Dagster, a recipe whose benchmark prompt is in its training data fails the blocking `decontamination` check of
`drafter_checkpoint` before any GPU run is launched.
"""

from __future__ import annotations

import json

import dagster as dg
import pytest

from dflash_assets.drafter.decontamination import (
    CONTAINMENT_MIN_WORDS,
    CONTAINMENT_THRESHOLD,
    JACCARD_THRESHOLD,
    EvalText,
    find_overlaps,
    normalize_text,
    read_benchmark_prompts,
    recipe_decontamination,
    word_ngrams,
)
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.shards import materialize_prompt_shard
from dflash_assets.store import layout

TOPICS = ["the water cycle", "binary search trees", "the French revolution", "compound interest",
          "photosynthesis in desert plants", "how vaccines train the immune system", "the rules of chess openings",
          "TCP congestion control", "the history of the printing press", "plate tectonics and earthquakes",
          "how a refrigerator moves heat", "the causes of inflation"]


def long_prompt(topic: str) -> str:
    return (f"Please write a detailed explanation of {topic} for a curious high school student, with two concrete "
            f"examples, one common misconception and a short summary at the end in plain language")


def ingest(store, tmp_path, texts: list[str], per_shard: int = 4) -> list[str]:
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t}]}) + "\n" for t in texts))
    report = ingest_prompt_source(str(source), store, IngestConfig(max_prompts_per_shard=per_shard))
    for shard in report.shard_keys:
        materialize_prompt_shard(store, shard)
    return sorted(report.shard_keys)


def test_normalization_and_grams():
    assert normalize_text("  Explain   PHOTOSYNTHESIS, please!!\n") == "explain photosynthesis please"
    assert normalize_text("ＡＢＣ_def") == "abc def"  # NFKC folds full-width letters; underscores separate
    assert word_ngrams("a b c") == frozenset({"a b c"})  # shorter than 5 words: one gram, itself
    assert word_ngrams("a b c d e f") == frozenset({"a b c d e", "b c d e f"})
    assert word_ngrams("") == frozenset()


def test_the_rule_at_its_thresholds():
    base = long_prompt("the water cycle")
    words = base.split()
    grams = len(word_ngrams(normalize_text(base)))
    last_changed = " ".join(words[:-1] + ["zebra"])  # one gram of `grams` differs: Jaccard (g-1)/(g+1)
    one_in_middle = " ".join(words[:12] + ["zebra"] + words[13:])  # five grams differ
    two_apart = " ".join(words[:6] + ["zebra"] + words[7:20] + ["zebra"] + words[21:])  # ten grams differ
    report = find_overlaps([EvalText("heldout", "e1", base)],
                           [("s", "t1", last_changed), ("s", "t2", two_apart)])
    assert report.near == 1 and report.exact == 0
    ex = report.examples[0]
    assert ex["train_id"] == "t1" and ex["jaccard"] == round((grams - 1) / (grams + 1), 4) >= JACCARD_THRESHOLD
    # one word changed mid-prompt: Jaccard (g-5)/(g+5) is under 0.7, but (g-5)/g of the prompt's grams is >= 0.8
    assert (grams - 5) / (grams + 5) < JACCARD_THRESHOLD <= CONTAINMENT_THRESHOLD <= (grams - 5) / grams
    middle = find_overlaps([EvalText("heldout", "e1", base)], [("s", "t3", one_in_middle)])
    assert middle.near == 1 and middle.examples[0]["containment"] == round((grams - 5) / grams, 4)
    # two words changed far apart: (g-10)/g is under 0.8 too, so not a near duplicate
    assert (grams - 10) / grams < CONTAINMENT_THRESHOLD
    assert find_overlaps([EvalText("heldout", "e1", base)], [("s", "t2", two_apart)]).passed
    # containment: the prompt pasted into a much longer one (Jaccard far below 0.7)
    pasted = "Context: you are a tutor. " * 10 + base + " Answer in French, and cite three sources please."
    report = find_overlaps([EvalText("heldout", "e1", base)], [("s", "t3", pasted)])
    assert report.near == 1 and report.examples[0]["containment"] == 1.0 and report.examples[0]["jaccard"] < 0.7
    short = "Write a poem about the sea"  # under CONTAINMENT_MIN_WORDS: containment does not apply
    assert len(short.split()) < CONTAINMENT_MIN_WORDS
    assert find_overlaps([EvalText("heldout", "e2", short)], [("s", "t4", f"{short} and the moon, in twelve lines "
                                                              "with rhymes and a refrain about sailors")]).passed


def test_a_clean_recipe_passes(local_store, tmp_path):
    shards = ingest(local_store, tmp_path, [long_prompt(t) for t in TOPICS])
    assert shards == ["shard-00000", "shard-00001", "shard-00002"]
    report = recipe_decontamination(local_store, shards[:2])
    assert report.passed and report.contaminated == 0
    assert (report.eval_prompts, report.training_turns, report.held_out) == (4, 8, True)
    assert report.summary() == "clean: none of 4 held-out and 0 benchmark prompts matches any of 8 training turns"


def test_planted_held_out_duplicates_are_left_out_of_evaluation_and_counted(local_store, tmp_path):
    """A held-out prompt that duplicates a trained one is not evaluated: drafter_eval decodes the clean ones, the
    check passes and counts (with examples) what was left out; find_overlaps on them still finds both."""
    train = [long_prompt(t) for t in TOPICS[:8]]
    held = [
        long_prompt(TOPICS[0]).upper().replace(" ", "   ") + "?!",  # exact after normalization
        " ".join(long_prompt(TOPICS[1]).split()[:-1] + ["words"]),  # near: the last word changed
        long_prompt(TOPICS[10]),  # clean
        long_prompt(TOPICS[11]),  # clean
    ]
    shards = ingest(local_store, tmp_path, train + held)
    report = recipe_decontamination(local_store, shards[:2])
    assert report.passed and report.contaminated == 0
    assert (report.excluded_exact, report.excluded_near, report.excluded_by_eval_selection, report.eval_prompts) == (
        1, 1, 2, 2)
    exact, near = report.excluded_examples
    assert exact["kind"] == "exact" and exact["shard"] == "shard-00000" and "WATER CYCLE" in exact["eval_text"]
    assert near["kind"] == "near" and JACCARD_THRESHOLD <= near["jaccard"] < 1.0
    assert report.summary() == ("clean: none of 2 held-out and 0 benchmark prompts matches any of 8 training turns "
                                "(2 held-out prompts left out of evaluation as duplicates of training turns: "
                                "1 exact, 1 near)")
    from dflash_assets.drafter.decontamination import heldout_selection, training_turns

    selection = heldout_selection(local_store, shards[:2], 16)
    held_rows = local_store.read_parquet(layout.raw_prompts(shards[2])).to_pylist()
    assert [p.prompt_id for p in selection.prompts] == [r["prompt_id"] for r in held_rows[2:]]
    # the rule still sees the two if they were evaluated: the selection, not a weaker rule, keeps them out
    direct = find_overlaps([EvalText("heldout", r["prompt_id"], r["user_turns"][0]) for r in held_rows],
                           training_turns(local_store, shards[:2]))
    assert (direct.exact, direct.near, direct.passed) == (1, 1, False)
    assert direct.summary() == "2 evaluation prompts appear in training data (1 exact, 1 near duplicates) of 4"
    assert direct.to_dict()["passed"] is False and direct.to_dict()["rule"].startswith("normalized text")


def test_a_held_out_shard_of_duplicates_only_fails(local_store, tmp_path):
    train = [long_prompt(t) for t in TOPICS[:8]]
    shards = ingest(local_store, tmp_path, train + [long_prompt(t).upper() for t in TOPICS[:4]])
    report = recipe_decontamination(local_store, shards[:2])
    assert not report.passed and report.eval_prompts == 0 and report.excluded_exact == 4
    assert report.summary() == "no clean held-out prompt: all 4 held-out prompts match training turns"


def test_benchmark_files_are_checked_too(local_store, tmp_path):
    shards = ingest(local_store, tmp_path, [long_prompt(t) for t in TOPICS])
    jsonl = tmp_path / "bench.jsonl"
    jsonl.write_text(json.dumps({"question": long_prompt(TOPICS[2]).lower()}) + "\n"
                     + json.dumps({"messages": [{"role": "system", "content": "x"},
                                                {"role": "user", "content": "An unrelated benchmark question?"}]})
                     + "\n")
    txt = tmp_path / "bench.txt"
    txt.write_text("Nothing like the training data at all\n\n" + long_prompt(TOPICS[5]) + "\n")
    report = recipe_decontamination(local_store, shards[:2], benchmark_files=[str(jsonl), str(txt)])
    assert (report.benchmark_prompts, report.exact, report.near) == (4, 2, 0)
    assert report.by_origin == {"benchmark:bench.jsonl": 1, "benchmark:bench.txt": 1}
    with pytest.raises(FileNotFoundError, match="DFLASH_BENCHMARK_PROMPTS"):
        read_benchmark_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "bench.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .txt"):
        read_benchmark_prompts(tmp_path / "bench.csv")
    (tmp_path / "empty.json").write_text(json.dumps([{"answer": 3}]))
    with pytest.raises(ValueError, match="holds no prompts"):
        read_benchmark_prompts(tmp_path / "empty.json")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_benchmark_prompts(tmp_path / "broken.jsonl")


def test_a_recipe_that_trains_on_every_shard_has_no_clean_evaluation(local_store, tmp_path):
    shards = ingest(local_store, tmp_path, [long_prompt(t) for t in TOPICS])
    report = recipe_decontamination(local_store, shards)
    assert not report.passed and not report.held_out and report.eval_prompts == 0
    assert "no held-out shard" in report.summary()


def test_eval_order_and_the_limit_follow_drafter_evals_selection(local_store, tmp_path):
    shards = ingest(local_store, tmp_path, [long_prompt(t) for t in TOPICS], per_shard=4)
    held = local_store.read_parquet(layout.raw_prompts(shards[2]), columns=["prompt_id"]).column(0).to_pylist()
    report = recipe_decontamination(local_store, shards[:2], max_eval_prompts=2)
    assert report.eval_prompts == 2
    from dflash_assets.drafter.decontamination import heldout_selection

    selection = heldout_selection(local_store, shards[:2], 3)
    assert [p.prompt_id for p in selection.prompts] == held[:3] and len(selection.excluded) == 0 and selection.held_out


def test_a_contaminated_recipe_fails_its_blocking_check_before_any_gpu_run(tmp_path, monkeypatch):
    from dagster_project.definitions import defs
    from dagster_project.partitions import register_recipe
    from dagster_project.resources import StoreResource
    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.store.backends import LocalStore

    store = LocalStore(tmp_path / "store")
    train = [long_prompt(t) for t in TOPICS[:8]]
    shards = ingest(store, tmp_path, train + [long_prompt(TOPICS[3]) + " !!", long_prompt(TOPICS[9]),
                                              long_prompt(TOPICS[10]), long_prompt(TOPICS[11])])
    bench = tmp_path / "bench.txt"
    bench.write_text(long_prompt(TOPICS[4]).upper() + "\n")
    monkeypatch.setenv("DFLASH_BENCHMARK_PROMPTS", str(bench))
    resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store"))}
    with dg.instance_for_test() as instance:
        register_recipe(instance, store, DrafterRecipe(name="contaminated-v1", partitions=tuple(shards[:2])))
        result = dg.materialize(defs.assets, partition_key="contaminated-v1", instance=instance,
                                resources=resources, selection=["drafter_checkpoint"], raise_on_error=False)
        assert not result.success
        checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
        check, match = checks["decontamination"], checks["serving_match"]
        assert not check.passed and not match.passed
        assert match.metadata["problems"].value == ["not checked: decontamination failed, so no checkpoint was trained"]
        assert check.severity == dg.AssetCheckSeverity.ERROR
        meta = {k: v.value for k, v in check.metadata.items()}
        assert (meta["exact"], meta["near"], meta["contaminated"], meta["excluded_exact"]) == ("1", "0", "1", "1")
        assert meta["summary"] == "1 evaluation prompts appear in training data (1 exact, 0 near duplicates) of 4"
        assert {e["origin"] for e in meta["examples"]} == {"benchmark:bench.txt"}
        assert {e["origin"] for e in meta["excluded_examples"]} == {"heldout"}  # left out of evaluation, counted
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "decontamination: 1 evaluation prompts" in str(failure.event_specific_data.error)
        assert instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint")) is None
    assert store.list("drafter_checkpoint") == [] and store.list("_pipes") == []  # no GPU stage was launched


def test_a_prompt_drafter_eval_already_skips_is_counted_apart(local_store, tmp_path):
    """The same user turn under another system prompt is another prompt (another prompt_id); drafter_eval skips a
    held-out prompt whose first user turn is a trained user turn, so it is not contamination, but it is counted."""
    source = tmp_path / "prompts.jsonl"
    records = [{"conversations": [{"from": "human", "value": long_prompt(t)}]} for t in TOPICS[:4]]
    records.append({"conversations": [{"from": "system", "value": "You are terse."},
                                      {"from": "human", "value": long_prompt(TOPICS[0])}]})
    records.append({"conversations": [{"from": "human", "value": long_prompt(TOPICS[9])}]})
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = ingest_prompt_source(str(source), local_store, IngestConfig(max_prompts_per_shard=4))
    shards = sorted(report.shard_keys)
    for shard in shards:
        materialize_prompt_shard(local_store, shard)
    result = recipe_decontamination(local_store, shards[:1])
    assert (result.excluded_by_eval_selection, result.eval_prompts, result.contaminated) == (1, 1, 0)
    assert result.passed
