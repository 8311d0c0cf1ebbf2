"""Greedy speculative decoding of a target with a DFlash drafter, and the acceptance length tau.

Each round: the drafter drafts a block in one forward (block = [last accepted token, MASK x
(B-1)], context = the target hidden states of the prefix, appended to the drafter's context
cache), the target verifies the whole block in one forward (with a KV cache cropped to the
accepted prefix), and the longest prefix of the draft that matches the target's own greedy
tokens is accepted, plus one bonus token from the target. tau = mean tokens produced per
verification. Greedy decoding with the target alone must give the same tokens (lossless);
`evaluate_drafter` checks that for every prompt with one teacher-forced target forward over prompt +
output (`greedy_mismatch`; `greedy_generate` is the plain greedy loop it stands for).

Reads: a drafter checkpoint directory and a target model directory (HF format, loaded with
transformers), or already-loaded models. Writes nothing.

Imports only torch, numpy and safetensors at module level (transformers lazily).
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash_assets.drafter.model import DFlashDrafter, DraftCache, TargetHead, load_drafter
from dflash_assets.target_model.layer_capture import LayerCapture, text_config


@dataclass(frozen=True)
class EvalPrompt:
    input_ids: tuple[int, ...]  # the rendered prompt (chat template + generation prompt), token ids
    category: str = "default"
    prompt_id: str = ""
    slices: tuple[str, ...] = ()  # the slices tau is also reported for (``promotion.prompt_slices``)


@dataclass
class SpecOutput:
    output_ids: list[int]  # generated tokens only (prompt excluded)
    acceptance_lengths: list[int]  # tokens produced by each verification (accepted draft + 1 bonus)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _cache_kwarg(target) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def supports_cache_crop(target) -> bool:
    """Only attention layers can be rolled back by cropping; linear-attention state cannot."""
    types = getattr(text_config(target.config), "layer_types", None) or ["full_attention"]
    return all(t in ("full_attention", "sliding_attention") for t in types)


class TargetRunner:
    """The target with hooks on the captured layers; incremental with a KV cache where it can be
    cropped, else by re-running the whole sequence (hybrid linear-attention targets)."""

    def __init__(self, target, layer_ids: Sequence[int], use_cache: bool = True):
        self.target = target
        self.capture = LayerCapture(target, layer_ids, cut=False).__enter__()  # verification needs the whole model
        self.use_cache = use_cache and supports_cache_crop(target)
        self.device = next(target.parameters()).device
        self.ids: list[int] = []  # tokens the target has processed (committed)
        self.cache = None

    def close(self):
        self.capture.__exit__(None, None, None)

    def _forward(self, new_ids: list[int]):
        """Logits (T, V) and captured features (T, n*H) of new_ids appended to the committed prefix."""
        if self.use_cache:
            from transformers import DynamicCache

            if self.cache is None:
                self.cache = DynamicCache(config=self.target.config)
                if hasattr(self.cache, "activate_past_recording"):  # sliding-window layers can roll back
                    self.cache.activate_past_recording()
            x = torch.tensor([new_ids], device=self.device)
            pos = torch.arange(len(self.ids), len(self.ids) + len(new_ids), device=self.device)[None]
            out = self.target(input_ids=x, position_ids=pos, use_cache=True, **{_cache_kwarg(self.target): self.cache})
            return out.logits[0], self.capture.features()[0]
        x = torch.tensor([self.ids + new_ids], device=self.device)
        out = self.target(input_ids=x, use_cache=False)
        T = len(new_ids)
        return out.logits[0, -T:], self.capture.features()[0, -T:]

    def extend(self, new_ids: list[int], keep: int | None = None):
        """Run new_ids; commit only the first `keep` of them (default all)."""
        logits, feats = self._forward(new_ids)
        keep = len(new_ids) if keep is None else keep
        self.commit(new_ids[:keep])
        return logits, feats

    def commit(self, ids: list[int]):
        self.ids += ids
        if self.cache is not None:
            extra = self.cache.get_seq_length() - len(self.ids)
            if extra > 0:
                self.cache.crop(-extra)  # a negative count removes that many tokens (transformers 4 and 5)


class SpeculativeDecoder:
    def __init__(self, target, drafter: DFlashDrafter, head: TargetHead | None = None, use_cache: bool = True):
        self.target, self.drafter = target, drafter.eval()
        cfg = drafter.config
        self.block_size, self.mask_token_id, self.layer_ids = cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids
        self.head = head or TargetHead.from_model(target)
        self.use_cache = use_cache

    @torch.no_grad()
    def generate(self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> SpecOutput:
        B, stop = self.block_size, set(stop_token_ids)
        runner = TargetRunner(self.target, self.layer_ids, self.use_cache)
        dev = runner.device
        try:
            logits, feats = runner._forward(list(input_ids))  # prefill
            runner.commit(list(input_ids))
            token = int(logits[-1].argmax())
            out, lengths = [token], []
            ctx, ctx_start = feats, 0  # context not yet in the drafter's cache, and its first position
            dcache = DraftCache(len(self.drafter.layers))
            start = len(input_ids)  # position of `token`, the next block's anchor
            while len(out) < max_new_tokens and token not in stop:
                # draft: one forward over [token, MASK x (B-1)] with the new context appended
                block = torch.tensor([[token] + [self.mask_token_id] * (B - 1)], device=dev)
                x = self.head.embed(block).to(ctx.dtype)  # (1, B, H)
                pos = torch.arange(ctx_start, start + B, device=dev)[None]  # (1, ctx + B)
                h = self.drafter(x, ctx[None].to(x.dtype), pos, mask=None, cache=dcache)
                draft = self.head.logits(h[0, 1:]).argmax(-1).tolist()  # (B-1,)
                # verify: the target's greedy token after each block prefix
                verify = [token] + draft
                logits, feats = runner._forward(verify)
                post = logits.argmax(-1).tolist()  # post[j] follows verify[: j + 1]
                a = 0
                while a < B - 1 and draft[a] == post[a]:
                    a += 1
                new = draft[:a] + [post[a]]
                # stop tokens and the length budget cut the round short
                for j, t in enumerate(new):
                    if t in stop:
                        new = new[: j + 1]
                        break
                new = new[: max_new_tokens - len(out)]
                runner.commit(verify[: len(new)])  # token, d1..d_a: their KV stays in the cache
                ctx, ctx_start = feats[: len(new)], start
                start += len(new)
                out += new
                lengths.append(len(new))
                token = new[-1]
            return SpecOutput(out[:max_new_tokens], lengths)
        finally:
            runner.close()


@torch.no_grad()
def greedy_generate(target, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                    use_cache: bool = True) -> list[int]:
    """The target alone, one token per forward: the reference speculative decoding must equal."""
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    stop = set(stop_token_ids)
    use_cache = use_cache and supports_cache_crop(target)
    ids, out = list(input_ids), []
    cache = DynamicCache(config=target.config) if use_cache else None
    step_ids = ids
    while len(out) < max_new_tokens:
        x = torch.tensor([step_ids if use_cache else ids], device=dev)
        kw = {_cache_kwarg(target): cache} if use_cache else {}
        logits = target(input_ids=x, use_cache=use_cache, **kw).logits
        t = int(logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        step_ids = [t]
        if t in stop:
            break
    return out


def _logits_kwargs(target, n: int) -> dict[str, Any]:
    """Ask for the last n positions' logits only where the model supports it (transformers' logits_to_keep)."""
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


@torch.no_grad()
def greedy_mismatch(target, input_ids: Sequence[int], output_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = ()) -> int | None:
    """Where `output_ids` first departs from the target's own greedy decoding of `input_ids`, or None if it is
    exactly what `greedy_generate` returns. One forward over prompt + output (teacher forcing): output[i] must be
    the argmax after prompt + output[:i] for every i (by induction the greedy loop then emits the same tokens),
    no stop token may come before the last token, and the output ends at a stop token or at max_new_tokens.
    Costs one target forward per prompt instead of one per new token."""
    out, stop, n = list(output_ids), set(stop_token_ids), len(output_ids)
    if n == 0:
        return 0 if max_new_tokens > 0 else None
    dev = next(target.parameters()).device
    x = torch.tensor([list(input_ids) + out[:-1]], device=dev)
    logits = target(input_ids=x, use_cache=False, **_logits_kwargs(target, n)).logits[0, -n:]
    greedy = logits.argmax(-1).tolist()  # greedy[i]: the target's token after prompt + out[:i]
    for i, (g, t) in enumerate(zip(greedy, out)):
        if g != t or (t in stop and i < n - 1):
            return i
    if n > max_new_tokens:
        return max_new_tokens
    if n < max_new_tokens and out[-1] not in stop:
        return n  # greedy decoding would have gone on
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_speed(target, drafter: DFlashDrafter, prompts: Sequence[EvalPrompt], *, max_new_tokens: int,
                 stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Wall-clock decode speed at batch 1: the target alone (`greedy_generate`) against speculative decoding
    with `drafter` (`SpeculativeDecoder`), same process, same target and precision, on the same prompts, timed
    as `compare_decode_speed` times every speed-up."""
    dev = next(target.parameters()).device
    dec = SpeculativeDecoder(target, drafter.to(dev, next(target.parameters()).dtype))
    return compare_decode_speed(
        target, prompts, max_new_tokens,
        lambda ids: greedy_generate(target, ids, max_new_tokens, stop_token_ids),
        lambda ids: dec.generate(ids, max_new_tokens, stop_token_ids))


