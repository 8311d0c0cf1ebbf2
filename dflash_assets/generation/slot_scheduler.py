"""Slot decoders fed from an asyncio loop: requests queued on the loop, decoded on the model's worker thread.

`SlotScheduler` takes requests from an asyncio loop and queues them; one long task on the model's worker thread
builds the decoders (`generation.slot_decoding.SlotDecoder`, their graphs captured) at the first request, admits
and decodes while any request is pending or live (each to the decoder with the shortest slots that hold it, every
busy decoder stepped in turn), and hands each answer back to the loop as its row ends. With ``overlap`` every busy
decoder's step is queued before any is read, each on a CUDA stream of its own, so the few long rows of a tier
decode while the main slots do rather than after them.

Reads a loaded model through its decoders; writes nothing. Imports torch and the standard library only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dflash_assets.generation.slot_decoding import SlotDecoder, SlotRequest, SlotStats

__all__ = ["SlotScheduler", "give_streams", "step_each"]

_log = logging.getLogger("dflash_assets.generation.slot_decoding")  # one logger for the decoders and their scheduler


def give_streams(decoders: Sequence[SlotDecoder]) -> None:
    """A CUDA stream of its own to each of `decoders` when there are several on CUDA (else nothing changes)."""
    if len(decoders) > 1 and all(d.device.type == "cuda" for d in decoders):
        import torch

        for decoder in decoders:
            decoder.stream = torch.cuda.Stream(decoder.device)


def step_each(decoders: Sequence[SlotDecoder], *, overlap: bool = False) -> None:
    """One step of each of `decoders`: in turn, or with `overlap` every step queued (each on its decoder's stream,
    see `give_streams`) before any is read, so the device runs them side by side."""
    if not overlap or len(decoders) < 2:
        for decoder in decoders:
            decoder.step()
        return
    launched = [(decoder, decoder.launch()) for decoder in decoders]
    for decoder, step in launched:
        if step is not None:
            decoder.finish(step)


class SlotScheduler:
    """Requests from an asyncio loop decoded by `SlotDecoder`s on one worker thread (see the module).

    `make_decoders` builds the decoders on the worker thread at the first request (and again after a failure,
    which fails every request queued or live at that moment and frees their caches), and each captures its
    decode-step graphs (`SlotDecoder.capture_views`) before it decodes: e.g. many slots of a few thousand
    positions and a few long ones, so that a rare long prompt neither waits for the end nor makes every step
    attend over its length. A request goes to the decoder of the shortest slots that hold its prompt and its
    ``max_new_tokens``; one that fits none fails alone. ``overlap``: step the busy decoders concurrently, each
    on a CUDA stream of its own (off CUDA: every step queued, then every one read; the same tokens either way).
    """

    def __init__(self, make_decoders: Callable[[], Sequence[SlotDecoder]], executor: Any, *, overlap: bool = False):
        self._make_decoders = make_decoders
        self.overlap = bool(overlap)
        self._executor = executor
        self._queue: queue.SimpleQueue[SlotRequest] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = False
        self.decoders: list[SlotDecoder] = []
        self.stats: list[list[SlotStats]] = []  # each build's decoders' stats (a failure builds new ones)

    async def generate(self, request: SlotRequest) -> tuple[list[int], str]:
        """`request` decoded: its new ids (the stop id that ended it included) and "stop" or "length"."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(outcome: Any, failed: bool) -> None:  # on the loop
            if not done.done():
                done.set_exception(outcome) if failed else done.set_result(outcome)

        request.deliver = lambda _req, ids, finish: loop.call_soon_threadsafe(settle, (ids, finish), False)
        request.fail = lambda exc: loop.call_soon_threadsafe(settle, exc, True)
        self._queue.put(request)
        with self._lock:
            if not self._running:
                self._running = True
                loop.run_in_executor(self._executor, self._work)
        return await done

    async def prepare(self) -> float:
        """Build the decoders and capture their decode-step graphs now, on the worker thread, rather than at the
        first request (a caller timing its requests keeps this one-time cost apart); returns the seconds it took,
        0.0 when they are built already."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._build)

    def _build(self) -> float:
        if self.decoders:
            return 0.0
        t0 = time.perf_counter()
        self.decoders = sorted(self._make_decoders(), key=lambda d: d.slot_len)
        self.stats.append([d.stats for d in self.decoders])
        seconds = sum(d.capture_views() for d in self.decoders)
        if seconds:
            _log.info("slot decoding: %d decode-step graphs captured in %.1f s",
                      sum(len(d.graphs) for d in self.decoders), seconds)
        if self.overlap:
            give_streams(self.decoders)
        return time.perf_counter() - t0

    def _drain(self) -> None:
        """Queued requests to the first decoder (the shortest slots) whose slot holds the prompt and its new
        tokens."""
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            need = len(request.ids) + request.max_new_tokens
            decoder = next((d for d in self.decoders if need <= d.slot_len), None)
            try:
                if decoder is None:
                    raise ValueError(f"a prompt of {len(request.ids)} tokens and {request.max_new_tokens} new ones "
                                     f"do not fit a slot of {self.decoders[-1].slot_len} positions")
                decoder.submit(request)
            except ValueError as e:  # this request alone cannot be decoded
                if request.fail is not None:
                    request.fail(e)

    def _work(self) -> None:
        """Admit and decode until nothing is queued, pending or live (on the worker thread); a step of each
        decoder with work in turn, so long prompts decode beside short ones."""
        try:
            self._build()
            while True:
                self._drain()
                busy = [d for d in self.decoders if not d.idle()]
                if not busy:
                    with self._lock:
                        if self._queue.empty():
                            self._running = False
                            return
                    continue
                step_each(busy, overlap=self.overlap)
        except BaseException as e:  # noqa: BLE001 - every request in the decoders fails alike
            _log.warning("slot decoding failed; failing the requests queued and live", exc_info=True)
            failed = [r for d in self.decoders for r in [*d.live, *d.pending] if r is not None]
            self._settle_streams()
            self.decoders = []  # their caches are freed; the next request builds new ones
            with self._lock:
                while not self._queue.empty():
                    failed.append(self._queue.get_nowait())
                self._running = False
            for request in failed:
                if request.fail is not None:
                    request.fail(e)

    def _settle_streams(self) -> None:
        """Wait for what the decoders' own streams still run before their memory is freed (it would otherwise go
        to new tensors on another stream while those kernels write it)."""
        for decoder in self.decoders:
            if decoder.stream is not None:
                try:
                    decoder.stream.synchronize()
                except Exception:  # noqa: BLE001 - a device that failed may fail this too; the failure is logged
                    _log.debug("slot decoding: a decoder's stream did not settle", exc_info=True)
