"""On-disk format of the hidden-state cache: safetensors shards, their header, readers and budgets.

One partition of ``tokenized_samples`` becomes one safetensors file, or several
"parts" when it would exceed a size limit. Each file holds

- ``hidden``      [total_tokens, n_layers * H]  target dtype (bf16 on GPU): the
  outputs of the captured decoder layers, concatenated along the last axis in
  the order of ``layer_ids``;
- ``input_ids``   [total_tokens] int32;
- ``loss_mask``   [total_tokens] uint8;
- ``cu_seqlens``  [num_samples + 1] int64: sample ``i`` is rows
  ``cu_seqlens[i]:cu_seqlens[i+1]`` of the three tensors above;

and a string-valued ``__metadata__`` header (see :class:`ShardMetadata`): the
target model id, layer ids (JSON), dtype, hidden size, tokenizer hash, the
upstream partition's data version, the samples' ``prompt_id`` values (JSON),
and where this part sits in its partition. No pickle anywhere.

Writes: :class:`SafetensorsStreamWriter` writes a valid safetensors header for
shapes known in advance (token counts are known from the tokenized samples
before any GPU work), pre-sizes the file, then fills tensor data in chunks at
their offsets (in order, or at explicit rows from several threads), so a
partition never has to sit in RAM. It writes a local file; callers publish it
atomically through the store (``Store.upload_file`` / ``staged_file``).

Reads: :class:`HiddenStateShard` memory-maps a file with safetensors'
``safe_open`` and returns one sample's rows through ``get_slice`` without
loading the file; :class:`HiddenStateCacheReader` spans part files (one
partition or many; the drafter's training reads through it), opening each by
ranged reads of its header and offsets and reading samples through a source
(local files, or a bounded cache of store parts).

Budgets: :func:`bytes_per_token`, :func:`estimate_partition_bytes`,
:func:`projected_corpus_bytes` and :func:`check_budget`, which raises
:class:`StorageBudgetExceeded` before any compute is spent.

Imports only numpy, torch and safetensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT_NAME",
    "StorageBudgetExceeded",
    "ShardMetadata",
    "TensorSpec",
    "SafetensorsStreamWriter",
    "HiddenStateShard",
    "HiddenStateCacheReader",
    "LocalFiles",
    "PartIndex",
    "read_header",
    "read_small_tensor",
    "SampleStates",
    "shard_tensor_specs",
    "dtype_size",
    "bytes_per_token",
    "estimate_partition_bytes",
    "partition_gb",
    "projected_corpus_bytes",
    "check_budget",
    "part_file_name",
    "torch_dtype",
    "start_writeback",
]

FORMAT_NAME = "dflash-hidden-states/v1"

# safetensors dtype tags for the dtypes this format uses.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}


class StorageBudgetExceeded(RuntimeError):
    """Raised before compute when writing a partition would exceed the configured storage budget."""


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).removeprefix("torch.").lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: str | torch.dtype) -> int:
    """Bytes per element: ``dtype_size("bfloat16") == 2``."""
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


# ---------------------------------------------------------------------------
# Budget
# ---------------------------------------------------------------------------


def bytes_per_token(n_layers: int, hidden_size: int, dtype: str | torch.dtype = "bfloat16") -> int:
    """Hidden-state bytes per token: ``n_layers * hidden_size * dtype_size``.

    Qwen3.6-27B, 5 layers, bf16: ``5 * 5120 * 2 = 51,200``; Qwen3-8B: 40,960.
    """
    return n_layers * hidden_size * dtype_size(dtype)


def estimate_partition_bytes(num_tokens: int, num_samples: int, n_layers: int, hidden_size: int,
                             dtype: str | torch.dtype = "bfloat16", *, num_parts: int = 1) -> int:
    """Bytes the partition's files will take: hidden states + ids + masks + offsets + headers.

    The header estimate is generous (prompt ids as JSON, 4 KiB of other fields per part).
    """
    per_token = bytes_per_token(n_layers, hidden_size, dtype) + 4 + 1  # hidden + int32 id + uint8 mask
    offsets = 8 * (num_samples + num_parts)
    headers = num_parts * 4096 + num_samples * 80
    return num_tokens * per_token + offsets + headers


def partition_gb(num_tokens: int, num_samples: int, n_layers: int, hidden_size: int,
                 dtype: str | torch.dtype = "bfloat16") -> float:
    """:func:`estimate_partition_bytes` in GB (1e9 bytes), for Dagster metadata."""
    return estimate_partition_bytes(num_tokens, num_samples, n_layers, hidden_size, dtype) / 1e9


def projected_corpus_bytes(num_samples: int, mean_tokens_per_sample: float, n_layers: int, hidden_size: int,
                           dtype: str | torch.dtype = "bfloat16") -> int:
    """Projected hidden-state bytes of the whole corpus (hidden tensor only, the part that matters).

    914K samples x 3K tokens x 51,200 B (Qwen3.6-27B) = ~140 TB.
    """
    return int(round(num_samples * mean_tokens_per_sample * bytes_per_token(n_layers, hidden_size, dtype)))


def check_budget(needed_bytes: int, budget_bytes: int | None, *, used_bytes: int = 0, what: str = "hidden-state cache",
                 free_bytes: int | None = None, free_what: str = "scratch disk") -> None:
    """Raise :class:`StorageBudgetExceeded` when ``used + needed > budget`` or ``needed > free``.

    ``budget_bytes=None`` means no configured budget (only the free-space check applies).
    """
    if budget_bytes is not None and used_bytes + needed_bytes > budget_bytes:
        raise StorageBudgetExceeded(
            f"{what}: writing {needed_bytes / 1e9:.3f} GB on top of {used_bytes / 1e9:.3f} GB already used "
            f"would exceed the budget of {budget_bytes / 1e9:.3f} GB "
            f"(short by {(used_bytes + needed_bytes - budget_bytes) / 1e9:.3f} GB). "
            "Raise the budget, capture fewer layers, or shrink the partition."
        )
    if free_bytes is not None and needed_bytes > free_bytes:
        raise StorageBudgetExceeded(
            f"{what}: needs {needed_bytes / 1e9:.3f} GB but the {free_what} has only {free_bytes / 1e9:.3f} GB free."
        )


# ---------------------------------------------------------------------------
# Header metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardMetadata:
    """The ``__metadata__`` of one shard file. Stored as strings; parsed back by :meth:`from_header`."""

    target_model: str
    layer_ids: tuple[int, ...]
    dtype: str
    hidden_size: int
    tokenizer_hash: str = ""
    upstream_data_version: str = ""
    prompt_ids: tuple[str, ...] = ()
    part_index: int = 0
    num_parts: int = 1
    sample_start: int = 0  # index, within the partition, of this part's first sample
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    def to_header(self) -> dict[str, str]:
        header = {str(k): str(v) for k, v in self.extra.items()}
        header.update({
            "format": FORMAT_NAME,
            "target_model": self.target_model,
            "layer_ids": json.dumps(list(self.layer_ids)),
            "dtype": _dtype_name(torch_dtype(self.dtype)),
            "hidden_size": str(self.hidden_size),
            "tokenizer_hash": self.tokenizer_hash,
            "upstream_data_version": self.upstream_data_version,
            "prompt_ids": json.dumps(list(self.prompt_ids)),
            "num_samples": str(len(self.prompt_ids)),
            "part_index": str(self.part_index),
            "num_parts": str(self.num_parts),
            "sample_start": str(self.sample_start),
        })
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, str]) -> ShardMetadata:
        if header.get("format") != FORMAT_NAME:
            raise ValueError(f"not a hidden-state shard: format={header.get('format')!r}, expected {FORMAT_NAME!r}")
        known = {"format", "target_model", "layer_ids", "dtype", "hidden_size", "tokenizer_hash",
                 "upstream_data_version", "prompt_ids", "num_samples", "part_index", "num_parts", "sample_start"}
        return cls(
            target_model=header["target_model"],
            layer_ids=tuple(json.loads(header["layer_ids"])),
            dtype=header["dtype"],
            hidden_size=int(header["hidden_size"]),
            tokenizer_hash=header.get("tokenizer_hash", ""),
            upstream_data_version=header.get("upstream_data_version", ""),
            prompt_ids=tuple(json.loads(header.get("prompt_ids", "[]"))),
            part_index=int(header.get("part_index", 0)),
            num_parts=int(header.get("num_parts", 1)),
            sample_start=int(header.get("sample_start", 0)),
            extra={k: v for k, v in header.items() if k not in known},
        )


def part_file_name(stem: str, part_index: int, num_parts: int) -> str:
    """``stem.safetensors`` for a single part, else ``stem-00001-of-00003.safetensors`` (1-based, like HF)."""
    if num_parts == 1:
        return f"{stem}.safetensors"
    return f"{stem}-{part_index + 1:05d}-of-{num_parts:05d}.safetensors"


# ---------------------------------------------------------------------------
# Streaming writer
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * dtype_size(self.dtype) if self.shape else dtype_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtype_size(self.dtype)


def shard_tensor_specs(num_tokens: int, num_samples: int, n_layers: int, hidden_size: int,
                       dtype: str | torch.dtype) -> dict[str, TensorSpec]:
    """The four tensors of one shard file."""
    return {
        "hidden": TensorSpec(torch_dtype(dtype), (num_tokens, n_layers * hidden_size)),
        "input_ids": TensorSpec(torch.int32, (num_tokens,)),
        "loss_mask": TensorSpec(torch.uint8, (num_tokens,)),
        "cu_seqlens": TensorSpec(torch.int64, (num_samples + 1,)),
    }


def _as_bytes_view(data: Any, dtype: torch.dtype) -> memoryview:
    """A zero-copy byte view of a CPU tensor / numpy array of ``dtype`` (C-contiguous)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError("SafetensorsStreamWriter.write takes CPU data; copy device tensors first")
        if data.dtype != dtype:
            raise TypeError(f"expected {dtype}, got {data.dtype}")
        data = data.contiguous()
        arr = data.view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    else:
        arr = np.ascontiguousarray(data)
        expected = torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else None
        if expected is None or arr.dtype != expected:
            raise TypeError(f"expected numpy {expected} for {dtype}, got {arr.dtype}")
    return memoryview(arr).cast("B")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)  # Linux writes at most ~2 GiB per call
        view, offset = view[n:], offset + n


