"""The in-process engine's cache modes beyond the batched generate: transformers' continuous batching
(``cache="continuous"``) and the slot decoders of ``generation.slot_decoding`` (``cache="slots"``).

Both admit a request as soon as a row is free and retire it at its stop id, so a batch never runs part-empty until
its longest row ends. Sampling: temperature, top_p and top_k only (``min_p`` and ``repetition_penalty`` are refused,
not dropped).

Reads and writes nothing (the model is the engine's, see ``engines.inprocess_models``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

from dflash_assets.generation.config import GenerationConfig, hf_generation_settings
from dflash_assets.generation.engines.inprocess_batching import _cut_after_stop
from dflash_assets.generation.engines.protocol import EngineError

_log = logging.getLogger(__name__)

# Sampling settings transformers' continuous batching applies per row; others (min_p, repetition_penalty) it drops.
CONTINUOUS_SAMPLING = frozenset({"do_sample", "temperature", "top_p", "top_k"})
# Cache pages of the continuous engine on a CPU, per row of max_batch_rows: 2 x 256 tokens. On a GPU transformers
# sizes the cache from the free memory (90% of it).
CONTINUOUS_CPU_PAGES_PER_ROW = 2
_REQUEST_NUMBERS = itertools.count(1)


class ContinuousCache:
    """The in-process engine's ``cache="continuous"``: requests handed to transformers' continuous batching."""

    def _continuous_manager(self, gen: GenerationConfig, stop_ids: list[int]) -> Any:
        """The running continuous-batching manager for `gen`'s sampling settings (on the worker thread): the one
        already running when its settings match, else a new one (an old one is stopped first: one cache at a
        time)."""
        from transformers import GenerationConfig as HFGenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        assert self._loaded is not None
        settings = hf_generation_settings(gen)
        unsupported = sorted(set(settings) - CONTINUOUS_SAMPLING)
        if unsupported:
            raise EngineError(f"{self.url}: continuous batching applies temperature, top_p and top_k only, not "
                              f"{', '.join(unsupported)}; use cache='static' or 'dynamic'", endpoint=self.url)
        key = json.dumps([settings, gen.seed], sort_keys=True)
        loaded = self._loaded
        if loaded.continuous is not None and loaded.continuous_key == key and loaded.continuous.is_running():
            return loaded.continuous
        loaded.stop_continuous()
        sampling = dict(settings) if settings["do_sample"] else {"do_sample": False, "temperature": None,
                                                                 "top_p": None, "top_k": None}
        hf_gen = HFGenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=stop_ids, **sampling)
        cpu = str(self.model.device) == "cpu"
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=self.max_batch_rows, seed=gen.seed,
            num_blocks=self.max_batch_rows * CONTINUOUS_CPU_PAGES_PER_ROW if cpu else None)
        manager = self.model.init_continuous_batching(generation_config=hf_gen, continuous_batching_config=cb)
        manager.start()
        loaded.continuous, loaded.continuous_key = manager, key
        _log.info("%s: continuous batching started (%d rows per step, %s)", self.url, self.max_batch_rows,
                  "greedy" if not settings["do_sample"] else "sampled")
        return manager

    async def _continuous_generate(self, ids: list[int], gen: GenerationConfig, stop_ids: list[int]) -> list[int]:
        """One request through the continuous-batching manager: its new ids, the first stop id included."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        manager = await self._in_worker(self._continuous_manager, gen, stop_ids)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request_id = f"dflash-{next(_REQUEST_NUMBERS)}"

        def deliver(output: Any) -> None:  # on this loop (transformers calls it through call_soon_threadsafe)
            if output.is_finished() and not done.done():
                done.set_result(output)

        manager.register_result_handler(request_id, deliver)  # before the request: no result reaches the queue
        if manager.add_request(ids, request_id=request_id, max_new_tokens=gen.max_new_tokens,
                               eos_token_id=stop_ids) is None:
            raise EngineError(f"{self.url}: continuous batching refused the request (stopping)", retryable=True,
                              endpoint=self.url)
        try:
            output = await done
        except asyncio.CancelledError:
            manager.cancel_request(request_id)
            raise
        if output.status == RequestStatus.FAILED or output.error:
            raise EngineError(f"{self.url}: continuous batching failed the request: {output.error}",
                              endpoint=self.url)
        return _cut_after_stop(list(output.generated_tokens), stop_ids)


