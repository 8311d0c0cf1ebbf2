"""Decoding into fixed KV-cache slots with continuous refill; on CUDA the decode step is one captured graph.

A `SlotDecoder` holds a KV cache of `slots` rows x `slot_len` positions for a causal LM whose every layer is
full attention (Transformers' modeling code calls this module's cache from its attention). A request takes a
free slot: a batched, right-padded prefill writes its prompt's keys and values at positions 0..n-1 and samples
its first token. Every decode step then feeds each live row its last token at the row's own position, and a row
that stops (a stop id, its ``max_new_tokens``, or the slot's end) frees its slot for the next request before the
next step. So short answers and a conversation's later turns never leave a batch part-empty until its longest
row ends, as one ``generate`` call per batch does.

On CUDA the decode step (the model's forward over (rows, 1) tokens, the attention mask built from each row's
position, the logits) is captured as a CUDA graph and replayed: a small target's step is then bound by the GPU,
not by Python launching a few hundred kernels. A step computes the smallest view of the cache that holds every
live row: over positions, a power of two from 256 (or the whole slot) past every live row's position; over rows,
an eighth, a quarter, a half or all of the slots, past the last live one (requests take the lowest free slots,
so rows gather at the front as a run drains or a long tier holds a few rows). One graph per (rows, positions)
view. With ``row_lengths=True`` (a model whose attention is `generation.packed_gqa`'s) the step attends through a
flex-attention block mask of each row's own length instead: a row reads the key blocks of 128 positions up to its
position and no further (the positions view is then the whole slot). Not the default: on an H100 the positions
views decode faster at chat lengths, most of all in the long tiers' few rows (BENCHMARKS.md, "In-process engine").
Sampling (greedy, or temperature / top-p / top-k per row) runs after the graph; the sampled tokens and the rows'
next positions are written on the device, so the host reads the tokens once a step and writes only what admissions
and ended rows change. Greedy decoding gives the tokens an unpadded ``generate`` of each prompt alone gives, up to
floating-point ties (tested on CPU).

`generation.slot_scheduler.SlotScheduler` feeds decoders from an asyncio loop.

Reads a loaded model; writes nothing. Imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KEY_BLOCK = 128  # positions per key block of the row-lengths mask (flex attention's block)
_CURRENT_STREAM = contextlib.nullcontext()  # a decoder without a stream of its own queues on the current one

__all__ = ["KEY_BLOCK", "SlotDecoder", "SlotRequest", "SlotStats", "kv_bytes_per_position", "slots_for_memory",
           "unsupported_reason"]

_log = logging.getLogger(__name__)


@dataclass
class SlotRequest:
    """One prompt to continue. ``deliver(request, new_ids, finish)`` is called on the decoding thread when the
    row ends: ``new_ids`` with the stop id that ended it, ``finish`` "stop" or "length"."""

    ids: list[int]
    max_new_tokens: int
    stop_ids: Sequence[int] = ()
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    deliver: Callable[[SlotRequest, list[int], str], None] | None = None
    fail: Callable[[BaseException], None] | None = None  # called instead of deliver when decoding fails
    tag: Any = None


@dataclass
class SlotStats:
    """What a decoder did: decode steps and their wall seconds, prefills, tokens made, live rows per step."""

    steps: int = 0
    step_seconds: float = 0.0  # from each step's launch to its finish (decoders stepped overlapped: they overlap)
    prefills: int = 0
    prefill_rows: int = 0
    prefill_seconds: float = 0.0
    prefill_host_seconds: float = 0.0  # of it, until the forward is queued (a wait on the device inside counts)
    new_tokens: int = 0
    live_row_steps: int = 0  # sum over steps of the rows live in it (occupancy = live_row_steps / (steps * slots))
    computed_row_steps: int = 0  # sum over steps of the rows the step computed (its row view)
    position_row_steps: int = 0  # sum over steps of the live rows' positions (the keys each row attends over)
    graph: bool = False
    requests: int = 0

    def as_dict(self, slots: int) -> dict:
        occupancy = self.live_row_steps / (self.steps * slots) if self.steps else 0.0
        computed = self.computed_row_steps / (self.steps * slots) if self.steps else 0.0
        mean_position = self.position_row_steps / self.live_row_steps if self.live_row_steps else 0.0
        return {"steps": self.steps, "step_seconds": round(self.step_seconds, 3), "prefills": self.prefills,
                "prefill_rows": self.prefill_rows, "prefill_seconds": round(self.prefill_seconds, 3),
                "prefill_host_seconds": round(self.prefill_host_seconds, 3),
                "new_tokens": self.new_tokens, "requests": self.requests, "occupancy": round(occupancy, 4),
                "computed_rows": round(computed, 4), "mean_position": round(mean_position, 1),
                "cuda_graph": self.graph}


def unsupported_reason(config: Any) -> str | None:
    """Why a model of this config cannot decode in slots (None when it can): every layer must be full causal
    attention with its keys and values cached per position (no sliding window, no linear attention)."""
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)} (slot decoding caches full-attention layers only)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return f"a sliding window of {text.sliding_window}"
    if getattr(text, "final_logit_softcapping", None):
        return "logit soft-capping"
    return None


def _text_config(model: Any) -> Any:
    return getattr(model.config, "get_text_config", lambda: model.config)()


def kv_bytes_per_position(model: Any) -> int:
    """Bytes of keys and values one cached position of one row takes in `model`'s dtype."""
    cfg = _text_config(model)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()