def _load_sync_file_range() -> Any:
    """libc ``sync_file_range`` (Linux), or None."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range, don't wait


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` to disk now (Linux); False if unsupported.

    Without it, pages sit dirty in the page cache until the final fsync, which
    then stalls for the whole backlog; with it, the disk works while the GPU does.
    """
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


class SafetensorsStreamWriter:
    """Write a safetensors file whose tensor shapes are known up front, without holding the data in RAM.

    The header (shapes, dtypes, offsets, metadata) is written first; data then
    goes in by chunks: ``write(name, chunk)`` appends at that tensor's cursor,
    ``write(name, chunk, row=r)`` writes at row ``r`` (thread-safe, for several
    workers filling disjoint rows). ``close()`` checks every byte was written
    exactly once, optionally fsyncs, and leaves a file ``safe_open`` reads.
    Tensors are laid out by element size (largest first) so each is aligned.
    On an exception inside ``with`` the partial file is removed.
    """

    def __init__(self, path: str | os.PathLike, tensors: Mapping[str, TensorSpec],
                 metadata: Mapping[str, str] | None = None, *, fsync: bool = True, writeback: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self.writeback = writeback  # start disk writeback after each write (see start_writeback)
        order = sorted(tensors, key=lambda n: (-dtype_size(tensors[n].dtype), n))
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._offsets: dict[str, int] = {}
        self.specs = dict(tensors)
        pos = 0
        for name in order:
            spec = tensors[name]
            header[name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [pos, pos + spec.nbytes]}
            self._offsets[name] = pos
            pos += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(len(blob) + 8) % 8)  # pad so the data starts 8-byte aligned
        self.data_start = 8 + len(blob)
        self.total_bytes = self.data_start + pos
        self._cursor = {name: 0 for name in tensors}  # bytes appended so far (sequential mode)
        self._written = {name: 0 for name in tensors}  # bytes written in total
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.total_bytes)  # sparse until filled
        _pwrite_all(self._fd, memoryview(struct.pack("<Q", len(blob)) + blob), 0)

    def write(self, name: str, data: torch.Tensor | np.ndarray, *, row: int | None = None) -> None:
        """Write ``data`` (rows of tensor ``name``) at its cursor, or at ``row`` when given."""
        if self._fd is None:
            raise ValueError("writer is closed")
        spec = self.specs[name]
        view = _as_bytes_view(data, spec.dtype)
        if len(view) % spec.row_bytes:
            raise ValueError(f"{name}: {len(view)} bytes is not a whole number of rows of {spec.row_bytes} B")
        with self._lock:
            start = self._cursor[name] if row is None else row * spec.row_bytes
            if start + len(view) > spec.nbytes:
                raise ValueError(f"{name}: writing {len(view)} B at byte {start} overflows {spec.nbytes} B")
            if row is None:
                self._cursor[name] += len(view)
            self._written[name] += len(view)
        offset = self.data_start + self._offsets[name] + start
        _pwrite_all(self._fd, view, offset)
        if self.writeback and len(view) >= 1 << 20:
            self.writeback = start_writeback(self._fd, offset, len(view))

    def missing(self) -> dict[str, int]:
        """Bytes still to write per tensor (0 when complete)."""
        return {n: self.specs[n].nbytes - self._written[n] for n in self.specs if self._written[n] != self.specs[n].nbytes}

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if missing := self.missing():
                raise ValueError(f"{self.path.name}: tensors not fully written (bytes short/over): {missing}")
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


