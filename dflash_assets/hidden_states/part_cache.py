"""A bounded local cache of hidden-state cache parts fetched from the store, for training.

Training reads a cache far larger than a GPU host's disk (a 914K-sample corpus
is ~140 TB at Qwen3.6-27B shapes). :class:`BoundedPartCache` keeps at most
``limit_bytes`` of part files in a local directory: it reads the parts'
headers and offsets by ranged reads (no download), downloads a part when the
reader needs it, prefetches the parts the training plan needs next while
there is room, and evicts the part whose next use is furthest (or never) to
make room. A part larger than the limit is refused up front with a clear
error. It is the ``source`` of :class:`~dflash_assets.hidden_states.format.HiddenStateCacheReader`.

Reads: the store (ranged reads, whole-object downloads; S3 through the
store's boto3 client, a local store by its file paths). Writes: part files
under ``cache_dir/dflash-parts-<pid>-*/`` (removed on close; directories of
dead processes are removed at the next start). Imports numpy and safetensors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_assets.atomic_write import atomic_path
from dflash_assets.store.manifest import remove_stale_scratch, scratch_prefix

__all__ = ["PartTooLarge", "CacheStats", "BoundedPartCache", "store_read_range", "store_download"]


class PartTooLarge(ValueError):
    """A single part is larger than the local cache's limit: it could never be held."""


def _s3_location(store: Any, key: str) -> tuple[str, str]:
    bucket, _, full = store.url(key)[len("s3://"):].partition("/")
    return bucket, full