class SlotCache:
    """The in-process engine's ``cache="slots"``: requests decoded by slot decoders of a few lengths (tiers)."""

    async def _slot_generate(self, ids: list[int], gen: GenerationConfig, stop_ids: list[int]) -> list[int]:
        """One request through the slot decoder (``generation.slot_decoding``): its new ids, the first stop id
        included."""
        from dflash_assets.generation.slot_decoding import SlotRequest

        settings = hf_generation_settings(gen)
        unsupported = sorted(set(settings) - CONTINUOUS_SAMPLING)
        if unsupported:
            raise EngineError(f"{self.url}: slot decoding applies temperature, top_p and top_k only, not "
                              f"{', '.join(unsupported)}; use cache='static' or 'dynamic'", endpoint=self.url)
        self._slot_scheduler()
        sampled = settings["do_sample"]
        request = SlotRequest(ids, gen.max_new_tokens, tuple(stop_ids), temperature=gen.temperature if sampled else 0.0,
                              top_p=settings.get("top_p") or 1.0, top_k=settings.get("top_k") or 0)
        try:
            out, _finish = await self._slots.generate(request)
        except ValueError as e:
            raise EngineError(f"{self.url}: {e}", endpoint=self.url) from e
        except Exception as e:  # noqa: BLE001 - the decoder failed: every request in it fails alike
            raise EngineError(f"{self.url}: slot decoding failed: {type(e).__name__}: {e}", endpoint=self.url) from e
        return out

    def _slot_scheduler(self) -> Any:
        from dflash_assets.generation.slot_scheduler import SlotScheduler

        if self._slots is None:
            assert self._loaded is not None
            self._slots = SlotScheduler(self.slot_decoders, self._loaded.worker, overlap=self.slot_overlap)
            self._slot_runs = self._slots.stats
        return self._slots

    async def prepare_slots(self) -> float:
        """With ``cache="slots"``: build the slot decoders and capture their decode-step graphs now (the first
        request would otherwise), so that what follows is timed without this one-time cost; returns its seconds
        (0.0 for another cache, or when done already)."""
        if self.cache != "slots":
            return 0.0
        await self.open()
        return await self._slot_scheduler().prepare()

    def _tiers(self) -> list[tuple[int, int]]:
        """(slots, positions) of each slot decoder, shortest first: ``max_batch_rows`` of ``slot_len``, then
        ``slot_tiers`` (default: a sixteenth of the rows, at least 4, of the context length), none past the
        model's context length."""
        context = self.context_length or self.slot_len
        tiers = [(self.max_batch_rows, min(self.slot_len, context))]
        extra = self.slot_tiers if self.slot_tiers is not None else [(max(4, self.max_batch_rows // 16), context)]
        for n, length in sorted(extra, key=lambda t: t[1]):
            if n > 0 and min(length, context) > tiers[-1][1]:
                tiers.append((n, min(length, context)))
        return tiers

    def slot_decoders(self, **options) -> list:
        """The slot decoders of ``_tiers`` for this engine's model (on the model's worker thread); `options`
        go to each `SlotDecoder` (e.g. ``row_lengths``)."""
        from dflash_assets.generation.slot_decoding import SlotDecoder

        assert self.tok is not None
        pad = min(self.tok.stop_ids) if self.tok.stop_ids else 0
        tiers = self._tiers()
        _log.info("%s: slot decoding in %s", self.url, " and ".join(f"{n} slots of {length} positions"
                                                                     for n, length in tiers))
        return [SlotDecoder(self.model, slots=n, slot_len=length, pad_id=pad,
                            prefill_tokens=max(self.max_batch_tokens, length), **options) for n, length in tiers]

    def decoder_totals(self) -> dict[str, float]:
        """The slot decoders' running totals (`Engine.decoder_totals`): every build's decoders summed."""
        keys = ("steps", "step_seconds", "prefills", "prefill_seconds", "new_tokens")
        if not self._slot_runs:
            return {}
        return {k: sum(getattr(stats, k) for build in self._slot_runs for stats in build) for k in keys}

    def slot_stats(self) -> dict | None:
        """What the slot decoder did so far (None unless cache="slots" decoded something)."""
        if not self._slot_runs:
            return None
        runs = [stats.as_dict(n) for stats, (n, _) in zip(self._slot_runs[-1], self._tiers())]
        total = {k: sum(r[k] for r in runs) for k in ("steps", "prefills", "prefill_rows", "new_tokens", "requests")}
        total.update(step_seconds=round(sum(r["step_seconds"] for r in runs), 3),
                     prefill_seconds=round(sum(r["prefill_seconds"] for r in runs), 3),
                     prefill_host_seconds=round(sum(r["prefill_host_seconds"] for r in runs), 3),
                     occupancy=runs[0]["occupancy"], cuda_graph=runs[0]["cuda_graph"])
        return {**total, "decoders": runs}