def compare_decode_speed(target, prompts: Sequence[EvalPrompt], max_new_tokens: int,
                         run_target: Callable[[Sequence[int]], list[int]],
                         run_speculative: Callable[[Sequence[int]], SpecOutput]) -> dict[str, Any]:
    """The timing rule every speed-up follows: one untimed warm-up of each path on the first prompt; then,
    prompt by prompt, both timed (the device synchronized before and after each), alternating which goes first;
    tokens/s summed over the prompts; `outputs_equal`: prompts where both wrote the same tokens."""
    dev = next(target.parameters()).device
    if prompts:
        run_target(prompts[0].input_ids)
        run_speculative(prompts[0].input_ids)
    seconds = {"target": 0.0, "speculative": 0.0}
    tokens = {"target": 0, "speculative": 0}
    equal, verifications = 0, 0
    for i, p in enumerate(prompts):
        outs = {}
        for which in (("target", "speculative") if i % 2 == 0 else ("speculative", "target")):
            _synchronize(dev)
            t0 = time.perf_counter()
            if which == "target":
                outs[which] = run_target(p.input_ids)
            else:
                so = run_speculative(p.input_ids)
                outs[which] = so.output_ids
                verifications += len(so.acceptance_lengths)
            _synchronize(dev)
            seconds[which] += time.perf_counter() - t0
            tokens[which] += len(outs[which])
        equal += outs["target"] == outs["speculative"]
    rate = {k: tokens[k] / seconds[k] if seconds[k] > 0 else 0.0 for k in seconds}
    return {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "device": dev.type,
            "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
            "target_tokens_per_s": round(rate["target"], 2), "speculative_tokens_per_s": round(rate["speculative"], 2),
            "speedup": round(rate["speculative"] / rate["target"], 3) if rate["target"] else 0.0,
            "target_tokens": tokens["target"], "speculative_tokens": tokens["speculative"],
            "target_s": round(seconds["target"], 3), "speculative_s": round(seconds["speculative"], 3),
            "tau": round((tokens["speculative"] - len(prompts)) / max(verifications, 1), 4),
            "outputs_equal": int(equal)}


