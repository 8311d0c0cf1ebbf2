"""Tests for the prompts stage's ingest driver (dflash_assets.prompts.ingest, through normalization, quarantine,
corpus and shards): normalization, bad input quarantined, stable sharding, the embedded ShareGPT file, S3. The
corpus index, the quarantine writer, shard materialization and the settings have their own test modules.

Real files and real stores: a LocalStore in tmp, and an S3Store against moto's
ThreadedMotoServer on 127.0.0.1 (real HTTP through boto3). The embedded
ShareGPT file is ingested whole; the counts it must give are derived here
independently from the file.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import socket
import unicodedata
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import zstandard

from dflash_assets.prompts.sources import SourceFormatError, embedded_sharegpt_path, read_source
from dflash_assets.store import layout
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import list_shard_keys
from dflash_assets.prompts.ingest import NoValidPromptsError, ingest_prompt_source
from dflash_assets.prompts.normalization import Prompt, Rejection, normalize_record
from dflash_assets.prompts.quarantine import QUARANTINE_REASONS, QUARANTINE_SCHEMA
from dflash_assets.prompts.shards import PROMPT_SCHEMA, materialize_prompt_shard
from dflash_assets.store.backends import LocalStore, S3Store


def conv(*turns, **extra):
    """ShareGPT record from (role, text) pairs."""
    return {"conversations": [{"from": r, "value": v} for r, v in turns], **extra}


def msgs(*turns, **extra):
    """OpenAI-messages record from (role, content) pairs."""
    return {"messages": [{"role": r, "content": v} for r, v in turns], **extra}


def _jsonl(records) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "store")


def _manifest(store) -> dict[str, str]:
    index = store.read_json(layout.corpus_index())
    t = store.read_parquet(index["manifest_key"])
    return dict(zip(t.column("prompt_id").to_pylist(), t.column("shard").to_pylist()))


# --- normalize_record -------------------------------------------------------------


@pytest.mark.parametrize("assistant", ["gpt", "chatgpt", "bing", "bard", "assistant", "GPT", " Assistant "])
@pytest.mark.parametrize("user", ["human", "user", "Human"])
def test_roles_map_and_assistant_turns_are_removed(user, assistant):
    p = normalize_record(conv(("system", "sys"), (user, "q1"), (assistant, "a1"), (user, "q2"), (assistant, "a2")))
    assert isinstance(p, Prompt)
    assert (p.system, p.user_turns) == ("sys", ("q1", "q2"))
    assert not p.starts_mid_conversation and p.notes == ()
    # the answer text never affects the prompt id
    q = normalize_record(conv(("system", "sys"), (user, "q1"), (assistant, "other"), (user, "q2")))
    assert q.prompt_id == p.prompt_id


def test_sharegpt_and_openai_shapes_give_the_same_prompt():
    a = normalize_record(conv(("system", "s"), ("human", "hi"), ("gpt", "yo"), ("human", "bye"), id="x_0"))
    b = normalize_record(msgs(("system", "s"), ("user", "hi"), ("assistant", "yo"), ("user", "bye"), id=7))
    parts = normalize_record({"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"}]})
    assert a.prompt_id == b.prompt_id == parts.prompt_id
    assert len(a.prompt_id) == 20 and int(a.prompt_id, 16) >= 0
    assert (a.source_id, b.source_id, parts.source_id) == ("x_0", "7", "#0")


def test_nfc_strip_and_prompt_id_is_content_hash():
    decomposed = normalize_record(conv(("human", "  Cafe\u0301 \n")))
    composed = normalize_record(conv(("human", "Café")))
    assert decomposed.user_turns == ("Café",) and unicodedata.is_normalized("NFC", decomposed.user_turns[0])
    assert decomposed.prompt_id == composed.prompt_id
    assert normalize_record(conv(("human", "Cafe"))).prompt_id != composed.prompt_id
    with_system = normalize_record(conv(("system", "x"), ("human", "Café")))
    assert with_system.prompt_id != composed.prompt_id


def test_structure_fixes_are_counted_in_notes():
    p = normalize_record(conv(("system", "a"), ("system", "b"), ("human", "u1"), ("human", " "), ("human", "u2"),
                              ("gpt", "x"), ("human", "u3")))
    assert p.system == "a\n\nb" and p.user_turns == ("u1\n\nu2", "u3")
    assert set(p.notes) == {"system_turns_merged", "empty_user_turns_dropped", "user_turns_merged"}
    p = normalize_record(conv(("system", "  "), ("human", "q")))
    assert p.system is None and p.notes == ("empty_system_dropped",)


def test_leading_assistant_policy():
    record = conv(("gpt", "...the rest of an answer"), ("human", "continue"), ("gpt", "ok"))
    p = normalize_record(record)
    assert p.user_turns == ("continue",) and p.starts_mid_conversation
    assert p.notes == ("leading_assistant_dropped",)
    r = normalize_record(record, IngestConfig(leading_assistant="quarantine"))
    assert r == Rejection("assistant_first", "1 assistant turn(s) before the first user turn")


def test_category_from_the_record():
    assert normalize_record(conv(("human", "q"), category=" Coding ")).category == "Coding"
    assert normalize_record(conv(("human", "q"))).category == "unknown"
    assert normalize_record(conv(("human", "q"), task="math"), IngestConfig(category_field="task")).category == "math"


@pytest.mark.parametrize("record, reason, detail", [
    ("just text", "not_an_object", "str"),
    ([{"from": "human", "value": "q"}], "not_an_object", "list"),
    ({"id": "x"}, "missing_conversation", "no 'conversations'"),
    ({"conversations": "human: hi"}, "missing_conversation", "str"),
    (conv(), "empty_conversation", "0 turns"),
    (msgs(), "empty_conversation", "0 turns"),
    (conv(("gpt", "a"), ("gpt", "b")), "no_user_turn", "assistant-only"),
    (conv(("system", "shared from ChatHub")), "no_user_turn", "system-only"),
    (conv(("system", "s"), ("human", " \n"), ("gpt", "a")), "no_user_turn", "user turns are empty"),
    (conv(("human", "q"), ("narrator", "{}")), "unknown_role", "'narrator'"),
    # tool results are agentic turns; without a call before them they are orphans
    (conv(("human", "q"), ("tool", "{}")), "orphan_tool_result", "no tool call before it"),
    (msgs(("user", "q"), ("function", "f")), "orphan_tool_result", "no tool call before it"),
    (conv(("human", "q"), ("gpt", None)), "non_string_content", "NoneType"),
    (msgs(("user", 42)), "non_string_content", "int"),
    (msgs(("user", {"text": "q"})), "non_string_content", "dict"),
    (msgs(("user", [{"type": "image_url", "image_url": {"url": "x"}}])), "non_string_content", "list"),
    ({"conversations": ["hi"]}, "bad_turn", "turn 0 is a str"),
    ({"conversations": [{"speaker": "human", "value": "q"}]}, "bad_turn", "no 'from' or 'role'"),
    ({"conversations": [{"from": "human"}]}, "bad_turn", "no content"),
    ({"conversations": [{"from": 1, "value": "q"}]}, "bad_turn", "role is a int"),
    (conv(("human", "q"), ("gpt", "a"), ("system", "late")), "late_system_turn", "position 2"),
    (conv(("human", "x" * 101)), "oversize", "101 chars"),
    (conv(("human", "bad \ud800 surrogate")), "invalid_utf8", "lone surrogate"),
])
def test_rejections(record, reason, detail):
    r = normalize_record(record, IngestConfig(max_record_chars=100))
    assert isinstance(r, Rejection) and r.reason == reason, r
    assert reason in QUARANTINE_REASONS
    assert detail in r.detail


# --- ingest: bad input of every kind --------------------------------------------------

GOOD = [conv(("human", f"question {k}"), ("gpt", "answer"), id=f"g{k}") for k in range(5)]
BAD = [  # (record, reason)
    (conv(id="e"), "empty_conversation"),
    (conv(("gpt", "only me"), id="ao"), "no_user_turn"),
    (conv(("system", "only me"), id="so"), "no_user_turn"),
    (conv(("human", "q"), ("robot", "beep"), id="ur"), "unknown_role"),
    (msgs(("user", None), id="ns"), "non_string_content"),
    (conv(("human", "q"), ("gpt", "a"), ("system", "s"), id="ls"), "late_system_turn"),
    (conv(("human", "z" * 500), id="big"), "oversize"),
    (["not", "an", "object"], "not_an_object"),
]
DUPES = [conv(("human", "question 1"), ("gpt", "different answer"), id="d1"),
         msgs(("user", "question 2 "), id="d2")]  # same prompt after strip
CONFIG = IngestConfig(max_record_chars=200, max_prompts_per_shard=2)


def _mixed_records():
    return GOOD[:3] + [r for r, _ in BAD[:4]] + DUPES + GOOD[3:] + [r for r, _ in BAD[4:]]


def _expected_quarantine(extra=()):
    return dict(Counter([reason for _, reason in BAD] + list(extra)))


def _check_mixed_report(report, store, extra=()):
    expected = _expected_quarantine(extra)
    assert report.quarantined == dict(sorted(expected.items()))
    assert report.valid == 5 and report.duplicates == 2 and report.new_prompts == 5
    assert report.records_read == report.valid + report.duplicates + report.quarantined_total
    assert report.shard_sizes == {"shard-00000": 2, "shard-00001": 2, "shard-00002": 1}
    q = store.read_parquet(report.quarantine_key)
    assert q.schema.equals(QUARANTINE_SCHEMA)
    assert dict(Counter(q.column("reason").to_pylist())) == expected
    rows = {r["source_id"]: r for r in q.to_pylist() if r["source_id"]}
    assert rows["ur"]["reason"] == "unknown_role" and "robot" in rows["ur"]["raw"]
    assert json.loads(rows["ls"]["raw"])["conversations"][2]["value"] == "s"  # the raw record, as JSON text
    assert rows["big"]["raw_chars"] > 500


@pytest.mark.parametrize("kind", ["json", "jsonl", "jsonl.gz", "json.zst", "parquet"])
def test_bad_input_is_quarantined_not_fatal(tmp_path, store, kind):
    records = _mixed_records()
    extra = []
    if kind == "parquet":  # Parquet has one schema: bad records are the ones it can still hold
        records = [r for r in records if isinstance(r, dict) and "conversations" in r]
        t = pa.Table.from_pylist(records)
        buf = io.BytesIO()
        pq.write_table(t, buf)
        data = buf.getvalue()
    elif kind.startswith("jsonl"):
        data = _jsonl(records) + b'{"id": "broken", "conv\n' + b'{"id": "u8", "x": "\xff"}\n'
        extra = ["malformed_json", "invalid_utf8"]
    else:
        data = json.dumps(records).encode()
    if kind.endswith(".gz"):
        data = gzip.compress(data)
    if kind.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"src.{kind}"
    path.write_bytes(data)
    report = ingest_prompt_source(str(path), store, CONFIG)
    assert report.source_name == "src"
    if kind == "parquet":
        assert report.valid == 5 and report.duplicates == 1  # the messages-shaped dupe is not in this file
        assert report.quarantined == {"empty_conversation": 1, "late_system_turn": 1, "no_user_turn": 2,
                                      "oversize": 1, "unknown_role": 1}
    else:
        _check_mixed_report(report, store, extra)
    table, stats = materialize_prompt_shard(store, "shard-00000")
    assert table.schema.equals(PROMPT_SCHEMA)
    assert table.column("user_turns").to_pylist() == [["question 0"], ["question 1"]]
    assert stats.num_prompts == 2 and stats.sources == {"src": 2}


def test_truncated_json_array_is_reported(tmp_path, store):
    data = json.dumps(GOOD, indent=1).encode()
    cut = data.rindex(b"question 4") + 4
    (tmp_path / "cut.json").write_bytes(data[:cut])
    report = ingest_prompt_source(tmp_path / "cut.json", store, CONFIG)
    assert report.records_read == 4 and report.valid == 4 and report.quarantined == {}
    assert report.truncated and report.truncated_at_byte == data.rindex(b"\n {", 0, cut) + 2  # the record, not its turn


@pytest.mark.parametrize("kind", ["zstd", "gzip"])
def test_cut_compressed_source_is_reported_cut_with_file_and_offset(tmp_path, store, kind):
    records = [conv(("human", f"question {k} " + "word " * (k % 40)), id=f"r{k}") for k in range(2000)]
    data = _jsonl(records)
    packed = zstandard.ZstdCompressor().compress(data) if kind == "zstd" else gzip.compress(data)
    path = tmp_path / f"cut.jsonl.{'zst' if kind == 'zstd' else 'gz'}"
    cut = len(packed) * 2 // 3
    path.write_bytes(packed[:cut])
    report = ingest_prompt_source(path, store)
    assert 0 < report.valid < len(records) and report.records_read == report.valid
    assert report.truncated and report.damage == "cut" and report.stopped_at_compressed_byte == cut
    assert report.parse_error.startswith(f"{path}: {kind} stream cut at compressed byte {cut}")
    meta = report.to_metadata()
    assert (meta["source_damage"], meta["stopped_at_compressed_byte"]) == ("cut", cut)
    stored = store.read_json(layout.corpus_report("cut"))
    assert (stored["damage"], stored["stopped_at_compressed_byte"]) == ("cut", cut)
    (tmp_path / "whole.jsonl").write_bytes(data)
    whole = ingest_prompt_source(tmp_path / "whole.jsonl", LocalStore(tmp_path / "other"))
    assert whole.valid == len(records) and whole.damage is None and whole.to_metadata()["source_damage"] == "none"


def test_source_cut_inside_its_first_frame_header_fails_the_ingest_as_cut(tmp_path, store):
    packed = zstandard.ZstdCompressor().compress(_jsonl(GOOD))
    path = tmp_path / "prompts.jsonl.zst"
    path.write_bytes(packed[:6])  # magic number, frame header descriptor, part of the header
    with pytest.raises(SourceFormatError, match="zstd stream cut at compressed byte 6") as e:
        ingest_prompt_source(path, store, CONFIG)
    assert str(path) in str(e.value) and "empty" not in str(e.value)
    assert not store.exists(layout.corpus_index())  # nothing committed


# Shapes of a source that must neither lose records silently nor kill the ingest.


def test_trailing_data_after_a_json_array_is_quarantined(tmp_path, store):
    data = json.dumps(GOOD).encode() + b'\n{"id": "late", "conversations": [{"from": "human", "value": "lost?"}]}\n'
    (tmp_path / "tail.json").write_bytes(data)
    report = ingest_prompt_source(tmp_path / "tail.json", store, CONFIG)
    assert report.valid == len(GOOD) and report.quarantined == {"trailing_data": 1}
    assert report.records_read == report.valid + report.quarantined_total
    assert "trailing data" in report.parse_error and report.json_arrays == 1
    (row,) = store.read_parquet(report.quarantine_key).to_pylist()
    assert row["reason"] == "trailing_data" and '"late"' in row["raw"]
    assert row["byte_offset"] == data.index(b'{"id": "late"') and row["raw_chars"] == len(data) - row["byte_offset"]


def test_a_second_json_array_is_read_too(tmp_path, store):
    data = json.dumps(GOOD[:2]).encode() + b"\n" + json.dumps(GOOD[2:]).encode()
    (tmp_path / "two.json").write_bytes(data)
    report = ingest_prompt_source(tmp_path / "two.json", store, CONFIG)
    assert report.valid == len(GOOD) and report.quarantined == {} and report.parse_error is None
    assert report.json_arrays == 2


def test_jsonl_whose_lines_are_arrays_reads_every_record(tmp_path, store):
    data = b"".join(json.dumps([r]).encode() + b"\n" for r in GOOD[:3])
    (tmp_path / "arrays.jsonl").write_bytes(data)
    report = ingest_prompt_source(tmp_path / "arrays.jsonl", store, CONFIG)
    assert report.records_read == 3 and report.valid == 3 and report.json_arrays == 3
    assert report.source_format == "json_array"
    # a JSONL file (first line an object) with an array line: that line is a quarantined record, not lost silently
    data = _jsonl(GOOD[:1]) + json.dumps(GOOD[1:3]).encode() + b"\n" + _jsonl(GOOD[3:4])
    (tmp_path / "mixed.jsonl").write_bytes(data)
    report = ingest_prompt_source(tmp_path / "mixed.jsonl", store, CONFIG)
    assert report.valid == 2 and report.quarantined == {"not_an_object": 1}


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_deeply_nested_record_is_quarantined_not_fatal(tmp_path, store, kind):
    deep = b'{"id": "deep", "conversations": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    parts = [json.dumps(r).encode() for r in GOOD[:2]] + [deep] + [json.dumps(r).encode() for r in GOOD[2:]]
    data = b"[" + b", ".join(parts) + b"]" if kind == "json" else b"\n".join(parts) + b"\n"
    (tmp_path / f"deep.{kind}").write_bytes(data)
    report = ingest_prompt_source(tmp_path / f"deep.{kind}", store, CONFIG)
    assert report.valid == len(GOOD) and report.quarantined == {"nested_too_deep": 1}
    assert report.parse_error is None
    (row,) = store.read_parquet(report.quarantine_key).to_pylist()
    assert row["raw_chars"] == len(deep) and row["byte_offset"] == data.index(b'{"id": "deep"')


@pytest.mark.parametrize("kind", ["json", "jsonl", "json.gz"])
def test_megabytes_of_blank_space_before_the_records_are_read_past(tmp_path, store, kind):
    """A valid JSON array after ~2 MB of whitespace is read, not reported as an empty file."""
    blank = b"\n" * (2 * 1024 * 1024)
    body = json.dumps(GOOD).encode() if kind.startswith("json.") or kind == "json" else _jsonl(GOOD)
    data = blank + body
    path = tmp_path / f"blank.{kind}"
    path.write_bytes(gzip.compress(data) if kind.endswith(".gz") else data)
    report = ingest_prompt_source(path, store, CONFIG)
    assert report.valid == len(GOOD) and report.quarantined == {} and not report.truncated
    assert report.source_format == ("jsonl" if kind == "jsonl" else "json_array")
    table, _ = materialize_prompt_shard(store, "shard-00000")
    assert table.column("user_turns").to_pylist() == [["question 0"], ["question 1"]]


def test_zero_valid_prompts_raises_with_reason_counts(tmp_path, store):
    (tmp_path / "bad.jsonl").write_bytes(_jsonl([r for r, _ in BAD[:3]]) + b"nope\n")
    with pytest.raises(NoValidPromptsError) as e:
        ingest_prompt_source(tmp_path / "bad.jsonl", store, CONFIG)
    msg = str(e.value)
    assert "no valid prompt" in msg and "no_user_turn=2" in msg and "empty_conversation=1" in msg
    assert "malformed_json=1" in msg and "4 records read" in msg
    assert not store.exists(layout.corpus_index())  # the corpus is unchanged
    q = store.read_parquet("prompt_corpus/quarantine/bad.parquet")
    assert q.num_rows == 4
    assert list_shard_keys(store) == []


def test_limit_takes_the_first_valid_prompts(tmp_path, store):
    (tmp_path / "s.jsonl").write_bytes(_jsonl(_mixed_records()))
    report = ingest_prompt_source(tmp_path / "s.jsonl", store, IngestConfig(limit=4, max_record_chars=200))
    assert report.valid == 4 and report.limit_reached
    # GOOD[0..2], 4 bad, the dupe of question 1, then the dupe of question 2, then GOOD[3]
    assert report.records_read == 3 + 4 + 2 + 1 and report.duplicates == 2
    t, _ = materialize_prompt_shard(store, "shard-00000")
    assert t.column("source_id").to_pylist() == ["g0", "g1", "g2", "g3"]


# --- stable sharding --------------------------------------------------------------------


def _prompts(ids):
    return [conv(("human", f"prompt {k}"), ("gpt", "a"), id=f"p{k}") for k in ids]


def _ingest(tmp_path, store, ids, cap=3, **kw):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(_jsonl(_prompts(ids)))
    return ingest_prompt_source(path, store, IngestConfig(max_prompts_per_shard=cap, **kw))


def _materialize_all(store):
    out = {}
    for shard in list_shard_keys(store):
        t, stats = materialize_prompt_shard(store, shard)
        assert stats.num_prompts == t.num_rows and stats.shard == shard
        assert stats.to_metadata()["num_prompts"] == t.num_rows  # one spelling for metadata: to_metadata()
        out[shard] = t.column("source_id").to_pylist()
        assert store.read_parquet(f"raw_prompts/{shard}.parquet").equals(t)
    return out


def test_reingest_with_added_prompts_never_moves_a_prompt(tmp_path, store):
    r1 = _ingest(tmp_path, store, range(7))
    assert r1.shard_sizes == {"shard-00000": 3, "shard-00001": 3, "shard-00002": 1}
    assert r1.new_shards == ["shard-00000", "shard-00001", "shard-00002"] and r1.changed_shards == []
    before = _manifest(store)
    index1 = store.read_json(layout.corpus_index())
    assert _materialize_all(store) == {"shard-00000": ["p0", "p1", "p2"], "shard-00001": ["p3", "p4", "p5"],
                                             "shard-00002": ["p6"]}

    # new prompts before, between and after the old ones; p4 has left the source
    r2 = _ingest(tmp_path, store, [100, 0, 1, 101, 2, 3, 5, 6, 102, 103, 104, 105])
    after = _manifest(store)
    assert {pid: after[pid] for pid in before} == before  # nothing moved
    assert r2.existing_prompts == 6 and r2.new_prompts == 6 and r2.kept_not_in_source == 1
    assert r2.changed_shards == ["shard-00002"]  # the open last shard was filled first
    assert r2.new_shards == ["shard-00003", "shard-00004"]
    assert r2.shard_sizes == {"shard-00000": 3, "shard-00001": 3, "shard-00002": 3, "shard-00003": 3,
                              "shard-00004": 1}
    assert r2.shards_to_materialize == ["shard-00002", "shard-00003", "shard-00004"]
    assert r2.corpus_prompts == 13 and r2.generation == 2
    meta = r2.to_metadata()  # flat values for asset metadata
    assert (meta["changed_shards"], meta["new_shards"], meta["num_shards"]) == ("shard-00002", 2, 5)
    assert meta["valid"] == r2.num_valid == 12 and meta["quarantined"] == {}
    index2 = store.read_json(layout.corpus_index())
    for shard in ("shard-00000", "shard-00001"):  # untouched shards keep the very same object
        assert index2["shards"][shard] == index1["shards"][shard]
    assert _materialize_all(store) == {
        "shard-00000": ["p0", "p1", "p2"], "shard-00001": ["p3", "p4", "p5"],  # p4 kept though gone from the source
        "shard-00002": ["p6", "p100", "p101"], "shard-00003": ["p102", "p103", "p104"], "shard-00004": ["p105"]}

    # the same source again: nothing changes but the generation
    r3 = _ingest(tmp_path, store, [100, 0, 1, 101, 2, 3, 5, 6, 102, 103, 104, 105])
    assert r3.new_prompts == 0 and r3.new_shards == [] and r3.changed_shards == []
    assert _manifest(store) == after and r3.generation == 3

    # a bigger cap later: only the last shard and new ones use it
    r4 = _ingest(tmp_path, store, range(200, 206), cap=4)
    assert r4.changed_shards == ["shard-00004"] and r4.new_shards == ["shard-00005"]
    assert r4.shard_sizes["shard-00004"] == 4 and r4.shard_sizes["shard-00005"] == 3
    assert {pid: s for pid, s in _manifest(store).items() if pid in after} == after


def test_fill_last_shard_off_leaves_existing_shards_alone(tmp_path, store):
    _ingest(tmp_path, store, range(4), cap=3)
    r = _ingest(tmp_path, store, range(6), cap=3, fill_last_shard=False)
    assert r.changed_shards == [] and r.new_shards == ["shard-00002"]
    assert _materialize_all(store) == {"shard-00000": ["p0", "p1", "p2"], "shard-00001": ["p3"],
                                       "shard-00002": ["p4", "p5"]}


# --- the embedded ShareGPT file, whole -------------------------------------------------------

_USER, _ASSIST = {"human", "user"}, {"gpt", "chatgpt", "bing", "bard", "assistant"}


def _reference(records, max_chars):
    """Expected outcome per record, derived without the library: (reason, (system, user_turns), leading)."""
    out = []
    for r in records:
        turns = r["conversations"]
        assert {t["from"] for t in turns} <= _USER | _ASSIST | {"system"}
        assert all(t["from"] != "system" for t in turns[1:])  # no late system turn in this file
        if not turns:
            out.append(("empty_conversation", None, False))
            continue
        system, runs, prev_user, leading = None, [], False, False
        for t in turns:
            text = unicodedata.normalize("NFC", t["value"]).strip()
            if t["from"] == "system":
                system = text or None
            elif t["from"] in _USER and text:
                if prev_user:
                    runs[-1] += "\n\n" + text
                else:
                    runs.append(text)
                prev_user = True
            elif t["from"] in _ASSIST:
                prev_user = False
                leading = leading or not runs
        if not runs:
            out.append(("no_user_turn", None, False))
        elif len(system or "") + sum(map(len, runs)) > max_chars:
            out.append(("oversize", None, leading))
        else:
            out.append((None, (system, tuple(runs)), leading))
    return out


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    path = embedded_sharegpt_path()
    data = path.read_bytes()
    # the complete part, found by the file's own layout (2-space indent), not by the library
    sep = b"\n  },\n  {"
    cut = data.rindex(sep) + len(b"\n  }")
    records = json.loads(data[:cut] + b"\n]")
    store = LocalStore(tmp_path_factory.mktemp("sharegpt-store"))
    report = ingest_prompt_source(path, store)
    return {"records": records, "truncated_at": data.rindex(sep) + len(sep) - 1, "store": store, "report": report,
            "expected": _reference(records, IngestConfig().max_record_chars)}


def test_embedded_sharegpt_counts(sharegpt):
    records, report, store, expected = sharegpt["records"], sharegpt["report"], sharegpt["store"], sharegpt["expected"]
    reasons = Counter(reason for reason, _, _ in expected if reason)
    valid = [(key, leading) for reason, key, leading in expected if reason is None]
    unique: dict = {}
    for key, leading in valid:
        unique.setdefault(key, leading)  # the first occurrence is kept

    assert len(records) == 17_671 and report.records_read == 17_671
    assert report.truncated and report.truncated_at_byte == sharegpt["truncated_at"]
    assert report.source_format == "json_array" and report.parse_error is None
    assert report.quarantined == dict(sorted(reasons.items()))
    assert reasons["empty_conversation"] == sum(1 for r in records if not r["conversations"]) > 100
    assert report.valid == len(unique) and report.duplicates == len(valid) - len(unique) > 0
    assert report.records_read == report.valid + report.duplicates + report.quarantined_total
    assert report.notes["leading_assistant_dropped"] == sum(unique.values()) > 5000
    assert sum(report.shard_sizes.values()) == report.valid == report.corpus_prompts
    assert max(report.shard_sizes.values()) == 1024 and len(report.shard_keys) == -(-report.valid // 1024)

    q = store.read_parquet(report.quarantine_key)
    details = Counter(d.split(" (")[0] for d in q.filter(pc.equal(q["reason"], "no_user_turn"))["detail"]
                      .to_pylist())
    system_only = sum(1 for r in records
                      if r["conversations"] and {t["from"] for t in r["conversations"]} == {"system"})
    assert details["system-only"] == system_only == 12
    assistant_only = sum(1 for r in records if r["conversations"]
                         and not {t["from"] for t in r["conversations"]} & (_USER | {"system"}))
    assert details["assistant-only"] == assistant_only > 100


def test_embedded_sharegpt_rows(sharegpt):
    records, store, report, expected = sharegpt["records"], sharegpt["store"], sharegpt["report"], sharegpt["expected"]
    tables = [materialize_prompt_shard(store, s)[0] for s in report.shard_keys]
    table = pa.concat_tables(tables)
    assert table.num_rows == report.valid and len(set(table.column("prompt_id").to_pylist())) == report.valid
    got = {(r["system"], tuple(r["user_turns"])) for r in table.select(["system", "user_turns"]).to_pylist()}
    assert got == {key for reason, key, _ in expected if reason is None}
    # records answered by chatgpt/bing/bard are kept (their role maps to assistant)
    other = [key for r, (_, key, _) in zip(records, expected)
             if {t["from"] for t in r["conversations"]} & {"chatgpt", "bing", "bard"}]
    assert len(other) == 11 and all(key in got for key in other)
    assert {"chatgpt", "bing", "bard"} <= set(report.roles)
    assert set(table.column("category").to_pylist()) == {"unknown"}
    assert table.column("source").unique().to_pylist() == ["ShareGPT_V3_unfiltered_cleaned_split"]


def test_embedded_sharegpt_assistant_first_quarantine_policy(sharegpt, tmp_path):
    expected = sharegpt["expected"]
    first = sum(1 for reason, _, leading in expected if reason in (None, "oversize") and leading)
    oversize = sum(1 for reason, _, leading in expected if reason == "oversize" and not leading)
    report = ingest_prompt_source(embedded_sharegpt_path(), LocalStore(tmp_path),
                                  IngestConfig(leading_assistant="quarantine"))
    assert report.quarantined["assistant_first"] == first > 5000
    assert report.quarantined.get("oversize", 0) == oversize
    assert "leading_assistant_dropped" not in report.notes


def test_embedded_sharegpt_small_subset(tmp_path):
    """The demo path: the first 64 valid prompts, fast."""
    report = ingest_prompt_source(embedded_sharegpt_path(), LocalStore(tmp_path), IngestConfig(limit=64,
                                  max_prompts_per_shard=16))
    assert report.valid == 64 and report.limit_reached and not report.truncated
    assert report.shard_keys == ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
    assert report.records_read < 100


# --- S3: source and store through moto's server (real HTTP) -------------------------------------


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            import boto3

            client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
            client.create_bucket(Bucket="sources")
            client.create_bucket(Bucket="store")
            yield client
        finally:
            server.stop()


def test_s3_source_and_s3_store(s3):
    records = _prompts(range(5)) + [conv(id="empty")]
    body = zstandard.ZstdCompressor().compress(_jsonl(records))
    s3.put_object(Bucket="sources", Key="in/corpus.jsonl.zst", Body=body)
    store = S3Store("s3://store/run1", s3)
    report = ingest_prompt_source("s3://sources/in/corpus.jsonl.zst", store, IngestConfig(max_prompts_per_shard=2))
    assert (report.compression, report.source_format, report.source_name) == ("zstd", "jsonl", "corpus")
    assert report.valid == 5 and report.quarantined == {"empty_conversation": 1}
    assert report.shard_sizes == {"shard-00000": 2, "shard-00001": 2, "shard-00002": 1}
    table, stats = materialize_prompt_shard(store, "shard-00001")
    assert table.column("source_id").to_pylist() == ["p2", "p3"]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="store", Prefix="run1/")["Contents"]}
    assert {"run1/prompt_corpus/index.json", "run1/raw_prompts/shard-00001.parquet",
            "run1/prompt_corpus/quarantine/corpus.parquet"} <= keys

    # re-ingest from a grown gzip JSON array on S3: nothing moves
    before = _manifest(store)
    grown = _prompts([9, 0, 1, 2, 3, 4, 8])
    s3.put_object(Bucket="sources", Key="in/corpus.json.gz", Body=gzip.compress(json.dumps(grown).encode()))
    r2 = ingest_prompt_source("s3://sources/in/corpus.json.gz", store,
                              IngestConfig(max_prompts_per_shard=2, source_name="corpus"))
    after = _manifest(store)
    assert {k: after[k] for k in before} == before
    assert r2.changed_shards == ["shard-00002"] and r2.new_shards == ["shard-00003"]
    assert materialize_prompt_shard(store, "shard-00002")[0].column("source_id").to_pylist() == ["p4", "p9"]


def test_s3_parquet_source_is_spooled(s3, store):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(_prompts(range(3))), buf)
    s3.put_object(Bucket="sources", Key="in/p.parquet", Body=buf.getvalue())
    with read_source("s3://sources/in/p.parquet", s3_client=s3) as reader:
        assert [i.record["id"] for i in reader] == ["p0", "p1", "p2"]
        assert reader.summary.format == "parquet"
    report = ingest_prompt_source("s3://sources/in/p.parquet", store, s3_client=s3)
    assert report.valid == 3
    with pytest.raises(FileNotFoundError):
        ingest_prompt_source("s3://sources/in/missing.json", store, s3_client=s3)
