"""What a completions run resumes from: its journal of finished rows, and the rows already published.

``CompletionJournal``: ``completions/_journal/<shard>/<run>-<seq>.jsonl``, finished rows flushed in small atomic
chunks, so a ``kill -9`` loses at most the unflushed rows; ``published_rows``: the rows of
``completions/<shard>.parquet`` with the run's ``config_hash``.

Reads and writes, through the store: ``completions/_journal/<shard>/`` (read, written, cleared); reads
``completions/<shard>.parquet``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pyarrow.compute as pc

from dflash_assets.generation.engines import json_dumps, json_loads
from dflash_assets.store import layout

__all__ = ["CompletionJournal", "published_rows"]


class CompletionJournal:
    """Finished rows, flushed to the store in small atomic JSONL chunks.

    ``completions/_journal/<shard>/<run>-<seq>.jsonl``: finished rows as they arrive,
    one small object per flush (every ``flush_every`` rows or ``flush_interval_s``
    seconds). Each chunk is written atomically (LocalStore rename, S3 PUT), so a
    ``kill -9`` loses at most the unflushed rows. A new run reads the journal and
    regenerates only prompts without a journaled row of the same ``config_hash``.
    """

    def __init__(self, store: Any, shard: str, *, flush_every: int = 64, flush_interval_s: float = 10.0):
        self.store = store
        self.prefix = layout.completions_journal(shard)
        self.flush_every = max(1, flush_every)
        self.flush_interval_s = flush_interval_s
        self.run_id = f"{int(time.time() * 1000):013d}-{secrets.token_hex(3)}"
        self._buffer: list[dict] = []
        self._seq = 0
        self._last_flush = time.monotonic()
        self._lock = asyncio.Lock()
        self.chunks_written = 0
        self.bad_lines = 0

    def keys(self) -> list[str]:
        return [k for k in self.store.list(self.prefix) if k.endswith(".jsonl")]

    def load(self, config_hash: str) -> dict[str, dict]:
        """Journaled rows with this config_hash, first per prompt_id."""
        rows: dict[str, dict] = {}
        for key in self.keys():
            for line in self.store.read_bytes(key).splitlines():
                if not line.strip():
                    continue
                try:
                    row = json_loads(line)
                except ValueError:
                    self.bad_lines += 1  # chunks are atomic; this only guards against foreign files
                    continue
                if row.get("config_hash") == config_hash and row.get("prompt_id") is not None:
                    rows.setdefault(row["prompt_id"], row)
        return rows

    def add(self, row: dict) -> None:
        self._buffer.append(row)

    @property
    def due(self) -> bool:
        return bool(self._buffer) and (len(self._buffer) >= self.flush_every
                                       or time.monotonic() - self._last_flush >= self.flush_interval_s)

    async def flush(self) -> None:
        async with self._lock:
            if not self._buffer:
                return
            rows, self._buffer = self._buffer, []  # swapped before any await: no row is lost or written twice
            self._seq += 1
            key = f"{self.prefix}/{self.run_id}-{self._seq:06d}.jsonl"
            data = b"\n".join(json_dumps(r) for r in rows) + b"\n"
            self._last_flush = time.monotonic()
            await asyncio.to_thread(self.store.write_bytes, key, data)
            self.chunks_written += 1

    def clear(self) -> None:
        for key in self.store.list(self.prefix):
            self.store.delete(key)


def published_rows(store: Any, shard: str, config_hash: str, inputs: dict[str, dict]) -> dict[str, dict]:
    """Rows of the published ``completions/<shard>.parquet`` with this ``config_hash`` whose prompt is still an input,
    as journal-shaped dicts (timestamps in epoch seconds)."""
    key = layout.completions(shard)
    if not store.exists(key):
        return {}
    table = store.read_parquet(key)
    if "config_hash" not in table.column_names:
        return {}
    table = table.filter(pc.equal(table["config_hash"], config_hash))
    rows: dict[str, dict] = {}
    for row in table.to_pylist():
        if row["prompt_id"] in inputs:
            for name in ("started_at", "finished_at"):
                if row.get(name) is not None:
                    row[name] = row[name].timestamp()
            rows.setdefault(row["prompt_id"], row)
    return rows