@dataclass
class EvalResult:
    tau: float  # mean tokens per verification over all prompts (pooled)
    tau_by_category: dict[str, float]
    lossless: bool  # every prompt's output equals the target's own greedy output
    num_mismatches: int
    num_verifications: int
    num_new_tokens: int
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    acceptance_length_counts: list[int] = field(default_factory=list)  # [n]: verifications that produced n tokens

    def to_metadata(self) -> dict[str, Any]:
        return {"tau": self.tau, "tau_by_category": self.tau_by_category, "lossless": self.lossless,
                "num_mismatches": self.num_mismatches, "num_verifications": self.num_verifications,
                "num_new_tokens": self.num_new_tokens, "num_prompts": len(self.per_prompt), "wall_s": self.wall_s,
                "acceptance_length_counts": self.acceptance_length_counts}


def evaluation_dtype(device=None, dtype=None) -> torch.dtype:
    """The precision evaluation loads the target (and its drafter) in: `dtype` (a torch dtype or its name), else
    float32 on a CPU (exact comparisons for the lossless check) and bfloat16 on a GPU. The one rule: this process's
    target, `EvalWorkers`' targets and `eval_recipe` all take it from here."""
    from dflash_assets.hidden_states.format import torch_dtype

    if dtype is not None:
        return torch_dtype(dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_target(target_dir: str | Path, device=None, dtype=None):
    """The target for evaluation on `device` (default: CUDA when there is one), in `evaluation_dtype`."""
    from dflash_assets.target_model.loading import load_causal_lm

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return load_causal_lm(target_dir, dtype=evaluation_dtype(device, dtype)).to(device).eval()


def _pooled(rows: list[dict[str, Any]]) -> float:
    n = sum(r["verifications"] for r in rows)
    return sum(r["accepted_tokens"] for r in rows) / n if n else 0.0


def evaluate_drafter(
    drafter: DFlashDrafter | str | Path,
    target: Any,
    prompts: Sequence[EvalPrompt],
    *,
    max_new_tokens: int = 256,
    stop_token_ids: Sequence[int] = (),
    check_lossless: bool = True,
    use_cache: bool = True,
    device=None,
    on_prompt: Callable[[int, dict[str, Any]], None] | None = None,
    stop_after_s: float | None = None,
) -> EvalResult:
    """tau of `drafter` on `target` (a loaded HF model or a directory) over held-out prompts. `on_prompt(i, row)`
    is called after each prompt (progress; a caller cut at a time limit keeps the rows done so far). With
    `stop_after_s`, no prompt after the first starts once that many seconds have passed (the result's
    num_prompts says how many ran). Target forwards per prompt: one prefill, one per verification, one for the
    lossless check."""
    t0 = time.perf_counter()
    if isinstance(target, (str, Path)):
        target = load_target(target, device)
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    if isinstance(drafter, (str, Path)):
        drafter = load_drafter(drafter, device=dev, dtype=dtype)
    drafter = drafter.to(dev, dtype)
    dec = SpeculativeDecoder(target, drafter, use_cache=use_cache)
    rows, lengths = [], Counter()
    for i, p in enumerate(prompts):
        if stop_after_s is not None and rows and time.perf_counter() - t0 > stop_after_s:
            break
        tp = time.perf_counter()
        so = dec.generate(p.input_ids, max_new_tokens, stop_token_ids)
        lengths.update(so.acceptance_lengths)
        row = {"prompt_id": p.prompt_id, "category": p.category, "tau": so.tau,
               "verifications": len(so.acceptance_lengths), "accepted_tokens": sum(so.acceptance_lengths),
               "new_tokens": len(so.output_ids), "prompt_tokens": len(p.input_ids),
               "slices": list(p.slices)}
        if check_lossless:  # one teacher-forced forward, not a second token-by-token decode
            first = greedy_mismatch(target, p.input_ids, so.output_ids, max_new_tokens, stop_token_ids)
            row["lossless"] = first is None
            if first is not None:
                row["first_mismatch"] = first
        row["wall_s"] = round(time.perf_counter() - tp, 3)
        rows.append(row)
        if on_prompt is not None:
            on_prompt(i, row)
    return result_from_rows(rows, lengths, time.perf_counter() - t0)


def result_from_rows(rows: list[dict[str, Any]], lengths: Counter, wall_s: float) -> EvalResult:
    """The result of per-prompt rows (`evaluate_drafter`'s) and the count of verifications by tokens produced."""
    cats = sorted({r["category"] for r in rows})
    mism = sum(1 for r in rows if r.get("lossless") is False)
    return EvalResult(
        tau=_pooled(rows), tau_by_category={c: _pooled([r for r in rows if r["category"] == c]) for c in cats},
        lossless=mism == 0, num_mismatches=mism, num_verifications=sum(r["verifications"] for r in rows),
        num_new_tokens=sum(r["new_tokens"] for r in rows), per_prompt=rows, wall_s=wall_s,
        acceptance_length_counts=[lengths[n] for n in range(max(lengths, default=0) + 1)])


__all__ = ["EvalPrompt", "EvalResult", "SpecOutput", "SpeculativeDecoder", "TargetRunner", "evaluate_drafter",
           "greedy_generate", "greedy_mismatch", "load_target", "result_from_rows", "supports_cache_crop"]