def store_read_range(store: Any, key: str, start: int, length: int) -> bytes:
    """``length`` bytes of object ``key`` from byte ``start`` (an S3 ranged GET, or a local pread)."""
    if length <= 0:
        return b""
    if hasattr(store, "read_range"):
        return store.read_range(key, start, length)
    if getattr(store, "client", None) is not None and store.url(key).startswith("s3://"):
        bucket, full = _s3_location(store, key)
        body = store.client.get_object(Bucket=bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")["Body"]
        return body.read()
    with open(store.local_path(key), "rb") as f:
        return os.pread(f.fileno(), length, start)


def store_download(store: Any, key: str, dest: Path) -> None:
    """Copy object ``key`` to the local file ``dest`` (an S3 download, or a file copy)."""
    if getattr(store, "client", None) is not None and store.url(key).startswith("s3://"):
        bucket, full = _s3_location(store, key)
        store.client.download_file(bucket, full, str(dest))
    else:
        shutil.copyfile(store.local_path(key), dest)


@dataclass
class CacheStats:
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    prefetched: int = 0       # downloads started before the reader asked for the part
    wait_s: float = 0.0       # time readers waited for a part to arrive
    peak_bytes: int = 0       # most bytes held (and reserved for downloads) at once

    def as_dict(self) -> dict[str, Any]:
        return {"downloads": self.downloads, "gb_downloaded": round(self.bytes_downloaded / 1e9, 3),
                "evictions": self.evictions, "prefetched": self.prefetched, "wait_s": round(self.wait_s, 2),
                "peak_gb": round(self.peak_bytes / 1e9, 3)}


class BoundedPartCache:
    """At most ``limit_bytes`` of store parts on local disk, fetched ahead of the reader, evicted behind it.

    ``keys``: every part the reader may ask for; ``sizes``: their byte sizes
    (from the manifests; looked up when missing). :meth:`set_schedule` gives
    the parts in the order the reader will need them (one entry per sample
    read) and :meth:`advance` the reader's position in it; without a schedule
    parts are fetched on demand and evicted least recently used. Raises
    :class:`PartTooLarge` when a part exceeds the limit.
    """

    def __init__(self, store: Any, keys: Sequence[str], limit_bytes: int, *,
                 sizes: Mapping[str, int | None] | None = None, cache_dir: str | os.PathLike | None = None,
                 lookahead: int = 1 << 16):
        self.store = store
        self.keys = list(dict.fromkeys(keys))
        self.limit = int(limit_bytes)
        self.sizes = {k: int((sizes or {}).get(k) or store.size(k)) for k in self.keys}
        too_big = [(k, n) for k, n in self.sizes.items() if n > self.limit]
        if too_big:
            k, n = max(too_big, key=lambda x: x[1])
            raise PartTooLarge(
                f"{len(too_big)} cache part(s) exceed the local cache limit of {self.limit / 1e9:.3f} GB; the largest, "
                f"{k}, is {n / 1e9:.3f} GB. Raise the recipe's cache_limit_gb above the largest part (twice it "
                f"lets the next part download while one is read), or recapture with a smaller max_part_bytes.")
        self._index = {k: i for i, k in enumerate(self.keys)}
        root = Path(cache_dir or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_scratch(root, "parts")
        self.dir = Path(tempfile.mkdtemp(prefix=scratch_prefix("parts"), dir=root))
        self.stats = CacheStats()
        self._local: dict[int, tuple[Path, Any]] = {}  # part -> (file, safe_open handle)
        self._last_use: dict[int, float] = {}
        self._pins: dict[int, int] = {}
        self._fetching: set[int] = set()
        self._used = 0  # bytes held plus bytes reserved for downloads in flight
        self._wanted: int | None = None
        self._error: BaseException | None = None
        self._schedule: np.ndarray | None = None
        self._uses: list[np.ndarray] = []
        self._pos = 0
        self.lookahead = lookahead
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._fetch_loop, name="part-cache-fetch", daemon=True)
        self._thread.start()

    # --- what the reader calls -------------------------------------------------------

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return store_read_range(self.store, key, start, length)

    def set_schedule(self, parts: Sequence[int] | np.ndarray) -> None:
        """The order in which the reader will need parts (indices into ``keys``, one per sample read)."""
        schedule = np.asarray(parts, dtype=np.int32)
        order = np.argsort(schedule, kind="stable")
        counts = np.bincount(schedule, minlength=len(self.keys))
        with self._cond:
            self._schedule = schedule
            self._uses = np.split(order, np.cumsum(counts)[:-1])  # per part: its positions, ascending
            self._pos = 0
            self._cond.notify_all()

    def advance(self, position: int) -> None:
        """The reader is at ``position`` in the schedule: later parts may be prefetched, earlier ones evicted."""
        with self._cond:
            if position != self._pos:
                self._pos = position
                self._cond.notify_all()

    def part_index(self, key: str) -> int:
        return self._index[key]

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Any]:
        """The part's ``safe_open`` handle, downloaded first if needed; the part is not evicted inside the ``with``."""
        p = self._index[key]
        t0 = time.perf_counter()
        waited = False
        with self._cond:
            while p not in self._local:
                if self._error is not None:
                    raise RuntimeError(f"fetching cache parts failed: {self._error}") from self._error
                if self._closed:
                    raise RuntimeError("the part cache is closed")
                self._wanted = p
                waited = True
                self._cond.notify_all()
                self._cond.wait(0.5)
            if self._wanted == p:
                self._wanted = None
            self._pins[p] = self._pins.get(p, 0) + 1
            self._last_use[p] = time.monotonic()
            handle = self._local[p][1]
        if waited:
            self.stats.wait_s += time.perf_counter() - t0
        try:
            yield handle
        finally:
            with self._cond:
                self._pins[p] -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:
            self._local.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the fetch thread ----------------------------------------------------------

    def _next_use(self, p: int) -> float:
        if self._schedule is None:
            return -self._last_use.get(p, 0.0)  # no plan: least recently used goes first
        uses = self._uses[p]
        i = int(np.searchsorted(uses, self._pos))
        return float(uses[i]) if i < len(uses) else float("inf")

    def _prefetch_candidate(self) -> int | None:
        """The first part the schedule needs from the reader's position on that is neither local nor fetching."""
        if self._schedule is None:
            return None
        seg = self._schedule[self._pos:self._pos + self.lookahead]
        if not len(seg):
            return None
        uniq, first = np.unique(seg, return_index=True)
        for p in uniq[np.argsort(first)].tolist():
            if p not in self._local and p not in self._fetching:
                return int(p)
        return None

    def _make_room(self, p: int, urgent: bool) -> bool:
        """Evict until part ``p`` fits; False when it cannot fit yet (the caller waits)."""
        need = self.sizes[self.keys[p]]
        while self._used + need > self.limit:
            victims = [q for q in self._local if self._pins.get(q, 0) == 0]
            if not victims:
                return False
            q = max(victims, key=self._next_use)
            if not urgent and self._next_use(q) <= self._next_use(p):
                return False  # everything held is needed before p: prefetch later
            path, _ = self._local.pop(q)
            path.unlink(missing_ok=True)
            self._used -= self.sizes[self.keys[q]]
            self.stats.evictions += 1
        return True

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    wanted = self._wanted if self._wanted is not None and self._wanted not in self._local \
                        and self._wanted not in self._fetching else None
                    p = wanted if wanted is not None else self._prefetch_candidate()
                    if p is not None and self._make_room(p, urgent=wanted is not None):
                        break
                    self._cond.wait(0.5)
                key = self.keys[p]
                self._fetching.add(p)
                self._used += self.sizes[key]
                self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)
                prefetch = wanted is None
            try:
                dest = self.dir / f"{p:06d}-{Path(key).name}"
                with atomic_path(dest, suffix=".part") as tmp:
                    store_download(self.store, key, tmp)
                    got = tmp.stat().st_size
                    if got != self.sizes[key]:
                        raise OSError(f"{key}: downloaded {got} bytes, the manifest says {self.sizes[key]}")
                from safetensors import safe_open

                handle = safe_open(str(dest), framework="pt")
            except BaseException as e:  # reported to the reader that waits for a part
                with self._cond:
                    self._fetching.discard(p)
                    self._used -= self.sizes[key]
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._fetching.discard(p)
                self._local[p] = (dest, handle)
                self._last_use[p] = time.monotonic()
                self.stats.downloads += 1
                self.stats.bytes_downloaded += self.sizes[key]
                self.stats.prefetched += int(prefetch)
                self._cond.notify_all()
