"""Batch-1 greedy speculative decoding as a server runs it: static caches, and on CUDA one graph per step.

`decoding.SpeculativeDecoder` is the eager reference (DynamicCache, Python per operator, float32 in evaluation).
At small target sizes both its target and its drafter are bound by kernel launches, so its speed-up is not the one
a server sees. Here the target keeps its keys and values in a static cache of a fixed length (Transformers'
attention calls the cache's `update`, as in `generation.slot_decoding`), the drafter keeps its context keys and
values in a static buffer (it is handed to `DFlashDrafter` in place of a `DraftCache`), and on CUDA each step is
one captured CUDA graph replayed: the drafter's block forward, the target's verification of the block (its greedy
tokens, the accepted count and the target features of the block, which the next draft reads as its new context),
and for the baseline `GraphTargetDecoder` the target's one-token step. Prompts prefill eagerly. A step attends over
the smallest view of its cache (a power of two from 256 positions, or the whole cache) past every position it
needs, one graph per view. Per round the host writes one small tensor (anchor token, positions) and reads one
(accepted count, the target's tokens, the draft): that read is the round's only synchronisation. The rule is
`SpeculativeDecoder`'s: the draft's longest prefix equal to the target's greedy tokens, plus one bonus token;
stop tokens and the length budget cut a round short. On CPU, or with ``graphs=False``, the same code runs
eagerly. Full-attention targets only (Llama, Qwen3 style).

`graph_decode_speed` times the target alone against speculative decoding through these decoders, as
`decoding.decode_speed` does through the eager ones.

Reads loaded models; writes nothing. Imports torch and the library (transformers through the model).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dflash_assets.drafter.decoding import (EvalPrompt, SpecOutput, _cache_kwarg, _logits_kwargs,
                                            compare_decode_speed)
from dflash_assets.drafter.model import DFlashDrafter, TargetHead
from dflash_assets.generation.slot_decoding import unsupported_reason
from dflash_assets.target_model.layer_capture import LayerCapture

__all__ = ["GraphSpeculativeDecoder", "GraphTargetDecoder", "graph_decode_speed"]

_SMALLEST_VIEW = 256


def _view(need: int, capacity: int) -> int:
    """The smallest power of two from 256 that holds `need` positions, or the whole cache."""
    view = _SMALLEST_VIEW
    while view < need:
        view *= 2
    return min(view, capacity)


class _StaticKV:
    """The target's keys and values, one (1, kv_heads, length, head_dim) pair per layer. Transformers' attention
    calls `update` with a layer's new keys and values: they are written at `positions` and the layer attends over
    the first `view` positions (the attention mask hides those past each query)."""

    is_compileable = False

    def __init__(self, layers: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        shape = (1, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.positions: torch.Tensor | None = None
        self.view = length

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.positions, key_states)
        self.values[layer_idx].index_copy_(2, self.positions, value_states)
        return self.keys[layer_idx][:, :, :self.view], self.values[layer_idx][:, :, :self.view]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some modeling code; positions come explicitly
        return 0


class _StaticDraftContext(_StaticKV):
    """The drafter's context keys and values (what `DraftCache` grows by concatenation), in place: `extend` writes
    a forward's context rows at `positions` and returns the first `view` positions; the mask hides rows past the
    valid context."""

    def extend(self, layer_idx: int, k_ctx, v_ctx):
        return self.update(k_ctx, v_ctx, layer_idx)


class _Graphs:
    """Step functions captured as CUDA graphs, one per (step, view), sharing one memory pool (one replays at a
    time; every step writes its results into tensors allocated outside the pool). Off CUDA: called eagerly."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs: dict[Any, Any] = {}
        self._pool: Any = None

    def run(self, key: Any, fn: Callable[[], None]) -> None:
        if not self.enabled:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(fn)
        graph.replay()

    def _capture(self, fn: Callable[[], None]):
        """Warm-up runs on a side stream (as capture needs), then the capture. Every step writes only where its
        replay writes next, from the same inputs, so the warm-ups change nothing the replay does not."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph


class _StaticTarget:
    """A causal LM over a `_StaticKV` of `capacity` positions: `forward` runs tokens at given positions and
    returns the greedy token after each of the last `keep` (graph-capturable for fixed shapes)."""

    def __init__(self, target, capacity: int, graphs: bool | None):
        reason = unsupported_reason(target.config)
        if reason:
            raise ValueError(f"graph decoding needs full attention in every layer; this model has {reason}")
        impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"graph decoding passes its own attention mask; attention {impl!r} takes none "
                             "(load the target with attn_implementation='sdpa')")
        cfg = getattr(target.config, "get_text_config", lambda: target.config)()
        self.target, self.capacity = target.eval(), int(capacity)
        self.device, self.dtype = next(target.parameters()).device, next(target.parameters()).dtype
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv = _StaticKV(cfg.num_hidden_layers, kv_heads, self.capacity, head_dim, self.dtype, self.device)
        self.key_positions = torch.arange(self.capacity, device=self.device)
        self.additive_mask = impl == "eager"  # eager attention adds its mask to the scores
        self.cache_kwarg = _cache_kwarg(target)
        self.graphs = _Graphs(self.device.type == "cuda" if graphs is None else bool(graphs))
        if self.graphs.enabled and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a target on a CUDA device")
        # the host's per-step inputs (anchor token, start position, context position) travel in one copy
        self.meta = torch.zeros(3, dtype=torch.long, device=self.device)
        self._meta_host = torch.zeros(3, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._meta_np = self._meta_host.numpy()

    def set_meta(self, *values: int) -> None:
        self._meta_np[:len(values)] = values
        self.meta.copy_(self._meta_host, non_blocking=True)

    def check_fits(self, prompt_len: int, max_new_tokens: int, max_len: int) -> None:
        if prompt_len == 0:
            raise ValueError("an empty prompt has nothing to continue")
        if prompt_len + max_new_tokens > max_len:
            raise ValueError(f"a prompt of {prompt_len} tokens and {max_new_tokens} new ones do not fit the static "
                             f"cache of {max_len} positions (raise max_len)")

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, keep: int) -> torch.Tensor:
        """Greedy tokens (keep,) after each of the last `keep` of `tokens` (1, T), placed from position `start`."""
        positions = start + self.key_positions[:tokens.shape[1]]
        self.kv.positions = positions
        mask = (self.key_positions[None, :self.kv.view] <= positions[:, None])[None, None]  # (1, 1, T, view)
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        out = self.target(input_ids=tokens, attention_mask=mask, position_ids=positions[None], use_cache=True,
                          **_logits_kwargs(self.target, keep), **{self.cache_kwarg: self.kv})
        return out.logits[0, -keep:].argmax(-1)

    def prefill(self, input_ids: Sequence[int]) -> torch.Tensor:
        self.kv.view = _view(len(input_ids), self.capacity)
        x = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        return self.forward(x, self.key_positions[0], keep=1)


class GraphTargetDecoder:
    """The target alone, greedy, one token per step over a static cache of `max_len` positions (prompt + new
    tokens); on CUDA the step is a captured graph. The baseline `GraphSpeculativeDecoder` is measured against."""

    def __init__(self, target, max_len: int, graphs: bool | None = None):
        self.max_len = int(max_len)
        self.core = _StaticTarget(target, self.max_len, graphs)
        self.result = torch.zeros(1, dtype=torch.long, device=self.core.device)

    def _step(self) -> None:
        core = self.core
        self.result.copy_(core.forward(core.meta[None, :1], core.meta[1], keep=1))

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        core, stop = self.core, set(stop_token_ids)
        core.check_fits(len(input_ids), max_new_tokens, self.max_len)
        if max_new_tokens <= 0:
            return []
        token = int(core.prefill(input_ids)[-1])
        out, pos = [token], len(input_ids)
        while len(out) < max_new_tokens and token not in stop:
            core.set_meta(token, pos)
            core.kv.view = _view(pos + 1, core.capacity)
            core.graphs.run(core.kv.view, self._step)
            token = int(self.result[0])  # the step's one synchronisation
            out.append(token)
            pos += 1
        return out


class GraphSpeculativeDecoder:
    """Greedy speculative decoding of `target` with a DFlash `drafter` at batch 1 over static caches of `max_len`
    positions (prompt + new tokens); on CUDA the draft and the verification are captured graphs (see the module).
    The drafter runs in the target's device and dtype."""

    def __init__(self, target, drafter: DFlashDrafter, max_len: int, graphs: bool | None = None,
                 head: TargetHead | None = None):
        cfg = drafter.config
        self.block_size, self.layer_ids = int(cfg.block_size), list(cfg.target_layer_ids)
        self.max_len = int(max_len)
        self.core = core = _StaticTarget(target, self.max_len + self.block_size, graphs)
        dev, dtype, B = core.device, core.dtype, self.block_size
        self.drafter = drafter.to(dev, dtype).eval()
        self.head = head or TargetHead.from_model(target)
        self.context = _StaticDraftContext(cfg.num_hidden_layers, cfg.num_key_value_heads, core.capacity,
                                           cfg.head_dim, dtype, dev)
        hidden = int(getattr(target.config, "get_text_config", lambda: target.config)().hidden_size)
        self.features = torch.zeros(B, len(self.layer_ids) * hidden, dtype=dtype, device=dev)  # the block's
        self.mask_ids = torch.full((B - 1,), int(cfg.mask_token_id), dtype=torch.long, device=dev)
        self.block_keys = torch.ones(B, dtype=torch.bool, device=dev)
        self.verify_tokens = torch.zeros(1, B, dtype=torch.long, device=dev)  # [anchor, draft...]
        self.result = torch.zeros(2 * B, dtype=torch.long, device=dev)  # [accepted, target's B tokens, draft]
        self._start = 0  # the next block's anchor position

    def _draft(self, features: torch.Tensor) -> None:
        """The drafter's block forward: context rows `features` (T, n*H) from position meta[2] join its context,
        the block [anchor, MASK x (B-1)] sits at meta[1] and attends over the context before it; the draft goes
        into `verify_tokens`."""
        meta, B, ctx = self.core.meta, self.block_size, self.context
        arange = self.core.key_positions
        ctx_positions = meta[2] + arange[:features.shape[0]]
        ctx.positions = ctx_positions
        keys = torch.cat([arange[:ctx.view] < meta[1], self.block_keys])  # valid context | the whole block
        block = torch.cat([meta[:1], self.mask_ids])[None]
        x = self.head.embed(block).to(features.dtype)
        positions = torch.cat([ctx_positions, meta[1] + arange[:B]])[None]
        h = self.drafter(x, features[None], positions, mask=keys[None, None, None].expand(1, 1, B, -1), cache=ctx)
        draft = self.head.logits(h[0, 1:]).argmax(-1)
        self.verify_tokens.copy_(torch.cat([meta[:1], draft])[None])

    def _verify(self) -> None:
        """The target over [anchor, draft] at meta[1]: its greedy tokens, the accepted count (the draft's longest
        prefix equal to them) and the block's features (through the layer hooks into `features`)."""
        B = self.block_size
        post = self.core.forward(self.verify_tokens, self.core.meta[1], keep=B)
        draft = self.verify_tokens[0, 1:]
        accepted = torch.cumprod((draft == post[:-1]).long(), 0).sum()
        self.result.copy_(torch.cat([accepted[None], post, draft]))

    def _round(self, first_features: torch.Tensor | None) -> tuple[int, list[int], list[int]]:
        """One draft and one verification; (accepted count, the target's tokens, the draft) on the host."""
        core, B = self.core, self.block_size
        self.context.view = _view(self._start, core.capacity)
        if first_features is not None:  # the prompt's context: its own shape, eager
            self._draft(first_features)
        else:
            core.graphs.run(("draft", self.context.view), lambda: self._draft(self.features))
        core.kv.view = _view(self._start + B, core.capacity)
        core.graphs.run(("verify", core.kv.view), self._verify)
        res = self.result.tolist()  # the round's one synchronisation
        return res[0], res[1:B + 1], res[B + 1:]

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> SpecOutput:
        core, stop = self.core, set(stop_token_ids)
        core.check_fits(len(input_ids), max_new_tokens, self.max_len)
        if max_new_tokens <= 0:
            return SpecOutput([], [])
        with LayerCapture(core.target, self.layer_ids, cut=False) as capture:
            token = int(core.prefill(input_ids)[-1])
            prompt_features = capture.features()[0]
            capture.target = self.features  # from here the hooks write the verified block's features in place
            out, lengths = [token], []
            self._start, ctx_pos = len(input_ids), 0  # the anchor's position; where new context rows go
            while len(out) < max_new_tokens and token not in stop:
                core.set_meta(token, self._start, ctx_pos)
                accepted, post, draft = self._round(prompt_features if not lengths else None)
                new = draft[:accepted] + [post[accepted]]
                for j, t in enumerate(new):  # stop tokens and the length budget cut the round short
                    if t in stop:
                        new = new[:j + 1]
                        break
                new = new[:max_new_tokens - len(out)]
                ctx_pos = self._start  # the next draft's new context: this block's first len(new) rows
                self._start += len(new)
                out += new
                lengths.append(len(new))
                token = new[-1]
        return SpecOutput(out[:max_new_tokens], lengths)


@torch.inference_mode()
def graph_decode_speed(target, drafter: DFlashDrafter, prompts: Sequence[EvalPrompt], *, max_new_tokens: int,
                       stop_token_ids: Sequence[int] = (), graphs: bool | None = None) -> dict[str, Any]:
    """Wall-clock decode speed at batch 1 through `GraphTargetDecoder` against `GraphSpeculativeDecoder` (the
    drafter cast to the target's device and dtype), same process, same target, same prompts; the keys of
    `decoding.decode_speed` plus ``graphs``, timed by `decoding.compare_decode_speed` (its untimed warm-up also
    captures the graphs of the views it meets)."""
    max_len = max((len(p.input_ids) for p in prompts), default=1) + max_new_tokens
    base = GraphTargetDecoder(target, max_len, graphs)
    spec = GraphSpeculativeDecoder(target, drafter, max_len, graphs)
    speed = compare_decode_speed(target, prompts, max_new_tokens,
                                 lambda ids: base.generate(ids, max_new_tokens, stop_token_ids),
                                 lambda ids: spec.generate(ids, max_new_tokens, stop_token_ids))
    return {**speed, "graphs": base.core.graphs.enabled}
