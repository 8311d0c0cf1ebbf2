"""What a completions run resumes from, through a real local store: the journal's chunks (flushed when due, read back
by config_hash, first row per prompt, a foreign line counted, cleared) and the published rows of the same
config_hash."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pyarrow as pa

from dflash_assets.generation.journal import CompletionJournal, published_rows
from dflash_assets.store import layout


def _row(pid: str, config_hash: str, text: str = "a") -> dict:
    return {"prompt_id": pid, "config_hash": config_hash, "messages": [{"role": "assistant", "content": text}]}


def test_journal_flushes_when_due_and_reads_back_one_config_hash(local_store):
    journal = CompletionJournal(local_store, "s0", flush_every=2, flush_interval_s=3600)
    journal.add(_row("p1", "h1"))
    assert not journal.due  # one row of two, and the interval not passed
    journal.add(_row("p2", "h2"))
    assert journal.due
    asyncio.run(journal.flush())
    journal.add(_row("p1", "h1", "later"))
    asyncio.run(journal.flush())
    assert journal.chunks_written == 2 and len(journal.keys()) == 2
    local_store.write_bytes(f"{layout.completions_journal('s0')}/foreign.jsonl", b"not json\n")

    again = CompletionJournal(local_store, "s0")  # a new run reads what the killed one flushed
    rows = again.load("h1")
    assert list(rows) == ["p1"] and rows["p1"]["messages"][0]["content"] == "a"  # the first row of a prompt wins
    assert list(again.load("h2")) == ["p2"] and again.bad_lines == 2  # the foreign line, read once per load
    again.clear()
    assert again.keys() == [] and again.load("h1") == {}


def test_published_rows_keep_the_config_hash_and_the_inputs_with_epoch_timestamps(local_store):
    assert published_rows(local_store, "s0", "h1", {"p1": {}}) == {}  # nothing published yet
    started = datetime(2026, 1, 2, tzinfo=timezone.utc)
    local_store.write_parquet(layout.completions("s0"), pa.table({
        "prompt_id": ["p1", "p2", "p3"],
        "config_hash": ["h1", "h2", "h1"],
        "started_at": pa.array([started] * 3, pa.timestamp("ms", tz="UTC")),
    }))
    rows = published_rows(local_store, "s0", "h1", {"p1": {}, "p2": {}})  # p3 is no longer an input
    assert list(rows) == ["p1"] and rows["p1"]["started_at"] == started.timestamp()
