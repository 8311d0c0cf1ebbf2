"""The in-process engine's batching: the requests in flight grouped into left-padded ``model.generate`` calls.

``next_batch`` picks a call's requests (the oldest, and those with its settings closest to it in length, within
``max_batch_rows`` rows and ``max_batch_tokens`` padded prompt tokens; the cost plan replays the same rule). On the
static cache each call is padded to a few shapes (``static_batch_shape``: rows to a bucket with copies of its first
row, the prompt width to a power of two from 256 to 2,048), so the compiled decode step meets few shapes.

Reads and writes nothing (the model is the engine's, see ``engines.inprocess_models``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from dflash_assets.generation.config import GenerationConfig, hf_generation_settings
from dflash_assets.generation.engines.protocol import EngineError

_log = logging.getLogger(__name__)

# The static-cache engine pads each batch to one of these row counts and its prompt width to one of these widths,
# powers of two both, so the compiled decode step (one graph per shape) meets a few shapes in a process, compiled
# once each, and padding at most doubles a batch's rows.
STATIC_ROW_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
STATIC_WIDTH_BUCKETS = (256, 512, 1024, 2048)
# Prompts longer than this decode on the dynamic cache: a static cache's prefill attends over the whole cache
# length, and a batch of 64 prompts of 8K tokens runs an H200 out of memory. Few prompts are this long.
STATIC_MAX_WIDTH = STATIC_WIDTH_BUCKETS[-1]


def static_width(width: int) -> int:
    """The padded prompt width of a static-cache batch whose longest prompt has `width` tokens (<= STATIC_MAX_WIDTH)."""
    return next(b for b in STATIC_WIDTH_BUCKETS if b >= width)


def static_row_cap(padded_width: int, max_rows: int, max_tokens: int | None = None) -> int:
    """The most rows a static-cache batch of this padded width may hold: the largest row bucket within `max_rows`
    and `max_tokens` padded prompt tokens, or that limit itself when it is under the smallest bucket."""
    limit = max(1, min(max_rows, max_tokens // padded_width if max_tokens else max_rows))
    return max((b for b in STATIC_ROW_BUCKETS if b <= limit), default=limit)


def static_batch_shape(rows: int, width: int, max_rows: int, max_tokens: int | None = None) -> tuple[int, int]:
    """(rows, prompt width) a static-cache batch of `rows` prompts at most `width` tokens long is padded to: the
    next width bucket, and the next row bucket within `static_row_cap` (a batch over the cap, which the engine
    never forms, keeps its rows). Padding 300 long prompts up to 1,024 rows would multiply the prefill's and the
    cache's memory, hence the cap by tokens."""
    padded_width = static_width(width)
    cap = static_row_cap(padded_width, max_rows, max_tokens)
    bucket = next((b for b in STATIC_ROW_BUCKETS if b >= rows), rows)
    return max(rows, min(bucket, cap)), padded_width


def _cut_after_stop(new: list[int], stop_ids: Sequence[int]) -> list[int]:
    """`new` up to and including its first stop id (all of it when there is none)."""
    stops = set(stop_ids)
    return new[:next((i + 1 for i, t in enumerate(new) if t in stops), len(new))]


def next_batch(lengths: Sequence[int], keys: Sequence[str], *, max_rows: int, max_tokens: int,
               cache: str = "dynamic") -> list[int]:
    """Which pending requests (prompt lengths and settings keys, oldest first) ``TransformersEngine`` puts in its
    next generate call, as indices: the oldest request, and the others with its settings closest to it in length,
    while the batch stays within `max_rows` rows and `max_tokens` padded prompt tokens (a longer one runs alone).
    On the static cache the padded width is the width bucket's and the rows stop at `static_row_cap`, so a batch
    is padded to a row bucket, never to a row count of its own. The cost plan replays the same rule."""
    anchor = 0
    same = sorted((i for i in range(len(lengths)) if keys[i] == keys[anchor]),
                  key=lambda i: abs(lengths[i] - lengths[anchor]))
    batch, width = [anchor], lengths[anchor]
    for i in same[1:]:
        if len(batch) == max_rows:
            break
        wider = max(width, lengths[i])
        if cache == "static" and wider <= STATIC_MAX_WIDTH:
            fits = len(batch) + 1 <= static_row_cap(static_width(wider), max_rows, max_tokens)
        else:
            fits = wider * (len(batch) + 1) <= max_tokens
        if fits:
            batch.append(i)
            width = wider
    return batch


