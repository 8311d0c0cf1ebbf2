"""Training data for the drafter: samples in step order, from the hidden-state cache or tokenized samples.

Reads hidden-state cache parts through the one cache reader
(:class:`~dflash_assets.hidden_states.format.HiddenStateCacheReader`: local
files, or a bounded local cache of store parts, see
:mod:`~dflash_assets.hidden_states.part_cache`), or, online, tokenized samples
from Parquet, streamed by row group (int32 ids, a few decoded row groups at a
time, never the corpus in memory). Picks anchors, plans which samples each
rank sees at each step (:class:`BatchPlan`, a pure function of seed, epoch and
step), and collates batches in a background thread (:class:`BatchLoader`):
packed by default, the blocks and context tokens of all samples one after
another, so that no sample is padded to the longest (:class:`Batch`).
Writes nothing. Imports numpy and torch (pyarrow lazily).
"""

from __future__ import annotations

import math
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.hidden_states.format import HiddenStateCacheReader

__all__ = ["Sample", "CacheSamples", "ParquetSamples", "open_training_data", "sample_anchors", "anchor_rng",
           "Batch", "collate", "BatchPlan", "BatchLoader"]


@dataclass
class Sample:
    input_ids: np.ndarray  # (T,) int64
    loss_mask: np.ndarray  # (T,) bool
    hidden: torch.Tensor | None  # (T, n*H) target features; None in online mode


def _num_anchor_positions(loss_mask: np.ndarray, block_size: int) -> int:
    return int(loss_mask[: max(len(loss_mask) - block_size + 1, 0)].sum())


class CacheSamples:
    """Training sequences from hidden-state cache parts (or tokenized samples in the cache layout).

    A view of the one cache reader: samples cut to ``max_length`` tokens, those
    without an anchor position dropped. ``source``: where part files are read
    (default local paths; a :class:`~dflash_assets.hidden_states.part_cache.BoundedPartCache`
    for store parts). ``groups`` / ``group_bytes``: the part of each sample
    and each part's size, for a plan that keeps reads local to a few parts.
    """

    def __init__(self, files: Sequence[str | Path], max_length: int, block_size: int, need_hidden: bool = True,
                 source: Any = None):
        self.reader = HiddenStateCacheReader(
            files, source, need_hidden=need_hidden, max_length=max_length,
            keep=lambda lm: _num_anchor_positions(lm, block_size) > 0)
        self.layer_ids = self.reader.layer_ids
        self.groups = self.reader.part_of
        self.group_bytes = np.asarray([p.nbytes for p in self.reader.parts], dtype=np.int64)
        self.group_keys = [p.key for p in self.reader.parts]

    def __len__(self) -> int:
        return len(self.reader)

    def advance(self, position: int) -> None:
        if hasattr(self.reader.source, "advance"):
            self.reader.source.advance(position)

    def __getitem__(self, i: int) -> Sample:
        s = self.reader[i]
        return Sample(s.input_ids.numpy().astype(np.int64), s.loss_mask.numpy().astype(bool), s.hidden)