def slots_for_memory(per_position_bytes: int, slot_len: int, memory_bytes: int, *, share: float = 0.45,
                     most: int = 1024, fewest: int = 8) -> int:
    """The most slots (a power of two between `fewest` and `most`) whose KV cache of `slot_len` positions, at
    `per_position_bytes` a position (`kv_bytes_per_position`), fits in `share` of `memory_bytes`."""
    fit = int(share * memory_bytes) // max(1, per_position_bytes * slot_len)
    slots = fewest
    while slots * 2 <= min(fit, most):
        slots *= 2
    return slots


def _cache_kwarg(model: Any) -> str:
    """The name the model's forward takes its cache under (Transformers renamed ``past_key_values`` to ``cache``)."""
    import inspect

    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class _SlotCache:
    """The slots' keys and values, one (slots, kv_heads, slot_len, head_dim) pair per layer; Transformers'
    attention calls `update` with a layer's new keys and values and attends over what it returns."""

    is_compileable = False

    def __init__(self, layers: int, slots: int, kv_heads: int, slot_len: int, head_dim: int, dtype, device):
        import torch

        shape = (slots, kv_heads, slot_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows = torch.arange(slots, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # where each row's step writes
        self.prefill_slots: Any = None  # set during a padded prefill: which slots its rows fill
        self.prefill_at: Any = None  # set during a packed prefill: (slot, position) of each of its tokens
        self.view = slot_len  # positions a decode step attends over (every live row's position is below it)
        self.row_view = slots  # slots a decode step computes, from the first (every live row is below it)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.prefill_at is not None:  # (1, kv_heads, tokens, dim): the prompts one after another
            slot, position = self.prefill_at
            self.keys[layer_idx][slot, :, position] = key_states[0].transpose(0, 1)
            self.values[layer_idx][slot, :, position] = value_states[0].transpose(0, 1)
            return key_states, value_states
        if self.prefill_slots is not None:  # (rows, kv_heads, width, dim): the prompts from position 0
            width = key_states.shape[2]
            self.keys[layer_idx][self.prefill_slots, :, :width] = key_states
            self.values[layer_idx][self.prefill_slots, :, :width] = value_states
            return key_states, value_states
        r = self.row_view
        self.keys[layer_idx][self.rows[:r], :, self.positions[:r]] = key_states[:, :, 0]
        self.values[layer_idx][self.rows[:r], :, self.positions[:r]] = value_states[:, :, 0]
        return self.keys[layer_idx][:r, :, :self.view], self.values[layer_idx][:r, :, :self.view]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some modeling code; positions come explicitly
        return 0


class SlotDecoder:
    """Continuous-refill decoding of `model` in `slots` rows of `slot_len` cached positions (see the module).

    Not thread-safe: one thread calls `submit` and `run` (the engine's model worker). ``cuda_graph=None`` captures
    the decode step on CUDA and runs it eagerly elsewhere. ``row_lengths=True`` attends over each row's own
    length (a flex block mask; the model's attention `generation.packed_gqa`'s, the slot a multiple of
    `KEY_BLOCK` positions); the default attends over the positions view. ``packed_prefill=None`` prefills the
    admitted prompts one after another in one row when the model's attention is packed_gqa's (False: padded
    rows). ``prefill_tokens`` bounds one prefill's tokens (padding included); a prefill runs when no row is live,
    when it fills at least a quarter of the slots, or `admit_every` steps after the last one, so it admits requests
    in groups rather than one per step, also while they trickle in (as a stage submits them).
    """

    def __init__(self, model: Any, *, slots: int, slot_len: int, pad_id: int = 0, prefill_tokens: int = 16384,
                 admit_every: int = 32, cuda_graph: bool | None = None, row_lengths: bool = False,
                 packed_prefill: bool | None = None):
        import torch

        reason = unsupported_reason(model.config)
        if reason:
            raise ValueError(f"slot decoding needs full attention in every layer; this model has {reason}")
        cfg = _text_config(model)
        self.model = model
        self.slots, self.slot_len, self.pad_id = int(slots), int(slot_len), int(pad_id)
        self.prefill_tokens = max(int(prefill_tokens), self.slot_len)
        self.admit_every = int(admit_every)
        self._cache_kwarg = _cache_kwarg(model)
        self.device = next(model.parameters()).device
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.cache = _SlotCache(cfg.num_hidden_layers, self.slots, kv_heads, self.slot_len, head_dim, dtype,
                                self.device)
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.head = model.get_output_embeddings()
        self.use_graph = (self.device.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        self.row_lengths = self._row_lengths(row_lengths)
        # packed prefills (the prompts one after another, no padding) through packed_gqa's varlen path
        from dflash_assets.generation.packed_gqa import ATTENTION_NAME

        can_pack = getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
        if packed_prefill and not can_pack:
            raise ValueError(f"packed prefills need the model's attention to be {ATTENTION_NAME!r}")
        self.packed_prefill = can_pack if packed_prefill is None else bool(packed_prefill)
        # (rows, positions) view -> (CUDA graph of the decode step over it, its logits)
        self.graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._pool: Any = None
        n, dev = self.slots, self.device
        self.tokens = torch.full((n, 1), self.pad_id, dtype=torch.long, device=dev)  # fed at the next step
        self.key_positions = torch.arange(self.slot_len, device=dev)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
        self.logits: Any = None  # (row view, vocab) of the last step
        # per-slot state on the host (the rows' requests and new tokens) and on the device (which rows are live,
        # sampling settings)
        self.live: list[SlotRequest | None] = [None] * n
        self.new_ids: list[list[int]] = [[] for _ in range(n)]
        self.live_mask = torch.zeros(n, dtype=torch.long, device=dev)  # 1 where a row is live: its position steps
        self.sampled_rows = 0  # live rows that draw (temperature > 0); none: greedy without asking the device
        self.temperature = torch.zeros(n, device=dev)
        self.top_p = torch.ones(n, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.pending: deque[SlotRequest] = deque()
        self.stats = SlotStats()
        self._since_admit = 0
        self.stream: Any = None  # a CUDA stream of its own (`SlotScheduler(overlap=True)`), else the current

    def _row_lengths(self, asked: bool) -> bool:
        if not asked:
            return False
        from dflash_assets.generation.packed_gqa import ATTENTION_NAME
        from dflash_assets.torch_compile import block_mask_type

        why = None
        if getattr(self.model.config, "_attn_implementation", None) != ATTENTION_NAME:
            why = f"the model's attention is not {ATTENTION_NAME!r} (TransformersEngine(attention='packed_gqa'))"
        elif block_mask_type() is None:
            why = "this torch has no flex attention"
        elif self.slot_len % KEY_BLOCK:
            why = f"a slot of {self.slot_len} positions is not a multiple of {KEY_BLOCK}"
        if why:
            raise ValueError(f"row_lengths needs a flex-attention block mask: {why}")
        return True

    # -- requests ----------------------------------------------------------------------------------------------

    def submit(self, request: SlotRequest) -> None:
        """Queue `request`; it starts at the next prefill. A prompt that leaves no room to decode is refused."""
        if not request.ids:
            raise ValueError("an empty prompt has nothing to continue")
        if len(request.ids) >= self.slot_len:
            raise ValueError(f"a prompt of {len(request.ids)} tokens does not fit a slot of {self.slot_len} positions")
        self.pending.append(request)
        self.stats.requests += 1

    @property
    def live_rows(self) -> int:
        return sum(r is not None for r in self.live)

    def idle(self) -> bool:
        return not self.pending and self.live_rows == 0

    def run(self) -> None:
        """Decode until no request is pending or live."""
        while not self.idle():
            self.step()

    # -- one step ----------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit pending requests if enough slots are free, then advance every live row by one token."""
        launched = self.launch()
        if launched is not None:
            self.finish(launched)

    def launch(self) -> tuple | None:
        """A step's first half: admit pending requests if enough slots are free, then queue the decode step and
        the sampling of every live row on the device (on `stream` when one is set) without waiting for them.
        Returns what `finish` needs, None when no row is live."""
        if self.stream is not None:  # after what the current stream queued for this decoder (its capture)
            import torch

            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            free = self.slots - self.live_rows
            if self.pending and free and (free == self.slots or self._since_admit >= self.admit_every
                                          or min(free, len(self.pending)) >= max(1, self.slots // 4)):
                self._admit()
                self._since_admit = 0
            live = [slot for slot, req in enumerate(self.live) if req is not None]
            if not live:
                return None
            t0 = time.perf_counter()
            self._set_views(live)
            self._decode()
            r = self.cache.row_view
            nxt = self._sample(self.logits, slice(0, r), self.sampled_rows > 0)
            # every computed row is fed its token and the live ones step a position; the rows that end are reset
            self.tokens[:r, 0] = nxt
            self.cache.positions[:r] += self.live_mask[:r]
            return live, nxt, t0

    def finish(self, launched: tuple) -> None:
        """A step's second half: read the sampled tokens (waiting for this decoder's step alone), hand them to
        their rows and end the rows that stop."""
        live, nxt, t0 = launched
        r = nxt.shape[0]
        with self._on_stream():
            nxt = nxt.tolist()
            self.stats.steps += 1
            self.stats.live_row_steps += len(live)
            self.stats.computed_row_steps += r
            self._advance([(slot, nxt[slot]) for slot in live], stepped=True)
        self._since_admit += 1
        self.stats.step_seconds += time.perf_counter() - t0

    def _on_stream(self):
        """The context a step's device work is queued in: the decoder's own stream, else the current one."""
        if self.stream is None:
            return _CURRENT_STREAM
        import torch

        return torch.cuda.stream(self.stream)

    def _advance(self, row_tokens: list[tuple[int, int]], *, stepped: bool) -> None:
        """Append each (slot, token) to its row and end the rows that stop. After a prefill (not `stepped`) the
        rows that go on are fed their token (their position is the prompt's end already); a decode step fed them
        on the device."""
        import torch

        ended, feed = [], []
        for slot, tok in row_tokens:
            req, ids = self.live[slot], self.new_ids[slot]
            ids.append(tok)
            if tok in req.stop_ids:
                ended.append((slot, "stop"))
            elif len(ids) >= req.max_new_tokens or len(req.ids) + len(ids) >= self.slot_len:
                ended.append((slot, "length"))
            elif not stepped:
                feed.append((slot, tok))
        self.stats.new_tokens += len(row_tokens)
        if feed:
            idx = torch.tensor([s for s, _ in feed], device=self.device)
            self.tokens[idx, 0] = torch.tensor([t for _, t in feed], device=self.device)
        if ended:
            self._end(ended)

    def _end(self, ended: list[tuple[int, str]]) -> None:
        """Free the slots of the rows that ended and hand each its answer."""
        import torch

        idx = torch.tensor([slot for slot, _ in ended], device=self.device)
        self.cache.positions[idx] = 0
        self.tokens[idx, 0] = self.pad_id
        self.live_mask[idx] = 0
        for slot, finish in ended:
            req, ids = self.live[slot], self.new_ids[slot]
            self.live[slot], self.new_ids[slot] = None, []
            self.sampled_rows -= req.temperature > 0
            if req.deliver is not None:
                req.deliver(req, ids, finish)

    # -- prefill -----------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Prefill the oldest pending requests into the free slots: sorted by length and cut into forwards of at
        most `prefill_tokens` tokens (packed: the prompts' own; padded: rows x the widest, so that one long
        prompt pads only prompts of its own size)."""
        free = [s for s, r in enumerate(self.live) if r is None]
        admitted = sorted((self.pending.popleft() for _ in range(min(len(free), len(self.pending)))),
                          key=lambda r: len(r.ids))
        while admitted:
            group = [admitted.pop(0)]
            total = len(group[0].ids)
            while admitted and (total + len(admitted[0].ids) if self.packed_prefill
                                else len(admitted[0].ids) * (len(group) + 1)) <= self.prefill_tokens:
                group.append(admitted.pop(0))  # sorted: the newest row is the widest
                total += len(group[-1].ids)
            slots, free = free[:len(group)], free[len(group):]
            self._prefill(group, slots)

    def _prefill(self, group: list[SlotRequest], slots: list[int]) -> None:
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.packed_prefill:
                try:
                    last = self._prefill_packed(group, slots)
                except Exception as e:  # noqa: BLE001 - varlen attention depends on the torch build
                    _log.warning("slot decoding: a packed prefill failed (%s: %s); prefilling padded rows instead",
                                 type(e).__name__, e)
                    self.packed_prefill = False
            if not self.packed_prefill:
                last = self._prefill_padded(group, slots)
            logits = self.head(last).float()
        self.stats.prefill_host_seconds += time.perf_counter() - t0  # the forward queued (unless it waited)
        lengths = torch.tensor([len(r.ids) for r in group], device=self.device)
        idx = torch.tensor(slots, device=self.device)
        self.temperature[idx] = torch.tensor([float(r.temperature) for r in group], device=self.device)
        self.top_p[idx] = torch.tensor([float(r.top_p) for r in group], device=self.device)
        self.top_k[idx] = torch.tensor([int(r.top_k or 0) for r in group], device=self.device)
        first = self._sample(logits, idx, any(r.temperature > 0 for r in group)).tolist()
        self.cache.positions[idx] = lengths
        self.live_mask[idx] = 1
        for slot, req in zip(slots, group):
            self.live[slot], self.new_ids[slot] = req, []
            self.sampled_rows += req.temperature > 0
        self.stats.prefills += 1
        self.stats.prefill_rows += len(group)
        self.stats.prefill_seconds += time.perf_counter() - t0
        self._advance(list(zip(slots, first)), stepped=False)  # a one-token answer ends here

    def _prefill_padded(self, group: list[SlotRequest], slots: list[int]):
        """The prompts as right-padded rows (widths in steps of 64: few shapes, and attention kernels that want
        aligned key lengths take the mask); the hidden state of each prompt's last token."""
        import torch

        width = min(-(-len(group[-1].ids) // 64) * 64, self.slot_len)
        lengths = torch.tensor([len(r.ids) for r in group], device=self.device)
        ids = torch.tensor([r.ids + [self.pad_id] * (width - len(r.ids)) for r in group], device=self.device)
        keys = torch.arange(width, device=self.device)
        # causal, and no key past the row's prompt (a padding query then sees its own prompt only: never empty)
        mask = (keys[None, :] <= keys[:, None])[None] & (keys[None, None, :] < lengths[:, None, None])
        self.cache.prefill_slots = torch.tensor(slots, device=self.device)
        try:
            hidden = self.base(input_ids=ids, attention_mask=mask[:, None], position_ids=keys[None].expand(
                len(group), width), **{self._cache_kwarg: self.cache}, use_cache=True).last_hidden_state
        finally:
            self.cache.prefill_slots = None
        return hidden[torch.arange(len(group), device=self.device), lengths - 1]

    def _prefill_packed(self, group: list[SlotRequest], slots: list[int]):
        """The prompts one after another in one row, each attending inside its own (``cu_seq_lens``: flash varlen
        on CUDA), no padding; the hidden state of each prompt's last token."""
        import torch

        from dflash_assets.target_model.packed_attention import packed_row

        dev = self.device
        lengths = [len(r.ids) for r in group]
        ids = torch.tensor([t for r in group for t in r.ids], device=dev)[None]
        row = packed_row(lengths, dev)
        slot = torch.tensor(slots).repeat_interleave(torch.tensor(lengths)).to(dev)
        self.cache.prefill_at = slot, row["position_ids"][0]
        try:
            # a 4-D mask stops Transformers from building a (tokens x tokens) one; varlen attention ignores it
            hidden = self.base(input_ids=ids, attention_mask=self._no_mask, **row, **{self._cache_kwarg: self.cache},
                               use_cache=True).last_hidden_state
        finally:
            self.cache.prefill_at = None
        return hidden[0, row["cu_seq_lens_q"][1:].long() - 1]

    # -- decode ------------------------------------------------------------------------------------------------

    def _set_views(self, live: list[int]) -> None:
        """The step's views of the cache (`live`: the live rows' slots, ascending). Positions: the smallest power
        of two from 256 (or the whole slot) past every live row's position. Rows: the smallest of an eighth, a
        quarter, a half or all of the slots past the last live one."""
        ends = [len(self.live[s].ids) + len(self.new_ids[s]) for s in live]
        top = max(ends)
        self.stats.position_row_steps += sum(ends) - len(ends)
        view = 256
        while view < top:
            view *= 2
        self.cache.view = self.slot_len if self.row_lengths else min(view, self.slot_len)
        self.cache.row_view = next(r for r in self._row_views() if r > live[-1])

    def _row_views(self) -> list[int]:
        """The rows a step may compute, fewest first: an eighth, a quarter, a half and all of the slots (those
        that are whole numbers)."""
        views = [self.slots]
        while views[-1] % 2 == 0 and views[-1] // 2 >= max(1, self.slots // 8):
            views.append(views[-1] // 2)
        return views[::-1]

    def _forward_step(self):
        """The decode step's tensors: logits (rows, vocab) of the next token of each row of the cache's row view
        (graph-capturable), attending over its first ``cache.view`` positions."""
        r = self.cache.row_view
        positions = self.cache.positions[:r]
        if self.row_lengths:
            mask = self._length_mask(positions)
        else:
            mask = (self.key_positions[None, :self.cache.view] <= positions[:, None])[:, None, None, :]
        hidden = self.base(input_ids=self.tokens[:r], attention_mask=mask, position_ids=positions[:, None],
                           **{self._cache_kwarg: self.cache}, use_cache=True).last_hidden_state
        return self.head(hidden[:, -1])

    def _length_mask(self, positions):
        """A flex block mask over the positions view in which each row sees its keys up to its position, and
        the key blocks past it are not computed at all (graph-capturable: shapes fixed by the views)."""
        import torch

        from dflash_assets.torch_compile import block_mask_from_kv_blocks

        r, n = positions.shape[0], self.cache.view // KEY_BLOCK
        blocks = (positions // KEY_BLOCK + 1).clamp(max=n).to(torch.int32).view(r, 1, 1)
        order = torch.arange(n, dtype=torch.int32, device=positions.device).expand(r, 1, 1, n).contiguous()

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= positions[b]

        return block_mask_from_kv_blocks(blocks, order, BLOCK_SIZE=KEY_BLOCK, mask_mod=mask_mod,
                                         seq_lengths=(1, self.cache.view), forward_only=True)

    def _decode(self) -> None:
        import torch

        with torch.inference_mode():
            if not self.use_graph:
                self.logits = self._forward_step()
                return
            key = (self.cache.row_view, self.cache.view)
            if key not in self.graphs:
                self._capture()
            graph, self.logits = self.graphs[key]
            graph.replay()

    def capture_views(self) -> float:
        """Capture the decode step's graph at every (rows, positions) view now, before any request (a step
        otherwise captures its view the first time it meets it, compiling flex attention there for row
        lengths); returns the seconds it took. Does nothing off CUDA graphs. Should rows of their own length
        fail to compile or capture here, the decoder logs why and attends over positions views instead.

        Under inference mode, as every step runs: with autograd on, compiling flex attention plans a backward,
        which a forward-only block mask cannot have."""
        import torch

        if not self.use_graph or not self.idle():
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            try:
                self._capture_all()
            except Exception as e:  # noqa: BLE001 - flex attention under a graph depends on the torch build
                if not self.row_lengths:
                    raise
                _log.warning("slot decoding: rows of their own length failed to capture (%s: %s); attending over "
                             "positions views instead", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                _log.debug("slot decoding: the capture's error in full", exc_info=True)
                self.row_lengths, self.graphs, self._pool = False, {}, None
                torch.cuda.synchronize()
                self._capture_all()
        return time.perf_counter() - t0

    def _capture_all(self) -> None:
        views = [self.slot_len] if self.row_lengths else sorted(
            {min(256 << k, self.slot_len) for k in range(max(1, self.slot_len.bit_length()))})
        for r in self._row_views():
            for view in views:
                self.cache.row_view, self.cache.view = r, view
                if (r, view) not in self.graphs:
                    self._capture()

    def _capture(self) -> None:
        """Capture the decode step at the cache's view as a CUDA graph (after warm-up runs on a side stream, as CUDA
        graphs need); the graphs of all views share one memory pool (one replays at a time)."""
        import torch

        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        saved = self.cache.positions.clone(), self.tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward_step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward_step()
        # the warm-up and capture wrote keys at the live rows' positions: the same values the replay writes next
        self.cache.positions.copy_(saved[0])
        self.tokens.copy_(saved[1])
        self.graphs[(self.cache.row_view, self.cache.view)] = (graph, logits)
        self.stats.graph = True
        _log.info("slot decoding: decode step of %d of %d slots over %d positions captured as a CUDA graph "
                  "in %.1f s", self.cache.row_view, self.slots, self.cache.view, time.perf_counter() - t0)

    # -- sampling ----------------------------------------------------------------------------------------------

    def _sample(self, logits, rows, draws: bool):
        """The next token of each of `rows` (an index or a slice of the slots): argmax where its temperature is 0,
        else a draw after temperature, top-k and top-p (as Transformers' warpers apply them). `draws`: whether
        any of them has a temperature above 0 (if not, the argmax alone)."""
        import torch

        greedy = logits.argmax(-1)
        if not draws:
            return greedy
        temperature, top_p, top_k = self.temperature[rows], self.top_p[rows], self.top_k[rows]
        scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
        ordered, order = scaled.sort(-1, descending=True)
        rank = torch.arange(ordered.shape[-1], device=ordered.device)[None, :]
        cut = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        probs = ordered.masked_fill(cut, -math.inf).softmax(-1)
        # top-p keeps the smallest prefix whose mass reaches p (the first token always)
        cut |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        probs = ordered.masked_fill(cut, -math.inf).softmax(-1)
        drawn = order.gather(-1, torch.multinomial(probs, 1)).squeeze(-1)
        return torch.where(temperature > 0, drawn, greedy)