class _StepClock:
    """A transformers generate streamer that notes when it is handed the prompt and each step's new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass(eq=False)  # compared by identity: removing a batch from the queue must not compare id lists
class _BatchedRequest:
    ids: list[int]
    generation: GenerationConfig
    stop_ids: list[int]
    key: str  # requests with equal keys share one `generate` call
    future: asyncio.Future


class BatchedGenerate:
    """The in-process engine's part that queues requests and runs them as batched generate calls
    (``TransformersEngine``; the dynamic and static caches, and prompts too long for a slot)."""

    def _generate(self, rows: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                  streamer: Any = None) -> list[list[int]]:
        """Greedy or sampled continuations of `rows` (left-padded into one batch), each cut after its first stop id.
        ``streamer``: transformers' generate streamer (``put`` gets the prompt, then each step's new tokens)."""
        import torch

        pad = stop_ids[0] if stop_ids else 0
        kwargs: dict[str, Any] = {"max_new_tokens": gen.max_new_tokens, "eos_token_id": stop_ids,
                                  "pad_token_id": pad, **hf_generation_settings(gen)}
        if streamer is not None:
            kwargs["streamer"] = streamer
        if not kwargs["do_sample"]:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if gen.seed is not None:
            torch.manual_seed(gen.seed)
        n, width = len(rows), max(len(r) for r in rows)
        if self.cache == "static" and width <= STATIC_MAX_WIDTH:
            padded_rows, width = static_batch_shape(n, width, self.max_batch_rows, self.max_batch_tokens)
            rows = list(rows) + [rows[0]] * (padded_rows - n)  # copies finish with the row they copy
            kwargs["cache_implementation"] = "static"
            if self.static_cache_len == "per_call":  # transformers sizes each new static cache to the largest call
                # so far (no recompile), and every decode step attends over all of it: a 256-wide call after a
                # 2,048-wide one would read 4.5x the cache it needs
                self.model._previous_max_cache_length = -1
        self.batch_shapes.append((len(rows), width))
        x = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=mask, **kwargs)
        self.batch_seconds.append(time.perf_counter() - t0)
        self.batch_steps.append(out.shape[1] - width)
        _log.info("%s: generate of %d rows (%d padded) x %d prompt tokens, %d steps: %.1f s", self.url, n, len(rows),
                  width, self.batch_steps[-1], self.batch_seconds[-1])
        return [_cut_after_stop(new, stop_ids) for new in out[:n, width:].tolist()]

    async def time_generate(self, rows: list[list[int]], generation: GenerationConfig
                            ) -> tuple[float, int, list[float]]:
        """One generate call of `rows` (token ids, left-padded into one batch) with no stop id, so every row
        runs ``generation.max_new_tokens`` steps, on the model's worker thread: its wall seconds, its steps, and
        when each step's new tokens came out (seconds after generate received the prompt; the first comes out
        of the prefill). The cost plan times batch shapes with it (``open()`` first)."""
        clock = _StepClock()
        await self._in_worker(self._generate, rows, generation, [], clock)
        return self.batch_seconds[-1], self.batch_steps[-1], [t - clock.times[0] for t in clock.times[1:]]

    def _next_batch(self) -> list[_BatchedRequest]:
        """The requests of the next generate call (``next_batch``'s rule over the pending requests)."""
        picked = next_batch([len(r.ids) for r in self._pending], [r.key for r in self._pending],
                            max_rows=self.max_batch_rows, max_tokens=self.max_batch_tokens, cache=self.cache)
        return [self._pending[i] for i in picked]

    async def _run_batches(self) -> None:
        while self._pending:
            await asyncio.sleep(0.005)  # let requests sent together land in one batch
            batch = self._next_batch()
            self._pending = [r for r in self._pending if r not in batch]
            self.batch_sizes.append(len(batch))
            try:
                outs = await self._in_worker(self._generate, [r.ids for r in batch], batch[0].generation,
                                             batch[0].stop_ids)
            except Exception as e:  # noqa: BLE001 - every request of the batch fails alike
                _log.warning("%s: generate of %d rows (prompt width %d) failed", self.url, len(batch),
                             max(len(r.ids) for r in batch), exc_info=True)
                err = EngineError(f"{self.url}: generate failed: {type(e).__name__}: {e}", endpoint=self.url)
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(err)
                continue
            for r, out in zip(batch, outs):
                if not r.future.done():
                    r.future.set_result(out)

    async def _batched_generate(self, ids: list[int], gen: GenerationConfig, stop_ids: list[int]) -> list[int]:
        """One request through the batched generate: queued, and answered when the batch it lands in ends."""
        request = _BatchedRequest(ids, gen, stop_ids, gen.model_dump_json() + repr(stop_ids),
                                  asyncio.get_running_loop().create_future())
        self._pending.append(request)
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
        return await request.future