class ParquetSamples:
    """Tokenized samples (online mode) from Parquet files with ``input_ids`` and ``loss_mask`` lists.

    Streams by row group: opening reads only the ``loss_mask`` column, one row
    group at a time, to index the samples that have an anchor position; a
    sample is read by decoding its row group (ids as int32, masks as uint8),
    and decoded row groups are kept up to ``max_bytes`` (least recently used
    go first). Memory is bounded by that, never by the corpus; the training
    plan shuffles within windows of row groups of half that size.
    """

    def __init__(self, files: Sequence[str | Path], max_length: int, block_size: int, max_bytes: int = 1 << 30):
        import pyarrow.parquet as pq

        self.files = [str(f) for f in files]
        self.max_length = max_length
        self.max_bytes = int(max_bytes)
        self.layer_ids = None
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        rg_ids, rows, sizes = [], [], []
        self._row_groups: list[tuple[int, int]] = []
        for fi, path in enumerate(self.files):
            pf = pq.ParquetFile(path)
            for rg in range(pf.metadata.num_row_groups):
                col = pf.read_row_group(rg, columns=["loss_mask"]).column("loss_mask").combine_chunks()
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy(zero_copy_only=False)
                g = len(self._row_groups)
                self._row_groups.append((fi, rg))
                sizes.append(self._decoded_bytes(int(offsets[-1]) - int(offsets[0]), len(offsets) - 1))
                for r in range(len(offsets) - 1):
                    a = int(offsets[r])
                    n = min(int(offsets[r + 1]) - a, max_length)
                    if _num_anchor_positions(values[a:a + n], block_size) > 0:
                        rg_ids.append(g), rows.append(r)
        self.groups = np.asarray(rg_ids, dtype=np.int32)  # per sample: its row group
        self._rows = np.asarray(rows, dtype=np.int64)
        self.group_bytes = np.asarray(sizes, dtype=np.int64)  # decoded size of each row group

    @staticmethod
    def _decoded_bytes(tokens: int, rows: int) -> int:
        return tokens * 5 + (rows + 1) * 16  # int32 ids + uint8 masks + two offset arrays

    def _row_group(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        import pyarrow.parquet as pq

        with self._lock:
            if g in self._cache:
                self._cache.move_to_end(g)
                return self._cache[g]
        fi, rg = self._row_groups[g]
        t = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=["input_ids", "loss_mask"])
        ids = t.column("input_ids").combine_chunks()
        lm = t.column("loss_mask").combine_chunks()
        entry = (ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False),
                 lm.offsets.to_numpy(), lm.values.to_numpy(zero_copy_only=False).astype(np.uint8, copy=False))
        with self._lock:
            if g not in self._cache:
                self._cache[g] = entry
                self._held += int(self.group_bytes[g])
            while self._held > self.max_bytes and len(self._cache) > 1:
                old, _ = self._cache.popitem(last=False)
                self._held -= int(self.group_bytes[old])
        return entry

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> Sample:
        id_off, ids, lm_off, lm = self._row_group(int(self.groups[i]))
        r = int(self._rows[i])
        a, b = int(id_off[r]), min(int(id_off[r + 1]), int(id_off[r]) + self.max_length)
        c = int(lm_off[r])
        return Sample(ids[a:b].astype(np.int64), lm[c:c + b - a].astype(bool), None)


def open_training_data(files: Sequence[str | Path], recipe: DrafterRecipe, source: Any = None):
    """The recipe's training sequences: Parquet samples online, else cache parts (through ``source``)."""
    files = [str(f) for f in files]
    if recipe.online and all(f.endswith(".parquet") for f in files):
        limit = int(recipe.cache_limit_gb * 1e9) if recipe.cache_limit_gb else 1 << 30
        return ParquetSamples(files, recipe.max_length, recipe.block_size, max_bytes=limit)
    return CacheSamples(files, recipe.max_length, recipe.block_size, need_hidden=not recipe.online, source=source)


# ----------------------------------------------------------------------------------------------
# Anchors, blocks, masks


