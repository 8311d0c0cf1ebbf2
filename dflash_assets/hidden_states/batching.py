"""Tokenized samples for capture and how they are grouped: forwards without padding, and files by size.

Reads tokenized samples (a pyarrow Table / polars DataFrame / list of dicts
with ``prompt_id``, ``input_ids``, ``loss_mask``, optionally ``num_tokens``)
and normalizes them to :class:`TokenizedSample`; plans forwards
(:func:`plan_batches`: packed rows in partition order, or equal-length rows
stacked) and part files (:func:`plan_parts`). Reads and writes no files.
Imports only numpy (a pyarrow Table is read by duck typing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TokenizedSample", "Batch", "load_samples", "plan_batches", "plan_parts"]


@dataclass(frozen=True)
class TokenizedSample:
    prompt_id: str
    input_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] uint8

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _list_column(table: Any, name: str, dtype: np.dtype) -> list[np.ndarray]:
    col = table.column(name)
    col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    values = col.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    lengths = col.value_lengths().to_numpy(zero_copy_only=False)
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []


def load_samples(data: Any) -> list[TokenizedSample]:
    """Normalize tokenized samples (pyarrow Table, polars DataFrame, or a list of dicts/samples).

    ``loss_mask`` may be uint8 or int8 (stored as uint8); ``num_tokens``, when
    present, must match ``len(input_ids)``.
    """
    if hasattr(data, "to_arrow") and not hasattr(data, "column_names"):  # polars
        data = data.to_arrow()
    if hasattr(data, "column_names") and hasattr(data, "column"):  # pyarrow Table / RecordBatch
        ids = _list_column(data, "input_ids", np.int32)
        masks = _list_column(data, "loss_mask", np.uint8) if "loss_mask" in data.column_names else [np.ones(len(x), np.uint8) for x in ids]
        pids = [str(p) for p in data.column("prompt_id").to_pylist()]
        counts = data.column("num_tokens").to_pylist() if "num_tokens" in data.column_names else None
        rows = [{"prompt_id": p, "input_ids": i, "loss_mask": m} for p, i, m in zip(pids, ids, masks)]
        if counts is not None:
            for r, c in zip(rows, counts):
                r["num_tokens"] = c
    else:
        rows = list(data)
    out = []
    for k, r in enumerate(rows):
        if isinstance(r, TokenizedSample):
            out.append(r)
            continue
        ids = np.asarray(r["input_ids"]).astype(np.int32, copy=False).reshape(-1)
        mask = np.asarray(r.get("loss_mask", np.ones(len(ids), np.uint8))).astype(np.uint8, copy=False).reshape(-1)
        if mask.shape != ids.shape:
            raise ValueError(f"sample {k}: loss_mask has {mask.shape[0]} tokens, input_ids {ids.shape[0]}")
        if r.get("num_tokens") is not None and int(r["num_tokens"]) != ids.shape[0]:
            raise ValueError(f"sample {k}: num_tokens={r['num_tokens']} but input_ids has {ids.shape[0]} tokens")
        if ids.shape[0] == 0:
            raise ValueError(f"sample {k} ({r.get('prompt_id')!r}) has no tokens")
        out.append(TokenizedSample(str(r["prompt_id"]), ids, mask))
    return out


@dataclass(frozen=True)
class Batch:
    """Samples run in one forward. ``packed``: one row, samples concatenated; else ``len(indices)`` rows of one length."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    packed: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def plan_batches(lengths: Sequence[int], tokens_per_batch: int, *, packed: bool = True) -> list[Batch]:
    """Group samples into forwards of at most ``tokens_per_batch`` tokens, with no padding.

    ``packed=True``: greedy in partition order, so each batch is a contiguous
    token range of the shard. ``packed=False``: only samples of identical
    length share a forward (stacked as rows). A sample longer than the budget
    runs alone.
    """
    if tokens_per_batch <= 0:
        raise ValueError("tokens_per_batch must be positive")
    batches: list[Batch] = []
    if packed:
        cur: list[int] = []
        total = 0
        for i, n in enumerate(lengths):
            if cur and total + n > tokens_per_batch:
                batches.append(Batch(tuple(cur), tuple(lengths[j] for j in cur), True))
                cur, total = [], 0
            cur.append(i)
            total += n
        if cur:
            batches.append(Batch(tuple(cur), tuple(lengths[j] for j in cur), True))
        return batches
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(int(n), []).append(i)
    for n, idx in groups.items():
        rows = max(1, tokens_per_batch // n)
        for a in range(0, len(idx), rows):
            chunk = tuple(idx[a:a + rows])
            batches.append(Batch(chunk, (n,) * len(chunk), False))
    return sorted(batches, key=lambda b: b.indices[0])


def plan_parts(lengths: Sequence[int], row_bytes: int, max_part_bytes: int) -> list[tuple[int, int]]:
    """Split samples (in order) into ``[start, stop)`` ranges whose hidden bytes stay under ``max_part_bytes``."""
    parts: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(lengths):
        b = n * row_bytes
        if i > start and size + b > max_part_bytes:
            parts.append((start, i))
            start, size = i, 0
        size += b
    parts.append((start, len(lengths)))
    return parts