# ---------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleStates:
    """One sample's rows: ``hidden`` [n, n_layers*H] (None when not read), ``input_ids`` [n] int32, ``loss_mask`` [n] uint8."""

    prompt_id: str
    hidden: torch.Tensor | None
    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    def layer(self, j: int, hidden_size: int) -> torch.Tensor:
        """Hidden states of the ``j``-th captured layer (position in ``layer_ids``): [n, H]."""
        if self.hidden is None:
            raise ValueError("this sample was read without its hidden states")
        return self.hidden[:, j * hidden_size:(j + 1) * hidden_size]


class HiddenStateShard:
    """Memory-mapped reader of one shard file; ``shard[i]`` loads only sample ``i``'s rows."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        self.meta = ShardMetadata.from_header(self._file.metadata() or {})
        self.cu_seqlens = self._file.get_tensor("cu_seqlens")  # small: num_samples + 1
        self._hidden = self._file.get_slice("hidden")
        self._ids = self._file.get_slice("input_ids")
        self._mask = self._file.get_slice("loss_mask")

    def __len__(self) -> int:
        return len(self.meta.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def span(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.path.name}")
        return int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])

    def hidden(self, i: int) -> torch.Tensor:
        a, b = self.span(i)
        return self._hidden[a:b]

    def __getitem__(self, i: int) -> SampleStates:
        a, b = self.span(i)
        return SampleStates(self.meta.prompt_ids[i], self._hidden[a:b], self._ids[a:b], self._mask[a:b])

    def close(self) -> None:
        self._file.__exit__(None, None, None)

    def __enter__(self) -> HiddenStateShard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NP_DTYPES = {"I64": np.int64, "I32": np.int32, "U8": np.uint8, "I8": np.int8, "I16": np.int16,
              "F32": np.float32, "F64": np.float64, "F16": np.float16, "BOOL": np.bool_}
_MAX_HEADER_BYTES = 1 << 30


def read_header(read_range: Callable[[int, int], bytes]) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset where its data starts, from two ranged reads."""
    head = read_range(0, 8)
    if len(head) != 8:
        raise ValueError("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER_BYTES:
        raise ValueError(f"not a safetensors file: header length {n}")
    return json.loads(read_range(8, n)), 8 + n


def read_small_tensor(read_range: Callable[[int, int], bytes], header: Mapping[str, Any], data_start: int,
                      name: str) -> np.ndarray:
    """One (small) tensor of a safetensors file as numpy, through one ranged read (``cu_seqlens``, ``loss_mask``)."""
    info = header[name]
    a, b = info["data_offsets"]
    return np.frombuffer(read_range(data_start + a, b - a), dtype=_NP_DTYPES[info["dtype"]]).reshape(info["shape"])


class LocalFiles:
    """Part files on a local disk, keys being paths; keeps up to ``max_open`` ``safe_open`` handles (LRU).

    The source :class:`HiddenStateCacheReader` reads through by default. A bounded
    cache of parts fetched from a store has the same three methods
    (``read_range``, ``reading``, ``close``).
    """

    def __init__(self, max_open: int = 16):
        self.max_open = max_open
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        with open(key, "rb") as f:
            return os.pread(f.fileno(), length, start)

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Any]:
        """The file's ``safe_open`` handle, for slices copied out within the ``with``."""
        from safetensors import safe_open

        with self._lock:
            h = self._handles.get(key)
            if h is None:
                h = self._handles[key] = safe_open(str(key), framework="pt")
                while len(self._handles) > self.max_open:
                    self._handles.popitem(last=False)
            else:
                self._handles.move_to_end(key)
        yield h

    def close(self) -> None:
        with self._lock:
            self._handles.clear()


