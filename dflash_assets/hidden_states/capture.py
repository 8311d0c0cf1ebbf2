"""Capture the target's hidden states for DFlash training and write them as safetensors shards.

:func:`capture_partition` plans a partition's files and batches, checks its byte
budget before any compute, and runs one worker per device
(:func:`capture_batches`: hooks and decoder cut from
:class:`~dflash_assets.target_model.layer_capture.LayerCapture`, samples packed without
padding, GPU compute overlapped with the writes); :func:`capture_hidden_states` is
the synchronous form for notebooks and tests. The cached states equal running each
sample alone (tests check this against ``output_hidden_states=True``).

Reads tokenized samples (a pyarrow Table / polars DataFrame / list of dicts
with ``prompt_id``, ``input_ids``, ``loss_mask``, optionally ``num_tokens``)
(normalized by :mod:`~dflash_assets.hidden_states.batching`) and a target
model directory; writes one partition's shard file(s) in the format of
:mod:`dflash_assets.hidden_states.format` into a local directory
(:mod:`~dflash_assets.hidden_states.stage` publishes them through the store).
Imports only numpy, torch, transformers and safetensors.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_assets.hidden_states.batching import Batch, TokenizedSample, load_samples, plan_batches, plan_parts
from dflash_assets.hidden_states.format import (
    SafetensorsStreamWriter,
    ShardMetadata,
    StorageBudgetExceeded,
    bytes_per_token,
    check_budget,
    estimate_partition_bytes,
    part_file_name,
    shard_tensor_specs,
    torch_dtype,
)
from dflash_assets.hidden_states.packing import (
    ATTN_IMPLEMENTATION,
    Packing,
    is_hybrid,
    packed_attention,
    register_packed_attention,
    resolve_packing,
)
from dflash_assets.target_model.layer_capture import LayerCapture, decoder_stack, text_config
from dflash_assets.target_model.packed_attention import packed_row

__all__ = [
    "CaptureSpec",
    "CaptureResult",
    "WorkerStats",
    "StorageBudgetExceeded",
    "load_target",
    "compile_elementwise",
    "capture_hidden_states",
    "capture_batches",
    "capture_partition",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Target model
# ---------------------------------------------------------------------------


def load_target(path: str | os.PathLike, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "bfloat16") -> nn.Module:
    """Load a causal-LM target for capture (``packed_causal`` attention, eval mode, on ``device``)."""
    from dflash_assets.target_model.loading import load_causal_lm

    register_packed_attention()
    device = torch.device(device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "attn_implementation": ATTN_IMPLEMENTATION}
    if device.type != "cpu":
        kwargs["device_map"] = {"": device}
    model = load_causal_lm(path, **kwargs)
    return model.to(device).eval()



def compile_elementwise(model: nn.Module) -> int:
    """``torch.compile`` each decoder layer's RMSNorm and MLP modules (fuses the fp32 norm math and SiLU*up).

    HF runs these as chains of unfused elementwise kernels, ~15% of a 16K-token
    forward on an H200. Attention modules and the hooked modules are left
    alone. Idempotent; returns how many modules were compiled. GPU use only
    (needs Triton); the first forwards pay the compile time. On CUDA the
    capture does this by default (``CaptureSpec.compile``). One H200, Qwen3-8B
    shapes, 16K-token batches: 31K -> 38K tok/s packed, 33K -> 40K stacked
    (BENCHMARKS.md).
    """
    _, layers = decoder_stack(model)
    n = 0
    for layer in layers:
        for m in layer.modules():
            name = type(m).__name__
            if m is layer or not (name.endswith("RMSNorm") or name.endswith("MLP")):
                continue
            if not getattr(m, "_dflash_compiled", False):
                m.compile()
                m._dflash_compiled = True
                n += 1
    model._dflash_compiled = True
    return n


# Dynamo/inductor compile is not thread-safe; forwards of compiled models launch under this lock.
# It is held only while Python enqueues kernels (the GPU runs on after release), so devices still overlap.
_COMPILE_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Inputs:
    kwargs: dict[str, Any]
    num_tokens: int


def _batch_inputs(samples: Sequence[TokenizedSample], batch: Batch, device: torch.device, hybrid: bool) -> _Inputs:
    ids = np.concatenate([samples[i].input_ids for i in batch.indices])
    pin = device.type == "cuda"
    t_ids = torch.from_numpy(ids).long()
    if not batch.packed:
        t_ids = t_ids.view(len(batch.indices), -1)
        kwargs: dict[str, Any] = {"input_ids": (t_ids.pin_memory() if pin else t_ids).to(device, non_blocking=True)}
        return _Inputs(kwargs, ids.shape[0])
    host = {"input_ids": t_ids[None]}
    if hybrid and len(batch.indices) > 1:  # causal-conv1d keeps packed samples apart through seq_idx
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        host["seq_idx"] = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))[None]
    kwargs = {k: (v.pin_memory() if pin else v).to(device, non_blocking=True) for k, v in host.items()}
    if len(batch.indices) > 1:
        kwargs.update(packed_row(batch.lengths, device, pin=pin))
    return _Inputs(kwargs, ids.shape[0])


def _forward(cap: LayerCapture, inputs: _Inputs, target: torch.Tensor) -> None:
    cap.target = target
    if getattr(cap.model, "_dflash_compiled", False):
        with _COMPILE_LOCK:
            cap.text_model(**inputs.kwargs, use_cache=False)
    else:
        cap.text_model(**inputs.kwargs, use_cache=False)


@torch.inference_mode()
def capture_hidden_states(model: nn.Module, samples: Any, layer_ids: Sequence[int], *,
                          tokens_per_batch: int = 16384, packing: Packing = "auto") -> list[torch.Tensor]:
    """Synchronous capture for notebooks and tests: per sample, a CPU tensor [n, len(layer_ids)*H].

    ``model`` should use ``packed_causal`` attention (see :func:`load_target`);
    other implementations are switched to it for the call and restored.
    """
    samples = load_samples(samples)
    device = next(model.parameters()).device
    packed = resolve_packing(model, device, packing)
    hybrid = is_hybrid(model)
    out: list[torch.Tensor | None] = [None] * len(samples)
    with packed_attention(model), LayerCapture(model, layer_ids) as cap:
        width = cap.hidden_size * len(cap.layer_ids)
        for batch in plan_batches([s.num_tokens for s in samples], tokens_per_batch, packed=packed):
            inputs = _batch_inputs(samples, batch, device, hybrid)
            target = torch.empty(inputs.num_tokens, width, dtype=model.dtype, device=device)
            _forward(cap, inputs, target)
            host = target.cpu()
            a = 0
            for i, n in zip(batch.indices, batch.lengths):
                out[i] = host[a:a + n]
                a += n
    return out  # type: ignore[return-value]



# ---------------------------------------------------------------------------
# Pipelined capture on one device
# ---------------------------------------------------------------------------


@dataclass
class WorkerStats:
    device: str
    batches: int = 0
    tokens: int = 0
    seconds: float = 0.0          # wall time of the worker loop
    wait_for_writer_s: float = 0.0  # time the compute loop waited for a free host buffer (storage-bound)
    write_s: float = 0.0          # time the writer thread spent in the sink

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


Sink = Callable[[Batch, torch.Tensor], None]


class _WriterThread(threading.Thread):
    """Drains (ready_event, host_tensor, batch, release) items into the sink; keeps draining after an error."""

    def __init__(self, sink: Sink | None, depth: int, stats: WorkerStats):
        super().__init__(daemon=True, name=f"hidden-state-writer-{stats.device}")
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.sink, self.stats = sink, stats
        self.error: BaseException | None = None

    def run(self) -> None:
        while (item := self.q.get()) is not None:
            event, host, batch, release = item
            try:
                while event is not None and not event.query():  # poll: never block the launching thread
                    time.sleep(0.0005)
                if self.sink is not None and self.error is None:
                    t0 = time.perf_counter()
                    self.sink(batch, host)
                    self.stats.write_s += time.perf_counter() - t0
            except BaseException as e:  # reported to the compute loop
                self.error = e
            finally:
                release()


def capture_batches(model: nn.Module, samples: Sequence[TokenizedSample], batches: Iterable[Batch],
                    layer_ids: Sequence[int], sink: Sink | None, *, queue_depth: int = 2,
                    stop: threading.Event | None = None) -> WorkerStats:
    """Run ``batches`` through ``model`` on its device; hand each batch's states to ``sink`` from a writer thread.

    ``sink(batch, host)`` gets a CPU tensor [batch.num_tokens, n_layers*H]
    (samples in ``batch.indices`` order) that is only valid during the call.
    ``sink=None`` copies to host but writes nothing (capture-only timing).
    ``batches`` may be a shared iterator (several devices pull from it).

    - Hooks + cut (:class:`~dflash_assets.target_model.layer_capture.LayerCapture`):
      forward hooks on the chosen decoder layers copy each layer's output into a
      [tokens, n_layers*H] staging buffer; the decoder is cut after the last
      needed layer and the *base* model is called, so no later layer and no
      lm_head runs. Layer id ``i`` is HF ``hidden_states[i + 1]`` (for the last
      layer, the output after the final norm, as HF returns it).
    - Packing without padding: samples are concatenated, in partition order,
      into one row of at most ``tokens_per_batch`` tokens, ``position_ids``
      restarting per sample. Attention is the registered implementation
      ``"packed_causal"`` (:mod:`~dflash_assets.hidden_states.packing`): causal
      attention inside each sample only, via ``torch.nn.attention.varlen.varlen_attn``
      (flash varlen) on CUDA, or one causal SDPA call per sample elsewhere.
    - Hybrid targets (Gated DeltaNet layers): Transformers' PyTorch fallback for
      the linear-attention layers cannot keep packed samples apart (its conv and
      delta rule run across the whole row; it raises when given ``cu_seqlens``).
      So they are packed only when ``flash-linear-attention`` *and*
      ``causal-conv1d`` are importable on a CUDA device (then ``cu_seq_lens_q``
      and ``seq_idx`` keep samples apart); otherwise samples of identical length
      are stacked along the batch dimension (still no padding) and the rest run
      one per forward (``packing.resolve_packing`` logs a warning).
    - Overlap: two GPU staging buffers, a ring of pinned host buffers, a copy
      stream (D2H ``non_blocking`` after a CUDA event), and a writer thread fed
      by a bounded queue that hands rows to ``sink`` (which ``pwrite``s them into
      the pre-sized shard files). The GPU only waits when the writer is a full
      queue behind (storage-bound), never on each write.
    """
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    stats = WorkerStats(str(device))
    hybrid = is_hybrid(model)
    writer = _WriterThread(sink, queue_depth, stats)
    writer.start()
    t_start = time.perf_counter()
    try:
        with torch.inference_mode(), packed_attention(model), LayerCapture(model, layer_ids) as cap:
            width = cap.hidden_size * len(cap.layer_ids)
            dtype = model.dtype
            staging = _CudaStaging(device, queue_depth) if cuda else None
            for step, batch in enumerate(batches):
                if stop is not None and stop.is_set():
                    break
                if writer.error is not None:
                    raise writer.error
                inputs = _batch_inputs(samples, batch, device, hybrid)
                n = inputs.num_tokens
                if staging is None:
                    target = torch.empty(n, width, dtype=dtype, device=device)
                    _forward(cap, inputs, target)
                    t0 = time.perf_counter()
                    writer.q.put((None, target, batch, lambda: None))  # blocks when the writer is behind
                    stats.wait_for_writer_s += time.perf_counter() - t0
                else:
                    staging.forward_and_hand_over(step, cap, inputs, batch, width, dtype, writer, stats)
                stats.batches += 1
                stats.tokens += n
    finally:
        writer.q.put(None)
        writer.join()
        if cuda:
            torch.cuda.synchronize(device)
        stats.seconds = time.perf_counter() - t_start
    if writer.error is not None:
        raise writer.error
    return stats


class _CudaStaging:
    """:func:`capture_batches`'s buffers on CUDA: two GPU staging buffers (one per step parity), a ring of
    ``queue_depth + 1`` pinned host buffers (indices in ``free`` when the writer is done with them) and a copy
    stream; each grows to the largest batch it has held."""

    def __init__(self, device: torch.device, queue_depth: int):
        torch.cuda.set_device(device)
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.gpu_bufs: list[torch.Tensor | None] = [None, None]
        self.copy_done: list[Any] = [None, None]
        self.host_bufs: list[torch.Tensor | None] = [None] * (queue_depth + 1)
        self.free: queue.Queue = queue.Queue()
        for k in range(queue_depth + 1):
            self.free.put(k)

    def forward_and_hand_over(self, step: int, cap: LayerCapture, inputs: _Inputs, batch: Batch, width: int,
                              dtype: torch.dtype, writer: _WriterThread, stats: WorkerStats) -> None:
        """Run batch ``step`` into its GPU buffer, copy it to a free pinned buffer on the copy stream (after a CUDA
        event), and queue it to the writer with that copy's event; waits only for a free pinned buffer."""
        n = inputs.num_tokens
        slot = step % 2
        if self.copy_done[slot] is not None:  # the D2H of batch step-2 may still read this buffer
            self.compute.wait_event(self.copy_done[slot])
        if self.gpu_bufs[slot] is None or self.gpu_bufs[slot].shape[0] < n:
            self.gpu_bufs[slot] = torch.empty(n, width, dtype=dtype, device=self.device)
        gbuf = self.gpu_bufs[slot][:n]
        _forward(cap, inputs, gbuf)
        t0 = time.perf_counter()
        k = self.free.get()  # backpressure: a pinned buffer the writer has finished with
        stats.wait_for_writer_s += time.perf_counter() - t0
        if self.host_bufs[k] is None or self.host_bufs[k].shape[0] < n:
            self.host_bufs[k] = torch.empty(n, width, dtype=dtype, pin_memory=True)
        computed = torch.cuda.Event()
        computed.record(self.compute)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(computed)
            host = self.host_bufs[k][:n]
            host.copy_(gbuf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.copy_done[slot] = done
        writer.q.put((done, host, batch, lambda k=k: self.free.put(k)))

# ---------------------------------------------------------------------------
# A partition: plan, budget, files, workers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture and how. ``target`` is a model directory (or hub id already in the local cache)."""

    target: str
    layer_ids: tuple[int, ...]
    target_id: str = ""              # name recorded in the header (default: ``target``)
    dtype: str = "bfloat16"          # compute and storage dtype ("float32" for CPU exactness tests)
    tokens_per_batch: int = 16384
    packing: Packing = "auto"
    max_part_bytes: int = 16 * 2**30  # hidden bytes per file before splitting into parts
    budget_bytes: int | None = None  # refuse to compute when used + this partition would exceed it
    compile: bool | None = None      # torch.compile norms + MLPs; None: on CUDA devices (see compile_elementwise)
    tokenizer_hash: str = ""         # default: dflash_assets.target_model.tokenizer.tokenizer_hash of the target dir's tokenizer
    upstream_data_version: str = ""
    queue_depth: int = 2
    fsync: bool = True


@dataclass(frozen=True)
class CaptureResult:
    paths: tuple[Path, ...]
    num_samples: int
    num_tokens: int
    bytes: int
    hidden_size: int
    layer_ids: tuple[int, ...]
    packed: bool
    seconds: float
    workers: tuple[WorkerStats, ...]
    keys: tuple[str, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def to_metadata(self) -> dict[str, Any]:
        """Plain values for ``MaterializeResult(metadata=...)``."""
        return {
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_parts": len(self.paths),
            "gb": round(self.bytes / 1e9, 3),
            "bytes_per_token": self.bytes // max(1, self.num_tokens),
            "layer_ids": list(self.layer_ids),
            "packing": "packed" if self.packed else "same_length",
            "tokens_per_second": round(self.tokens_per_second, 1),
            "seconds": round(self.seconds, 2),
            "devices": [w.device for w in self.workers],
            "storage_wait_s": round(sum(w.wait_for_writer_s for w in self.workers), 2),
            "keys": list(self.keys),
        }


def _tokenizer_hash(target: str) -> str:
    """``dflash_assets.target_model.tokenizer.tokenizer_hash`` of the target directory's tokenizer (its chat object,
    ``TargetModelSpec.chat()``: loaded through the target package), "" when it has none."""
    d = Path(target)
    if not (d.is_dir() and ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file())):
        return ""
    from dflash_assets.target_model.spec import TargetModelSpec

    return TargetModelSpec(model_path=str(d)).chat().tokenizer_hash


def _target_config(spec: CaptureSpec, models: Sequence[nn.Module] | None) -> Any:
    if models:
        return text_config(models[0].config)
    from transformers import AutoConfig

    return text_config(AutoConfig.from_pretrained(spec.target))


class _ShardSink:
    """Writes each batch's rows into the part files at their precomputed rows (thread-safe)."""

    def __init__(self, writers: Sequence[SafetensorsStreamWriter], place: np.ndarray):
        self.writers, self.place = writers, place  # place[i] = (part, first row in that part)

    def __call__(self, batch: Batch, host: torch.Tensor) -> None:
        a = 0
        run_start, run_part, run_row, run_len = 0, -1, -1, 0
        for i, n in zip(batch.indices, batch.lengths):
            part, row = (int(x) for x in self.place[i])
            if part == run_part and row == run_row + run_len:
                run_len += n  # contiguous with the previous sample: one bigger write
            else:
                if run_len:
                    self.writers[run_part].write("hidden", host[run_start:run_start + run_len], row=run_row)
                run_start, run_part, run_row, run_len = a, part, row, n
            a += n
        if run_len:
            self.writers[run_part].write("hidden", host[run_start:run_start + run_len], row=run_row)


def capture_partition(samples: Any, spec: CaptureSpec, out_dir: str | os.PathLike, *,
                      stem: str = "hidden_states", devices: Sequence[str] = ("cpu",),
                      models: Sequence[nn.Module] | None = None, used_bytes: int = 0) -> CaptureResult:
    """Capture one partition's hidden states into ``out_dir/<stem>[-0000k-of-0000n].safetensors``.

    ``devices``: one worker per device (``["cuda:0", "cuda:1"]``), each loading
    its own copy of ``spec.target`` unless ``models`` (one per device) are given.
    Refuses with ``StorageBudgetExceeded`` before computing when
    ``used_bytes`` + this partition exceeds ``spec.budget_bytes`` or the free
    space of ``out_dir``. On any error the partial files are removed.

    Budget: the partition's bytes are known before any compute
    (``tokens x layers x H x dtype``). Several GPUs: one thread per device, each
    with its own model copy, pulling batches from a shared queue; all write into
    the same pre-sized files at precomputed offsets, so the output does not
    depend on the device count.
    """
    samples = load_samples(samples)
    if not samples:
        raise ValueError("no samples to capture")
    if models is not None and len(models) != len(devices):
        raise ValueError("give one model per device")
    if models is not None and any(m.dtype != torch_dtype(spec.dtype) for m in models):
        raise ValueError(f"models must be in spec.dtype={spec.dtype}")
    layer_ids = tuple(int(i) for i in spec.layer_ids)
    config = _target_config(spec, models)
    H = int(config.hidden_size)
    if not layer_ids or not all(0 <= i < config.num_hidden_layers for i in layer_ids):
        raise ValueError(f"layer ids {layer_ids} out of range for {config.num_hidden_layers} layers")
    dtype = torch_dtype(spec.dtype)
    lengths = [s.num_tokens for s in samples]
    num_tokens = sum(lengths)
    row_bytes = bytes_per_token(len(layer_ids), H, dtype)
    parts = plan_parts(lengths, row_bytes, spec.max_part_bytes)
    needed = estimate_partition_bytes(num_tokens, len(samples), len(layer_ids), H, dtype, num_parts=len(parts))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_budget(needed, spec.budget_bytes, used_bytes=used_bytes, free_bytes=shutil.disk_usage(out_dir).free,
                 free_what=f"scratch disk at {out_dir}")

    tok_hash = spec.tokenizer_hash or _tokenizer_hash(spec.target)
    place = np.zeros((len(samples), 2), dtype=np.int64)
    writers: list[SafetensorsStreamWriter] = []
    t0 = time.perf_counter()
    try:
        for k, (a, b) in enumerate(parts):
            part_lengths = np.asarray(lengths[a:b], dtype=np.int64)
            cu = np.concatenate([[0], np.cumsum(part_lengths)]).astype(np.int64)
            place[a:b, 0] = k
            place[a:b, 1] = cu[:-1]
            meta = ShardMetadata(
                target_model=spec.target_id or str(spec.target), layer_ids=layer_ids, dtype=str(dtype).removeprefix("torch."),
                hidden_size=H, tokenizer_hash=tok_hash, upstream_data_version=spec.upstream_data_version,
                prompt_ids=tuple(s.prompt_id for s in samples[a:b]), part_index=k, num_parts=len(parts), sample_start=a)
            w = SafetensorsStreamWriter(out_dir / part_file_name(stem, k, len(parts)),
                                        shard_tensor_specs(int(cu[-1]), b - a, len(layer_ids), H, dtype),
                                        meta.to_header(), fsync=spec.fsync)
            writers.append(w)
            w.write("cu_seqlens", cu)
            w.write("input_ids", np.concatenate([s.input_ids for s in samples[a:b]]))
            w.write("loss_mask", np.concatenate([s.loss_mask for s in samples[a:b]]))

        packed = resolve_packing(config, devices[0], spec.packing)
        batches = plan_batches(lengths, spec.tokens_per_batch, packed=packed)
        sink = _ShardSink(writers, place)
        stats = _run_workers(samples, batches, spec, devices, models, sink)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    seconds = time.perf_counter() - t0
    paths = tuple(w.path for w in writers)
    return CaptureResult(paths, len(samples), num_tokens, sum(p.stat().st_size for p in paths), H, layer_ids,
                         packed, seconds, tuple(stats))


def _run_workers(samples: Sequence[TokenizedSample], batches: Sequence[Batch], spec: CaptureSpec,
                 devices: Sequence[str], models: Sequence[nn.Module] | None, sink: Sink) -> list[WorkerStats]:
    # Largest batches first so the devices finish together; files are written at offsets, so order is free.
    work: queue.SimpleQueue = queue.SimpleQueue()
    for b in sorted(batches, key=lambda b: -b.num_tokens):
        work.put(b)

    def pull() -> Iterable[Batch]:
        while True:
            try:
                yield work.get_nowait()
            except queue.Empty:
                return

    stop = threading.Event()
    ready = threading.Barrier(len(devices))  # every device loaded before any pulls work: even split
    results: dict[int, WorkerStats] = {}
    errors: list[BaseException] = []

    def run(k: int, device: str) -> None:
        try:
            model = models[k] if models is not None else load_target(spec.target, device, spec.dtype)
            if spec.compile or (spec.compile is None and torch.device(device).type == "cuda"):
                compile_elementwise(model)
            ready.wait()
            results[k] = capture_batches(model, samples, pull(), spec.layer_ids, sink,
                                         queue_depth=spec.queue_depth, stop=stop)
        except threading.BrokenBarrierError as e:  # another worker failed first
            errors.append(e)
        except BaseException as e:
            errors.insert(0, e)
            stop.set()
            ready.abort()

    if len(devices) == 1:
        run(0, devices[0])
    else:
        threads = [threading.Thread(target=run, args=(k, d), name=f"capture-{d}") for k, d in enumerate(devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [results[k] for k in sorted(results)]

