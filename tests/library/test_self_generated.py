"""The self_generated_prompts stage: every filter on a journal of known samples, resuming after a failure,
deduplication against the corpus and other partitions, decontamination, the check, the mix into raw_prompts.

Samples are given as a journal (what a run writes batch by batch), so the filters see known texts and no model
runs; the resume test samples for real with the tiny target.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dflash_assets.embedded.defaults import default_target_spec
from dflash_assets.generation.self_prompts import SelfPromptSampling
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.quarantine import QUARANTINE_SCHEMA
from dflash_assets.prompts.shards import materialize_prompt_shard
from dflash_assets.self_generated import (
    FILTER_REASONS,
    JOURNAL_SCHEMA,
    SELF_PROMPT_SCHEMA,
    SOURCE,
    SelfPromptsConfig,
    SelfPromptsThresholds,
    generate_self_prompts,
    journal_batch_key,
    partition_seed,
    read_self_prompts,
)

GOOD = [
    "Can you help me plan a three-day trip to Lisbon on a small budget?",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "What is the difference between a virus and a bacterium, and why do antibiotics only work on one of them?",
    "I'm feeling anxious about returning to work after a long break. How could I manage the first week?",
    "Suggest five names for a bakery that sells sourdough bread and pastries in a small mountain town.",
]
LONG = ("I am preparing a presentation for my team about the history of renewable energy in northern Europe and "
        "I would like you to outline the main milestones from the first wind farms to today's offshore parks.")


def _journal(store, spec, config, shard, rows):
    """Write ``rows`` (user_turns, answers, ended) as the journal of ``shard``, a batch per ``batch_size``."""
    key_hash = config.config_hash(spec.generation_fingerprint())
    for b in range(0, len(rows), config.batch_size):
        part = rows[b:b + config.batch_size]
        store.write_parquet(journal_batch_key(shard, key_hash, b // config.batch_size), pa.table({
            "sample_index": list(range(b, b + len(part))), "user_turns": [r[0] for r in part],
            "answers": [r[1] for r in part], "ended": [r[2] for r in part],
            "new_tokens": [40] * len(part)}, schema=JOURNAL_SCHEMA))


@pytest.fixture(scope="module")
def spec():
    return default_target_spec()


def _config(n, **kw):
    return SelfPromptsConfig(samples=n, batch_size=4, **kw)


def test_every_filter_gives_its_reason_and_the_kept_prompts_carry_their_lineage(local_store, spec):
    rows = [([GOOD[0]], [], True),
            (["This text runs on and on without ever"], [], False),  # no end of turn
            (["Hi"], [], True),  # too short
            (["1234 5678 9012 3456 !!!"], [], True),  # no words
            (["Tell me a story. " + "and then and then " * 8], [], True),  # loop
            (["Как мне подготовиться к собеседованию на должность программиста?"], [], True),
            ([GOOD[0].upper() + "!!"], [], True),  # exact duplicate after normalization
            ([LONG], [], True),
            ([LONG + " Please keep it short."], [], True),  # near duplicate of the one before
            ([GOOD[1], GOOD[2]], ["Here is the function."], True),  # two turns kept
            ([GOOD[3], "x"], ["Take it slowly."], True)]  # later turn too short: cut before it
    config = _config(len(rows), sampling=SelfPromptSampling(turns=2))
    _journal(local_store, spec, config, "shard-00000", rows)
    result = generate_self_prompts(local_store, "shard-00000", spec, config)
    s = result.stats
    assert s.filtered == {"duplicate": 1, "near_duplicate": 1, "no_end_of_turn": 1, "no_words": 1,
                          "repetition_loop": 1, "too_short": 1, "wrong_language": 1}
    assert set(s.filtered) <= set(FILTER_REASONS)
    assert (s.samples, s.kept, s.ended_turn, s.later_turns_cut) == (11, 4, 10, 1)
    assert s.batches == s.batches_resumed == 3 and s.generate_seconds == 0 and s.prompts_per_s is None
    assert s.distinct_ratio == 0.9  # 9 distinct normalized first turns of 10 that ended
    table = read_self_prompts(local_store, "shard-00000")
    assert table.schema == SELF_PROMPT_SCHEMA
    assert table.column("user_turns").to_pylist() == [[GOOD[0]], [LONG], [GOOD[1], GOOD[2]], [GOOD[3]]]
    assert table.column("answers").to_pylist() == [[], [], ["Here is the function."], []]
    assert set(table.column("source").to_pylist()) == {SOURCE}
    assert table.column("source_id").to_pylist()[0] == "shard-00000#0"
    quarantine = local_store.read_parquet("self_generated_prompts/_quarantine/shard-00000.parquet")
    assert quarantine.schema == QUARANTINE_SCHEMA and quarantine.num_rows == 7
    assert "self_generated:shard-00000/" in quarantine.to_pylist()[5]["detail"]  # the duplicate names its first
    assert local_store.list("self_generated_prompts/_journal/") == []  # published: the journal is gone
    report = local_store.read_json("self_generated_prompts/_reports/shard-00000.json")
    assert report["kept"] == 4 and "near_duplicate" in report["reasons"]


def test_duplicates_of_the_corpus_and_of_other_partitions_and_contaminated_turns_are_dropped(
        local_store, spec, tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": t}]})
                                for t in (GOOD[0], LONG + " Thanks.")) + "\n")
    ingest_prompt_source(str(source), local_store)
    bench = tmp_path / "bench.txt"
    bench.write_text(GOOD[2] + "\n")
    config = _config(4)
    _journal(local_store, spec, config, "shard-00000", [([t], [], True) for t in (GOOD[0], LONG, GOOD[2], GOOD[3])])
    first = generate_self_prompts(local_store, "shard-00000", spec, config, benchmark_files=[str(bench)])
    assert first.stats.filtered == {"contaminated": 1, "duplicate": 1, "near_duplicate": 1}
    assert first.stats.benchmark_prompts == 1
    details = first.quarantine.column("detail").to_pylist()
    assert details[0].startswith("equals corpus:shard-00000/") and "corpus:" in details[1]
    assert "benchmark:bench.txt" in details[2]
    [cached] = local_store.list("self_generated_prompts/_index/")  # the corpus's signatures, once per generation
    assert cached.startswith("self_generated_prompts/_index/corpus-gen-1-")
    assert local_store.read_parquet(cached).num_rows == 2
    # another partition: what shard-00000 kept is a duplicate there
    _journal(local_store, spec, config, "shard-00001", [([t], [], True) for t in (GOOD[3], GOOD[4], GOOD[4], "x")])
    second = generate_self_prompts(local_store, "shard-00001", spec, config)
    assert second.quarantine.column("detail").to_pylist()[0].startswith("equals self_generated:shard-00000/")
    assert second.table.column("user_turns").to_pylist() == [[GOOD[4]]]
    assert second.stats.filtered == {"duplicate": 2, "too_short": 1}


def test_the_check_blocks_under_its_thresholds(local_store, spec):
    config = _config(8)
    _journal(local_store, spec, config, "shard-00000", [([GOOD[0]], [], True)] * 6 + [(["cut"], [], False)] * 2)
    stats = generate_self_prompts(local_store, "shard-00000", spec, config).stats
    passed, outcome, metadata = SelfPromptsThresholds().check(stats)
    assert not passed and "distinct ratio 16.7% < 90%" in outcome and "kept 1 of 8" in outcome
    assert metadata["filtered"] == {"duplicate": 5, "no_end_of_turn": 2}
    assert SelfPromptsThresholds(min_distinct_ratio=0.1, min_kept_ratio=0.1).check(stats)[0]
    assert "90%" in SelfPromptsThresholds().description()


def test_a_run_that_fails_mid_partition_resumes_from_the_batches_written(local_store, tmp_path, spec):
    from dflash_assets.store.backends import LocalStore

    config = SelfPromptsConfig(samples=6, batch_size=2, sampling=SelfPromptSampling(max_new_tokens=8),
                               filters=SelfPromptsConfig().filters)

    def fail_after_first(batch):
        if batch == 0:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        generate_self_prompts(local_store, "shard-00000", spec, config, on_batch=fail_after_first)
    assert len(local_store.list("self_generated_prompts/_journal/")) == 1
    assert not local_store.exists("self_generated_prompts/shard-00000.parquet")
    resumed = generate_self_prompts(local_store, "shard-00000", spec, config)
    assert (resumed.stats.batches, resumed.stats.batches_resumed, resumed.stats.samples) == (3, 1, 6)
    straight = generate_self_prompts(LocalStore(str(tmp_path / "other")), "shard-00000", spec, config)
    assert straight.stats.batches_resumed == 0
    assert resumed.quarantine.column("raw").to_pylist() == straight.quarantine.column("raw").to_pylist()
    assert resumed.stats.sha256 == straight.stats.sha256


def test_each_partition_draws_its_own_conversations(local_store, spec):
    """One config, two partitions: the second's samples are not the first's again (each would be filtered as a
    duplicate of the first, and every partition after it kept empty)."""
    config = SelfPromptsConfig(samples=4, batch_size=4, sampling=SelfPromptSampling(max_new_tokens=8))
    first = generate_self_prompts(local_store, "shard-00000", spec, config)
    second = generate_self_prompts(local_store, "shard-00001", spec, config)
    drawn = [sorted([json.loads(r)["user_turns"] for r in run.quarantine.column("raw").to_pylist()]
                    + run.table.column("user_turns").to_pylist()) for run in (first, second)]
    assert first.stats.samples == second.stats.samples == 4
    assert drawn[0] != drawn[1] and "duplicate" not in second.stats.filtered
    assert partition_seed(0, "shard-00000") != partition_seed(0, "shard-00001") == partition_seed(0, "shard-00001")


def test_raw_prompts_mixes_the_partition_by_weight(local_store, spec, tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"Question number {i}?"}]})
                                for i in range(4)) + "\n")
    ingest_prompt_source(str(source), local_store)
    config = _config(4)
    _journal(local_store, spec, config, "shard-00000", [([t], [], True) for t in GOOD[:4]])
    generate_self_prompts(local_store, "shard-00000", spec, config)
    own = read_self_prompts(local_store, "shard-00000")
    table, stats = materialize_prompt_shard(local_store, "shard-00000", [(SOURCE, own, 0.5)])
    assert table.num_rows == 6 and stats.sources == {"corpus": 4, SOURCE: 2}
    assert table.column("user_turns").to_pylist()[4:] == [[GOOD[0]], [GOOD[1]]]
    assert local_store.read_parquet("raw_prompts/shard-00000.parquet").num_rows == 6
    plain, _ = materialize_prompt_shard(local_store, "shard-00000", [(SOURCE, own, 0.0)])
    assert plain.num_rows == 4
