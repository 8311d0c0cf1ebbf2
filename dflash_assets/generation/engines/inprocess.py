"""The in-process engine: ``model.generate`` on this host, the requests in flight batched, on a host that has
nothing else (a CPU box, one GPU without a server). Explicit opt-in only (an endpoint of kind ``transformers`` in
the fleet config); nothing ever falls back to it.

``TransformersEngine`` is built from its parts: the shared model (``engines.inprocess_models``), the batched
generate (``engines.inprocess_batching``) and the other cache modes (``engines.inprocess_caches``); here are its
settings, its probe and the one ``chat`` that sends a request to the part its cache mode names, its prompt
encoded with the others of its pass of the event loop (`engines.prompt_encoder`).

Reads: a model directory and the target's chat object (through its parts). Writes nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Sequence

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.engines.inprocess_batching import BatchedGenerate, _BatchedRequest
from dflash_assets.generation.engines.inprocess_caches import ContinuousCache, SlotCache
from dflash_assets.generation.engines.inprocess_models import SharedModel, _LoadedModel
from dflash_assets.generation.engines.prompt_encoder import PromptEncoder
from dflash_assets.generation.engines.protocol import ChatResult, Engine, EngineProbe


def slot_busy_concurrency(max_concurrency: int, rows: int) -> int:
    """Requests in flight that keep a slot engine of `rows` main slots busy: twice its rows (more only wait in its
    queue), at most `max_concurrency`."""
    return min(max_concurrency, 2 * rows)


class TransformersEngine(SharedModel, BatchedGenerate, ContinuousCache, SlotCache, Engine):
    """In-process ``model.generate`` on this host, batching the requests in flight.

    Requests that arrive while a batch runs wait for the next one; each batch is one
    left-padded ``generate`` over up to ``max_batch_rows`` requests (default: ``max_concurrency``,
    the requests in flight; more in flight than rows lets a batch fill from one width) with the same
    generation settings and similar prompt lengths, at most ``max_batch_tokens``
    padded prompt tokens in all (one long prompt padded across 32 rows would cost
    32 long prompts), so the fleet's concurrent requests become batch rows (see
    BENCHMARKS.md for the gain over one at a time).
    A row ends at its first stop id. With ``seed`` set the sampled tokens depend on
    the batch a request lands in, so a seed does not make a row reproducible here
    (``seed_honoured`` is False unless configured). Explicit opt-in only.

    ``cache="static"`` (for a GPU) decodes into transformers' static KV cache, whose decode
    step transformers compiles (CUDA graphs) on CUDA: each batch is padded to a few shapes
    (``static_batch_shape``: rows to a bucket with copies of its first row, the prompt width
    to a power of two from 256 to 2,048 with left padding), so compiles are few and then reused. The
    dynamic cache's step costs ~65 ms at any batch size on an H200 for SmolLM2-135M in
    bfloat16; the compiled static one 10 ms at 256 rows (BENCHMARKS.md).

    ``cache="continuous"`` hands the requests to transformers' continuous batching
    (``model.init_continuous_batching``: a paged KV cache; transformers decides on CUDA graphs and the
    attention kernel): each request joins the running batch as soon as a row is free and leaves it at its
    stop id, so a batch never runs part-empty until its longest row ends, and a conversation's next turn
    starts while other rows still decode. Rows per step: ``max_batch_rows``. Sampling: temperature, top_p
    and top_k only (``min_p`` and ``repetition_penalty`` are refused, not dropped). On an H200 without a
    flash-attention package it makes 1.33K tok/s through the completions stage against static's 4.5-5.1K
    (BENCHMARKS.md): SDPA needs a mask there, and transformers then captures no CUDA graphs, so
    static stays the GPU path on such a host.

    ``cache="slots"`` (for a GPU) decodes with ``generation.slot_decoding``: ``max_batch_rows`` fixed KV-cache
    slots of ``slot_len`` positions, a request prefilled into a free slot as soon as one frees up (in groups), every
    live row advanced by one token per step, and on CUDA that step replayed as one captured CUDA graph. Short
    answers and later turns keep the batch full instead of waiting for a batch's longest row. Greedy tokens are
    those of an unpadded ``generate``; sampling: temperature, top_p and top_k only. A request whose prompt plus
    ``max_new_tokens`` exceed ``slot_len`` decodes in the first of ``slot_tiers`` ((slots, positions) pairs,
    stepped beside the others) that holds it; default: a sixteenth of the slots, at least 4, of the model's whole
    context length; ``[]``: it runs through the dynamic-cache batches instead, after the slots are idle.
    Full-attention models only (a hybrid or sliding-window model is refused when the decoders are built). The main
    and the long slots step concurrently, each decoder on a CUDA stream of its own (`SlotScheduler`'s ``overlap``;
    the same tokens; 1.2-1.35x the tokens/s of stepping them in turn on an H100, BENCHMARKS.md);
    ``slot_overlap=False`` steps them in turn.

    ``attention="packed_gqa"`` decodes with ``generation.packed_gqa``: the query heads of a KV group share
    one read of the cache instead of Transformers' SDPA copying it to every head, which it does under
    ``torch.compile`` (the static decode step); same tokens, 3.1-3.5x faster per layer on an H200
    (BENCHMARKS.md); a whole warm ``generate`` is not measured.

    ``static_cache_len="per_call"`` sizes each call's static cache to that call (its padded prompt width plus
    ``max_new_tokens``) instead of transformers' default, the largest call the model has run (which spares a
    recompile): each decode step attends over the whole static cache, so after one 2,048-wide call every
    256-wide call pays for 2,304 positions. Same tokens (the padding is masked); the cost is a compile or
    CUDA-graph capture per cache length (at most one per width bucket); not measured on a GPU.

    The loaded model is shared within the process (``_LOADED``): engines of the same model, device,
    dtype, cache and attention reuse its weights, its compiled graphs and its one worker thread, and it stays
    loaded after they close until another model is asked for (``release_idle_models`` frees it).
    """

    kind = "transformers"

    def __init__(self, model_path: str | os.PathLike, *, device: str = "cpu", dtype: str = "auto", tokenizer: Any = None,
                 max_batch_tokens: int = 8192, cache: str = "dynamic", max_batch_rows: int | None = None,
                 attention: str = "sdpa", static_cache_len: str = "largest", slot_len: int = 4096,
                 slot_tiers: Sequence[tuple[int, int]] | None = None, slot_overlap: bool = True, **kwargs):
        super().__init__(f"inprocess://{Path(model_path)}", **kwargs)
        self.max_batch_rows = max_batch_rows or self.max_concurrency
        if cache not in ("dynamic", "static", "continuous", "slots"):
            raise ValueError(f"cache must be 'dynamic', 'static', 'continuous' or 'slots', not {cache!r}")
        if attention not in ("sdpa", "packed_gqa"):
            raise ValueError(f"attention must be 'sdpa' or 'packed_gqa', not {attention!r}")
        if attention != "sdpa" and cache == "continuous":
            raise ValueError("attention='packed_gqa' is for the dynamic and static caches; continuous batching "
                             "chooses its own attention kernel")
        if static_cache_len not in ("largest", "per_call"):
            raise ValueError(f"static_cache_len must be 'largest' or 'per_call', not {static_cache_len!r}")
        self.max_batch_tokens = max_batch_tokens
        self.cache = cache
        self.attention = attention
        self.static_cache_len = static_cache_len
        self.slot_len = int(slot_len)
        self.slot_tiers = None if slot_tiers is None else [(int(n), int(length)) for n, length in slot_tiers]
        self.slot_overlap = bool(slot_overlap)
        self._slots: Any = None  # the SlotScheduler (cache="slots"), built at the first request
        self._slot_runs: list = []  # its decoders' SlotStats (kept after close)
        self.model_path = str(model_path)
        self.device = device
        self.dtype = dtype
        self._tokenizer = tokenizer
        self.tok: ChatTokenizer | None = None
        self.prompt_encoder: PromptEncoder | None = None  # the prompts' ids, batched per pass of the event loop
        self.model = None
        self._loaded: _LoadedModel | None = None
        self._loaded_key: tuple = ()
        self._pending: list[_BatchedRequest] = []
        self._batcher: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # rows of each generate call, in order (for logs and tests)
        self.batch_shapes: list[tuple[int, int]] = []  # (rows, prompt width) each generate call ran at, padding included
        self.batch_seconds: list[float] = []  # wall time of each generate call (compiling included)
        self.batch_steps: list[int] = []  # decode steps of each generate call (new tokens of its longest row)
        self.reused_model = False  # whether open() found the model loaded already (by an earlier engine)

    @property
    def busy_concurrency(self) -> int:
        """The slots cache: twice its rows (more in flight only wait in its queue); else ``max_concurrency``."""
        if self.cache == "slots":
            return slot_busy_concurrency(self.max_concurrency, self.max_batch_rows)
        return self.max_concurrency

    async def close(self) -> None:
        if self._batcher is not None and not self._batcher.done():
            self._batcher.cancel()
        self._slots = None  # its decoder (and KV cache) goes once its requests in flight are answered
        loaded = self._loaded
        if loaded is not None and loaded.continuous is not None and loaded.users == 1:
            # the last engine of this model: stop the manager's (non-daemon) thread and free its cache; queued on
            # the worker, so an engine opening meanwhile starts a new manager after this one stopped
            await asyncio.get_running_loop().run_in_executor(loaded.worker, loaded.stop_continuous)
        self.model = None
        self._release()

    async def probe(self) -> EngineProbe:
        t0 = time.perf_counter()
        try:
            await self.open()
        except Exception as e:  # noqa: BLE001 - reported in the probe table
            return EngineProbe(self.url, self.kind, False, error=f"{type(e).__name__}: {e}")
        self.served_model = self.model_path
        return EngineProbe(self.url, self.kind, True, (self.model_path,), time.perf_counter() - t0)

    async def chat(self, messages: Sequence[dict], generation: GenerationConfig, *,
                   tools: Sequence[dict] | None = None) -> ChatResult:
        await self.open()
        assert self.tok is not None
        if self.prompt_encoder is None:
            self.prompt_encoder = PromptEncoder(self.tok.encode, self.tok.encode_many)
        ids = await self.prompt_encoder.encode(self.tok.render(messages, generation.enable_thinking, tools))
        generation, cut = self.fit_to_context(len(ids), generation)
        stop_ids = sorted(self.tok.stop_ids | set(generation.stop_token_ids))
        t0 = time.perf_counter()
        if self.cache == "continuous":
            out = await self._continuous_generate(ids, generation, stop_ids)
        elif self.cache == "slots" and len(ids) + generation.max_new_tokens <= self._tiers()[-1][1]:
            out = await self._slot_generate(ids, generation, stop_ids)
        else:  # the batched generate (a prompt too long for a slot decodes there on the dynamic cache)
            out = await self._batched_generate(ids, generation, stop_ids)
        finish = "stop" if out and out[-1] in stop_ids else "length"
        reasoning, content = self.tok.split_output_ids(out, generation.enable_thinking, generation.stop_token_ids)
        return ChatResult(content, reasoning, finish, len(ids), len(out), time.perf_counter() - t0, self.url,
                          self.model_path, max_new_tokens_cut=cut)