def sample_anchors(loss_mask: np.ndarray, block_size: int, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted random anchors: loss_mask = 1 and position <= len - block_size, at most max_anchors."""
    valid = np.flatnonzero(loss_mask[: max(len(loss_mask) - block_size + 1, 0)])
    n = min(max_anchors, len(valid))
    return np.sort(rng.choice(valid, size=n, replace=False))


def anchor_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Anchors depend only on (seed, epoch, sample): same run whatever the rank layout or resume."""
    return np.random.default_rng([seed, epoch, index])


@dataclass
class Batch:
    """A training batch in one of two layouts.

    Padded (one row per sample): ``hidden`` (b, S, n*H), ``anchors``/``keep`` (b, N), each row padded to the
    batch's longest sample and largest anchor count. Packed (``packed``): the blocks of all samples in one row,
    ``anchors``/``keep``/``block_sample`` (1, nb), and the samples' context tokens one after another,
    ``hidden`` (1, Sc, n*H) with ``ctx_index`` (1, Sc) naming each slot's sample row and position; padding only
    at the ends, up to a width of the totals. ``input_ids``/``loss_mask`` are (b, S) rows in both layouts."""

    input_ids: torch.Tensor  # (b, S) int64
    loss_mask: torch.Tensor  # (b, S) bool
    hidden: torch.Tensor | None  # padded (b, S, n*H); packed (1, Sc, n*H); None in online mode
    anchors: torch.Tensor  # (b, N) int64 sorted per row, or packed (1, nb) positions in their samples; 0 where not kept
    keep: torch.Tensor  # (b, N) or (1, nb) bool, False for padding blocks
    num_tokens: int  # real sequence tokens in the batch
    block_sample: torch.Tensor | None = None  # packed: (1, nb) int64, the sample row of each block (0 for padding)
    ctx_start: torch.Tensor | None = None  # packed: (b,) int64, where each sample's context starts in the row
    ctx_index: torch.Tensor | None = None  # packed: (1, Sc) int64, sample * S + position of each slot (0: padding)

    @property
    def packed(self) -> bool:
        return self.block_sample is not None

    @property
    def block_slots(self) -> int:
        """Blocks computed, padding included (real ones: ``keep.sum()``)."""
        return self.anchors.numel()

    @property
    def shapes(self) -> tuple:
        """The shapes the step's kernels see (a compiled step compiles once per distinct value)."""
        return tuple(tuple(t.shape) for t in (self.input_ids, self.anchors, self.ctx_index) if t is not None)

    @property
    def context_slots(self) -> int:
        """Context tokens the drafter computes, padding included (real ones: ``num_tokens``)."""
        return self.ctx_index.shape[1] if self.packed else self.input_ids.numel()

    def pack_context(self, features: torch.Tensor) -> torch.Tensor:
        """Per-sample rows (b, S, F) -> this batch's context layout: packed (1, Sc, F), else unchanged."""
        if not self.packed:
            return features
        return features.reshape(-1, features.shape[-1]).index_select(0, self.ctx_index[0])[None]

    def to(self, device, non_blocking: bool = True) -> "Batch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(mv(self.input_ids), mv(self.loss_mask), mv(self.hidden), mv(self.anchors), mv(self.keep),
                     self.num_tokens, mv(self.block_sample), mv(self.ctx_start), mv(self.ctx_index))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def bucket_width(n: int, multiple: int = 1, steps: int = 2) -> int:
    """The padded width for `n`: the smallest of multiple x {1, 2, 3, 4, 6, 8, 12, 16, ...} (powers of two and
    1.5 x powers of two) that holds it. Batches then come in a few widths (about two per doubling), so a
    compiled step is reused instead of recompiled for every new width, at most 1.5x of padding past `multiple`.
    `steps` widths per doubling (a power of two): 4 gives {.., 8, 10, 12, 14, 16, 20, ..}, at most 1.25x."""
    units = max(1, -(-int(n) // multiple))
    width = 1
    while width < units:
        power = 1 << (width.bit_length() - 1)  # the largest power of two <= width
        width += max(1, power // steps)
    return width * multiple


# Widths per doubling of a packed batch's totals. A total over many samples varies little from step to step (a
# relative spread of about the samples' own over sqrt(batch)), so few widths appear. Blocks: 4 per doubling, at most
# a quarter of them padding (a tenth on average); they carry nearly all the FLOPs. Context tokens: powers of two,
# each costs only its keys/values and the features' projection (under 1% of a step's FLOPs at SmolLM2 shapes), so
# fewer widths (fewer compiled shapes) are worth more than their padding. Simulated at batch 48 with long-tailed
# chat lengths (mean ~390 tokens, 2,048 at most), 2,000 steps met 8 (context, blocks) widths, 9% of blocks padding.
PACKED_BLOCK_WIDTHS_PER_DOUBLING = 4
PACKED_CONTEXT_WIDTHS_PER_DOUBLING = 1


def collate(samples: list[Sample], anchors: list[np.ndarray], seq_multiple: int = 1,
            anchor_multiple: int = 1, pin: bool = False, bucket: bool = False, packed: bool = False) -> Batch:
    """Pad sequences (right) and anchor lists into a batch; padding never enters the loss. With `bucket`, the
    widths are rounded up to `bucket_width`'s few sizes (compiled graphs are reused across batches). With
    `packed`, the blocks and the context tokens of all samples go one after another in one row (`Batch`), padded
    only at the end, to a width of the totals (with `bucket`, `PACKED_BLOCK_WIDTHS_PER_DOUBLING` and
    `PACKED_CONTEXT_WIDTHS_PER_DOUBLING` widths per doubling)."""
    b = len(samples)
    width = bucket_width if bucket else _round_up
    S = width(max(len(s.input_ids) for s in samples), seq_multiple)
    ids = torch.zeros(b, S, dtype=torch.long)
    lm = torch.zeros(b, S, dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, : len(s.input_ids)] = torch.from_numpy(s.input_ids)
        lm[i, : len(s.input_ids)] = torch.from_numpy(s.loss_mask)
    num_tokens = sum(len(s.input_ids) for s in samples)
    if packed:
        return _collate_packed(samples, anchors, ids, lm, num_tokens, seq_multiple, anchor_multiple, pin, bucket)
    N = width(max(len(a) for a in anchors), anchor_multiple)
    anc = torch.zeros(b, N, dtype=torch.long)
    keep = torch.zeros(b, N, dtype=torch.bool)
    hidden = None
    if samples[0].hidden is not None:
        h0 = samples[0].hidden
        hidden = torch.zeros(b, S, h0.shape[-1], dtype=h0.dtype, pin_memory=pin)
    for i, (s, a) in enumerate(zip(samples, anchors)):
        anc[i, : len(a)] = torch.from_numpy(a.astype(np.int64))
        keep[i, : len(a)] = True
        if hidden is not None:
            hidden[i, : len(s.input_ids)] = s.hidden
    if pin:
        ids, lm, anc, keep = ids.pin_memory(), lm.pin_memory(), anc.pin_memory(), keep.pin_memory()
    return Batch(ids, lm, hidden, anc, keep, num_tokens)


def _collate_packed(samples, anchors, ids, lm, num_tokens: int, seq_multiple: int, anchor_multiple: int, pin: bool,
                    bucket: bool) -> Batch:
    """The packed layout of `collate`: blocks (1, nb) and context slots (1, Sc), sample after sample."""
    S = ids.shape[1]
    lengths = [len(s.input_ids) for s in samples]
    counts = [len(a) for a in anchors]
    if bucket:
        Sc = bucket_width(num_tokens, seq_multiple, PACKED_CONTEXT_WIDTHS_PER_DOUBLING)
        nb = bucket_width(sum(counts), anchor_multiple, PACKED_BLOCK_WIDTHS_PER_DOUBLING)
    else:
        Sc, nb = _round_up(num_tokens, seq_multiple), _round_up(max(sum(counts), 1), anchor_multiple)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ctx_index = torch.zeros(1, Sc, dtype=torch.long)
    ctx_index[0, :num_tokens] = torch.from_numpy(np.concatenate(
        [i * S + np.arange(T, dtype=np.int64) for i, T in enumerate(lengths)]))
    real = sum(counts)
    anc = torch.zeros(1, nb, dtype=torch.long)
    anc[0, :real] = torch.from_numpy(np.concatenate([a.astype(np.int64) for a in anchors]))
    keep = torch.zeros(1, nb, dtype=torch.bool)
    keep[0, :real] = True
    block_sample = torch.zeros(1, nb, dtype=torch.long)
    block_sample[0, :real] = torch.from_numpy(np.repeat(np.arange(len(samples), dtype=np.int64), counts))
    hidden = None
    if samples[0].hidden is not None:
        h0 = samples[0].hidden
        hidden = torch.zeros(1, Sc, h0.shape[-1], dtype=h0.dtype, pin_memory=pin)
        for s, start, T in zip(samples, starts.tolist(), lengths):
            hidden[0, start:start + T] = s.hidden
    ctx_start = torch.from_numpy(starts)
    if pin:
        ids, lm, anc, keep = ids.pin_memory(), lm.pin_memory(), anc.pin_memory(), keep.pin_memory()
        block_sample, ctx_start, ctx_index = block_sample.pin_memory(), ctx_start.pin_memory(), ctx_index.pin_memory()
    return Batch(ids, lm, hidden, anc, keep, num_tokens, block_sample, ctx_start, ctx_index)


# ----------------------------------------------------------------------------------------------
# Batches in step order (a background thread reads ahead)


class BatchPlan:
    """Which samples each rank sees at each step: a pure function of (seed, epoch, step, rank).

    Each epoch is a permutation of the samples. With ``groups`` (the part or
    row group of each sample), ``group_bytes`` and ``window_bytes``, and more
    data than one window, the permutation keeps reads local: the groups are
    shuffled, cut into windows of at most ``window_bytes`` (one group at
    least), and the samples are shuffled within each window; a bounded cache
    then holds the current window while it fetches the next.
    """

    def __init__(self, n: int, recipe: DrafterRecipe, world: int, rank: int, *, groups: np.ndarray | None = None,
                 group_bytes: np.ndarray | None = None, window_bytes: int | None = None):
        self.n, self.recipe, self.world, self.rank = n, recipe, world, rank
        self.global_batch = recipe.batch_size * world
        self.steps_per_epoch = math.ceil(n / self.global_batch)
        self.total_steps = self.steps_per_epoch * recipe.epochs
        self._perm: tuple[int, np.ndarray] | None = None
        self.windowed = (groups is not None and group_bytes is not None and window_bytes is not None
                         and int(np.sum(group_bytes)) > window_bytes)
        if self.windowed:
            self._group_bytes = np.asarray(group_bytes, dtype=np.int64)
            order = np.argsort(groups, kind="stable")
            counts = np.bincount(groups, minlength=len(self._group_bytes))
            self._members = np.split(order, np.cumsum(counts)[:-1])  # per group: its samples, ascending
            self._window_bytes = int(window_bytes)

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.recipe.seed, epoch, 7])
            if not self.windowed:
                perm = rng.permutation(self.n)
            else:
                windows, cur, size = [], [], 0
                for g in rng.permutation(len(self._group_bytes)).tolist():
                    if cur and size + self._group_bytes[g] > self._window_bytes:
                        windows.append(cur)
                        cur, size = [], 0
                    cur.append(g)
                    size += int(self._group_bytes[g])
                windows.append(cur)
                perm = np.concatenate([rng.permutation(np.concatenate([self._members[g] for g in w]))
                                       for w in windows]).astype(np.int64)
            self._perm = (epoch, perm)
        return self._perm[1]

    def indices(self, step: int) -> tuple[int, list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)
        start = i * self.global_batch + self.rank * self.recipe.batch_size
        # the last global batch of an epoch wraps around so that every rank always has a full batch
        return epoch, [int(perm[(start + j) % self.n]) for j in range(self.recipe.batch_size)]

    def sample_order(self, start_step: int, stop_step: int) -> np.ndarray:
        """This rank's samples from ``start_step`` to ``stop_step``, in the order it reads them."""
        b, out = self.recipe.batch_size, []
        for epoch in range(start_step // self.steps_per_epoch, -(-stop_step // self.steps_per_epoch)):
            first = max(start_step, epoch * self.steps_per_epoch) - epoch * self.steps_per_epoch
            last = min(stop_step, (epoch + 1) * self.steps_per_epoch) - epoch * self.steps_per_epoch
            steps = np.arange(first, last, dtype=np.int64)
            idx = (steps[:, None] * self.global_batch + self.rank * b + np.arange(b)[None, :]) % self.n
            out.append(self.permutation(epoch)[idx].ravel())
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class BatchLoader:
    """Collates the plan's batches in a background thread, ``depth`` steps ahead of training, in the packed
    layout (`Batch`; ``packed=False``: one padded row per sample)."""

    def __init__(self, data, plan: BatchPlan, start_step: int, stop_step: int, cuda: bool, depth: int = 2,
                 packed: bool = True):
        self.data, self.plan, self.cuda, self.packed = data, plan, cuda, packed
        self.start = start_step
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.closed = False
        self.thread = threading.Thread(target=self._run, args=(start_step, stop_step), daemon=True)
        self.thread.start()

    def _make(self, step: int) -> Batch:
        r = self.plan.recipe
        epoch, idx = self.plan.indices(step)
        samples = []
        for j, i in enumerate(idx):
            if hasattr(self.data, "advance"):  # where the reader is in the plan: a bounded cache prefetches from here
                self.data.advance((step - self.start) * r.batch_size + j)
            samples.append(self.data[i])
        anchors = [sample_anchors(s.loss_mask, r.block_size, r.max_anchors, anchor_rng(r.seed, epoch, i))
                   for s, i in zip(samples, idx)]
        # flex tiles are 128 wide: pad the context and the blocks (N*B) to multiples of 128 on GPU
        # compiled: widths bucketed, so the compiled layers see a few shapes and are not recompiled every step
        return collate(samples, anchors, seq_multiple=128 if self.cuda else 1,
                       anchor_multiple=max(1, 128 // r.block_size) if self.cuda else 1, pin=self.cuda,
                       bucket=self.cuda and r.compile, packed=self.packed)

    def _run(self, start: int, stop: int):
        try:
            for step in range(start, stop):
                if self.closed:
                    return
                self.q.put((step, self._make(step)))
        except BaseException as e:  # surface loader errors in the training thread
            self.q.put((None, e))

    def close(self) -> None:
        """Stop reading ahead (training ended before the planned last step: a time budget cut it)."""
        self.closed = True
        while self.thread.is_alive():
            try:
                self.q.get(timeout=0.1)  # unblock a pending put
            except queue.Empty:
                pass

    def next(self) -> tuple[int, Batch]:
        step, batch = self.q.get()
        if step is None:
            raise batch
        return step, batch