@dataclass(frozen=True)
class PartIndex:
    """What a reader keeps of one part file: its metadata, sample offsets and size (no tensor data)."""

    key: str
    meta: ShardMetadata
    cu_seqlens: np.ndarray  # int64 [num_samples + 1]
    nbytes: int  # the file's size

    @property
    def num_samples(self) -> int:
        return len(self.cu_seqlens) - 1


class HiddenStateCacheReader:
    """Samples of hidden-state cache part files, one partition or many, as one sequence (global index).

    ``keys``: the part files in order (local paths, or store keys with a
    ``source``): a partition's parts in part order, partitions one after the
    other; each partition must be complete (its parts tile its samples).
    Opening reads only each part's header, ``cu_seqlens`` (and ``loss_mask``
    when ``keep`` is given), by ranged reads; samples are read on access, by
    slices, through ``source`` (default: :class:`LocalFiles`; training passes
    a bounded cache of store parts). ``max_length`` cuts samples to their
    first tokens; ``keep(loss_mask)`` (of the cut sample) drops samples it
    returns False for. ``need_hidden=False`` reads only ids and masks
    (tokenized samples in the cache layout). This is the one reader of the
    cache: the drafter's training reads through it too.
    """

    def __init__(self, keys: Sequence[str | os.PathLike], source: Any = None, *, need_hidden: bool = True,
                 max_length: int | None = None, keep: Callable[[np.ndarray], bool] | None = None):
        self.source = source if source is not None else LocalFiles()
        self.need_hidden = need_hidden
        self.parts: list[PartIndex] = []
        part_of, starts, lengths, within = [], [], [], []
        prev: ShardMetadata | None = None
        for p, key in enumerate(str(k) for k in keys):
            rr = functools.partial(self.source.read_range, key)
            header, data_start = read_header(rr)
            meta = ShardMetadata.from_header(header.get("__metadata__") or {})
            expected = 0 if meta.part_index == 0 else (prev.sample_start + len(prev.prompt_ids) if prev else -1)
            if (meta.part_index and (prev is None or prev.part_index != meta.part_index - 1
                                     or prev.num_parts != meta.num_parts)) or meta.sample_start != expected:
                raise ValueError(f"parts do not tile the partition: {Path(key).name} is part {meta.part_index + 1} "
                                 f"of {meta.num_parts} starting at sample {meta.sample_start}, expected {expected} "
                                 "(give a partition's parts in order, all of them)")
            if prev is not None and prev.part_index < prev.num_parts - 1 and meta.part_index == 0:
                raise ValueError(f"parts do not tile the partition: the part before {Path(key).name} "
                                 f"is {prev.part_index + 1} of {prev.num_parts}; the rest of that partition is missing")
            cu = read_small_tensor(rr, header, data_start, "cu_seqlens").astype(np.int64)
            lm = read_small_tensor(rr, header, data_start, "loss_mask") if keep is not None else None
            nbytes = data_start + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            self.parts.append(PartIndex(key, meta, cu, nbytes))
            for j in range(len(cu) - 1):
                a, n = int(cu[j]), int(cu[j + 1] - cu[j])
                if max_length is not None:
                    n = min(n, max_length)
                if keep is not None and not keep(lm[a:a + n]):
                    continue
                part_of.append(p), starts.append(a), lengths.append(n), within.append(j)
            prev = meta
        if prev is not None and prev.part_index < prev.num_parts - 1:
            raise ValueError(f"parts do not tile the partition: the last part given is {prev.part_index + 1} of "
                             f"{prev.num_parts}; the rest of that partition is missing")
        self.part_of = np.asarray(part_of, dtype=np.int32)  # per sample: index into self.parts
        self._start = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._within = np.asarray(within, dtype=np.int64)

    @classmethod
    def from_store(cls, store: Any, keys: Sequence[str], **kwargs: Any) -> HiddenStateCacheReader:
        """Open parts through a store's ``local_path`` (S3 objects are downloaded once, unbounded)."""
        return cls([store.local_path(k) for k in keys], **kwargs)

    @property
    def meta(self) -> ShardMetadata:
        return self.parts[0].meta

    @property
    def layer_ids(self) -> list[int] | None:
        return list(self.meta.layer_ids) if self.parts else None

    def __len__(self) -> int:
        return len(self.part_of)

    @property
    def prompt_ids(self) -> list[str]:
        return [self.parts[p].meta.prompt_ids[j] for p, j in zip(self.part_of.tolist(), self._within.tolist())]

    def __getitem__(self, i: int) -> SampleStates:
        if not 0 <= i < len(self):
            raise IndexError(i)
        part = self.parts[int(self.part_of[i])]
        a = int(self._start[i])
        b = a + int(self.lengths[i])
        with self.source.reading(part.key) as h:
            ids, mask = h.get_slice("input_ids")[a:b], h.get_slice("loss_mask")[a:b]
            hidden = h.get_slice("hidden")[a:b] if self.need_hidden else None
        return SampleStates(part.meta.prompt_ids[int(self._within[i])], hidden, ids, mask)

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> HiddenStateCacheReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
