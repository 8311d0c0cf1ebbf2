"""The corpus's cost plan before any GPU hour: generation time, cache bytes, capture and training GPU-hours.

Pure arithmetic over three inputs: a ``TargetShape`` (the target's layer
shapes and the captured DFlash layers; ``TargetShape.from_config`` of a
transformers config, or the constants ``QWEN3_8B`` and ``QWEN3_6_27B``), a
``CorpusShape`` (conversations, mean tokens per tokenized sample, turns per
prompt, output tokens per turn) and, optionally, a ``GenerationCost`` (from
``planning.measurements``' measured burst or pilot, or a given fleet throughput).
``plan_costs`` returns a ``CostPlan`` with ``markdown()`` and ``to_metadata()``.

What it predicts:

- generation wall time, per endpoint and in total (as measured by the caller);
- hidden-state cache bytes (``hidden_states.format.estimate_partition_bytes``:
  tokens x captured layers x hidden x dtype bytes, plus ids, masks, offsets, headers);
- capture GPU-hours (once, offline), drafter training GPU-hours per epoch from
  the cache (offline), and online GPU-hours per epoch (the target's forward and
  the training step each epoch: tokens / (1 / (1/capture + 1/train)), with the
  capture rate online training measured: its plain forward, 32,647 tok/s at
  Qwen3-8B shapes, where online ran at 0.99-1.00 of that joined rate);
- offline vs online: when the cache exceeds the budget, online (it never stores
  the cache); otherwise offline, with the GPU-hours of both to say why.

Throughputs are SCALED, not measured at the target's shapes: this project measured
on one H200 at Qwen3-8B shapes (BENCHMARKS.md) capture 38,358 tok/s (packed,
compiled norms/MLP, 8 x 2048-token samples) and drafter training 22,565 tok/s
(batch 2, 3072-token sequences, 512 anchors, block 16, 5 layers). Assuming the same
FLOP rate (MFU) at other shapes:

    tok/s(target) = tok/s(reference) x FLOPs per token(reference) / FLOPs per token(target)

with FLOPs per token of what runs: capture = 2 x (matmul weights of the decoder
layers 0..max(captured)) + 2 x heads x head_dim x sequence length per full-attention
layer run (linear-attention recurrences, norms and elementwise work not counted);
training = BENCHMARKS.md's per-step count (drafter matmuls x3, ``fc`` x2, frozen
``lm_head`` x2 on the labelled block rows, block attention x3) divided by the
sequence length. Pass ``capture_tok_s`` / ``train_tok_s`` to use measured figures.

Reads nothing; writes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from dflash_assets.chart_data import format_duration
from dflash_assets.hidden_states.format import bytes_per_token, estimate_partition_bytes

__all__ = [
    "TargetShape",
    "CorpusShape",
    "EndpointCost",
    "GenerationCost",
    "CostPlan",
    "plan_costs",
    "QWEN3_8B",
    "QWEN3_6_27B",
    "TARGETS",
    "REFERENCE",
    "DRAFTER_DEFAULTS",
    "format_duration",
    "format_bytes",
    "format_gpu_hours",
]


def format_gpu_hours(h: float) -> str:
    return f"{h:,.1f} GPU-h" if h >= 0.1 else f"{h * 3600:.3g} GPU-s"


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (metadata of tiny and huge plans alike)."""
    return float(f"{x:.{digits}g}")


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


_GATED_Q = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # full attention with an output gate in q_proj


@dataclass(frozen=True)
class TargetShape:
    """The target's decoder shapes and the DFlash layers captured from it."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    captured_layers: tuple[int, ...]
    dtype_bytes: int = 2  # bf16
    # Hybrid targets (Qwen3.5/3.6): per-layer "full_attention" / "linear_attention" (Gated DeltaNet); None: all full.
    layer_types: tuple[str, ...] | None = None
    attn_output_gate: bool = False  # q_proj also produces a gate (Qwen3.5/3.6 full attention): 2x its outputs
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    @classmethod
    def from_config(cls, config: Any, captured_layers: Sequence[int] | None = None, *, name: str | None = None,
                    num_captured: int = 5, dtype_bytes: int = 2) -> "TargetShape":
        """From a transformers config (its ``text_config`` when nested) or a dict of its fields.

        ``captured_layers``: the DFlash layer ids (``TargetModelSpec.layer_ids``); None: DFlash's rule.
        """
        from dflash_assets.target_model.conventions import text_config

        text = text_config(config)
        fields = dict(text) if isinstance(text, Mapping) else text.to_dict()
        layers, hidden, heads = fields["num_hidden_layers"], fields["hidden_size"], fields["num_attention_heads"]
        if captured_layers is None:
            from dflash_assets.target_model.conventions import dflash_target_layer_ids

            captured_layers = dflash_target_layer_ids(layers, num_captured)
        types = fields.get("layer_types")
        return cls(
            name=name or str(fields.get("model_type") or "target"), num_layers=layers, hidden_size=hidden,
            intermediate_size=fields["intermediate_size"], num_heads=heads,
            num_kv_heads=fields.get("num_key_value_heads") or heads, head_dim=fields.get("head_dim") or hidden // heads,
            vocab_size=fields["vocab_size"], captured_layers=tuple(int(i) for i in captured_layers),
            dtype_bytes=dtype_bytes, layer_types=tuple(types) if types else None,
            attn_output_gate=bool(fields.get("attn_output_gate", fields.get("model_type") in _GATED_Q)),
            linear_num_key_heads=fields.get("linear_num_key_heads") or 0,
            linear_num_value_heads=fields.get("linear_num_value_heads") or 0,
            linear_key_head_dim=fields.get("linear_key_head_dim") or 0,
            linear_value_head_dim=fields.get("linear_value_head_dim") or 0)

    def with_captured(self, captured_layers: Sequence[int]) -> "TargetShape":
        return replace(self, captured_layers=tuple(captured_layers))

    @property
    def bytes_per_token(self) -> int:
        """Cached hidden-state bytes per token: captured layers x hidden x dtype bytes (51,200 for Qwen3.6-27B)."""
        return len(self.captured_layers) * self.hidden_size * self.dtype_bytes

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_params(self, i: int) -> int:
        """Matmul weights of decoder layer ``i``: attention (or Gated DeltaNet) projections + the gated MLP."""
        H = self.hidden_size
        mlp = 3 * H * self.intermediate_size
        if self.layer_type(i) == "linear_attention":
            nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
            dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
            attn = H * (2 * nk * dk + nv * dv) + H * nv * dv + 2 * H * nv + nv * dv * H  # qkv, z, b+a, out
        else:
            q = H * self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)
            attn = q + 2 * H * self.num_kv_heads * self.head_dim + self.num_heads * self.head_dim * H
        return attn + mlp

    @property
    def layers_run(self) -> int:
        """Decoder layers a capture runs: 0..max(captured) (the model is cut after the last captured layer)."""
        return max(self.captured_layers) + 1

    def capture_flops_per_token(self, seq_len: float) -> float:
        """2 x weights of the layers run + causal attention (QK^T and PV) of the full-attention layers run."""
        run = range(self.layers_run)
        weights = sum(self.layer_params(i) for i in run)
        full = sum(1 for i in run if self.layer_type(i) == "full_attention")
        return 2.0 * weights + full * 2.0 * self.num_heads * self.head_dim * seq_len

    def train_flops_per_sequence(self, seq_len: float, supervised: float, *, drafter_layers: int = 5,
                                 block_size: int = 16, max_anchors: int = 512) -> float:
        """FLOPs of one drafter training step on one sequence (BENCHMARKS.md's count; drafter shaped like the
        target's layers: hidden, heads, KV heads, head_dim, MLP width; the target's vocabulary)."""
        H, nh, nkv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        anchors = min(max_anchors, max(supervised, 0.0))
        block_tokens = anchors * block_size
        per_layer = 2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * self.intermediate_size
        matmuls = 3 * 2 * drafter_layers * (block_tokens * per_layer + seq_len * 2 * H * nkv * hd)
        fc = 2 * 2 * seq_len * len(self.captured_layers) * H * H
        head = 2 * 2 * anchors * (block_size - 1) * H * self.vocab_size
        mean_anchor = seq_len - min(supervised, seq_len) / 2  # anchors spread over the supervised span
        attention = 3 * 2 * 2 * drafter_layers * block_tokens * (mean_anchor + block_size) * nh * hd
        return matmuls + fc + head + attention


# Qwen3-8B: what this project's throughputs were measured at (BENCHMARKS.md).
QWEN3_8B = TargetShape("Qwen3-8B", num_layers=36, hidden_size=4096, intermediate_size=12288, num_heads=32,
                       num_kv_heads=8, head_dim=128, vocab_size=151_936, captured_layers=(1, 9, 17, 25, 33))
# Qwen3.6-27B = the Qwen3.5-27B shapes (its config.json's text_config): 64 layers, 3 Gated DeltaNet : 1 full
# attention (gated q), DFlash's rule picks 5 layers [1, 16, 31, 46, 61].
QWEN3_6_27B = TargetShape(
    "Qwen3.6-27B", num_layers=64, hidden_size=5120, intermediate_size=17408, num_heads=24, num_kv_heads=4,
    head_dim=256, vocab_size=248_320, captured_layers=(1, 16, 31, 46, 61),
    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)),
    attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128)
TARGETS = {"qwen3-8b": QWEN3_8B, "qwen3.6-27b": QWEN3_6_27B, "qwen3.5-27b": replace(QWEN3_6_27B, name="Qwen3.5-27B")}

# The drafter recipe's defaults (drafter.recipe.DrafterRecipe; a test keeps them equal).
DRAFTER_DEFAULTS = {"num_layers": 5, "block_size": 16, "max_anchors": 512, "epochs": 6}


@dataclass(frozen=True)
class Reference:
    """Throughputs this project measured on one H200 at Qwen3-8B shapes (BENCHMARKS.md), and at what."""

    shape: TargetShape = QWEN3_8B
    capture_tok_s: float = 38_358.0  # hooks + cut, packed varlen, compiled norms/MLP
    capture_seq_len: int = 2048  # 8 x 2048-token samples per forward
    train_tok_s: float = 22_565.0  # batch 2
    train_seq_len: int = 3072
    train_supervised: float = 0.9 * 3072  # first 10% without loss
    online_capture_tok_s: float = 32_647.0  # the plain forward online training runs (bench/online_training.py, batch 2)
    online_capture_seq_len: int = 3072
    gpu: str = "H200"

    @property
    def online_capture_flops_s(self) -> float:
        return self.online_capture_tok_s * self.shape.capture_flops_per_token(self.online_capture_seq_len)

    @property
    def capture_flops_s(self) -> float:
        return self.capture_tok_s * self.shape.capture_flops_per_token(self.capture_seq_len)

    @property
    def train_flops_s(self) -> float:
        """At the benchmark's recipe: 5 drafter layers, block 16, 512 anchors."""
        per_seq = self.shape.train_flops_per_sequence(self.train_seq_len, self.train_supervised)
        return self.train_tok_s / self.train_seq_len * per_seq


REFERENCE = Reference()


@dataclass(frozen=True)
class CorpusShape:
    """What the corpus is: conversations, mean tokens per tokenized sample, and what generation makes."""

    conversations: int
    tokens_per_sample: float  # mean tokens of a tokenized sample (last_turn: one sample per conversation)
    turns_per_prompt: float | None = None  # assistant turns regenerated per conversation
    output_tokens_per_turn: float | None = None  # generated tokens per assistant turn (reasoning included)
    supervised_per_sample: float | None = None  # loss tokens per sample; None: the last turn's output, else all
    partitions: int | None = None  # shards; None: conversations / 1024
    source: str = "given"  # where tokens_per_sample came from

    @property
    def tokens(self) -> float:
        return self.conversations * self.tokens_per_sample

    @property
    def num_partitions(self) -> int:
        return self.partitions or max(1, math.ceil(self.conversations / 1024))

    @property
    def supervised(self) -> float:
        if self.supervised_per_sample is not None:
            return self.supervised_per_sample
        if self.output_tokens_per_turn:
            return min(self.output_tokens_per_turn, self.tokens_per_sample)
        return self.tokens_per_sample

    @property
    def output_tokens(self) -> float | None:
        if self.turns_per_prompt is None or self.output_tokens_per_turn is None:
            return None
        return self.conversations * self.turns_per_prompt * self.output_tokens_per_turn


@dataclass(frozen=True)
class EndpointCost:
    endpoint: str
    tokens_per_s: float
    share: float  # of the corpus's generated tokens
    alone_wall_s: float  # if this endpoint did everything


@dataclass(frozen=True)
class GenerationCost:
    """Wall time of regenerating the corpus on the fleet, and how it was measured."""

    source: str  # burst | pilot | pilot + engine model | given
    output_tokens: float
    tokens_per_s: float
    wall_s: float
    endpoints: tuple[EndpointCost, ...] = ()
    note: str = ""

    @classmethod
    def from_estimate(cls, estimate: Any) -> "GenerationCost":
        """From ``planning.measurements.GenerationEstimate`` (a measured burst per endpoint)."""
        eps = tuple(EndpointCost(e.endpoint, e.tokens_per_s, e.share, e.alone_wall_s) for e in estimate.per_endpoint)
        return cls("burst", estimate.total_output_tokens, estimate.total_tokens_per_s, estimate.wall_s, eps,
                   f"burst of {estimate.probe_max_new_tokens} tokens per request" if estimate.probe_max_new_tokens
                   else "")

    @classmethod
    def from_pilot(cls, pilot: Any, prompts: int, partitions: int = 1) -> "GenerationCost":
        """From ``planning.measurements.PilotMeasure``: the pilot's rate scaled to ``prompts`` in ``partitions``."""
        wall = pilot.estimate_wall_s(prompts, partitions)
        out = prompts * pilot.completion_tokens / pilot.done if pilot.done else 0.0
        tps = out / wall if wall and wall != float("inf") else 0.0
        total = sum(n for _, n in pilot.endpoint_tokens) or 0
        eps = tuple(EndpointCost(url, tps * n / total, n / total, wall * total / n)
                    for url, n in pilot.endpoint_tokens if n > 0)
        return cls("pilot", out, tps, wall, eps, f"pilot of {pilot.prompts} real prompts ({pilot.done} done)")

    @classmethod
    def from_inprocess(cls, estimate: Any, pilot: Any, prompts: int, endpoint: str) -> "GenerationCost":
        """From ``planning.batch_costs.InprocessEstimate`` (the in-process engine's calls replayed and priced) and
        the ``PilotMeasure`` that gave its lengths: output tokens are the pilot's per prompt x ``prompts``."""
        wall = estimate.wall_s
        out = prompts * pilot.completion_tokens / pilot.done if pilot.done else 0.0
        tps = out / wall if wall > 0 else 0.0
        return cls("pilot + engine model", out, tps, wall, (EndpointCost(endpoint, tps, 1.0, wall),),
                   estimate.describe())

    @classmethod
    def from_throughput(cls, tokens_per_s: float, output_tokens: float) -> "GenerationCost":
        """From a given fleet throughput (e.g. measured elsewhere): output tokens / tokens per second."""
        wall = output_tokens / tokens_per_s if tokens_per_s > 0 else float("inf")
        return cls("given", output_tokens, tokens_per_s, wall, ())


@dataclass(frozen=True)
class CostPlan:
    target: TargetShape
    corpus: CorpusShape
    generation: GenerationCost | None
    cache_bytes: int  # the whole cache: hidden states + ids + masks + offsets + headers
    hidden_bytes: int  # of it, the hidden tensor alone (projected_corpus_bytes)
    capture_tok_s: float
    train_tok_s: float
    throughput_source: str  # scaled | given
    online_capture_tok_s: float  # the target's forward inside online training (plain, not packed or compiled)
    epochs: int
    budget_bytes: int | None
    drafter: dict[str, int] = field(default_factory=lambda: dict(DRAFTER_DEFAULTS))
    reference: Reference = REFERENCE

    @property
    def online_tok_s(self) -> float:
        """Capture and training joined: 1/(1/capture + 1/train), with online training's own capture rate
        (measured at 0.99-1.00 of this at Qwen3-8B shapes, BENCHMARKS.md)."""
        return 1.0 / (1.0 / self.online_capture_tok_s + 1.0 / self.train_tok_s)

    @property
    def capture_gpu_hours(self) -> float:
        return self.corpus.tokens / self.capture_tok_s / 3600

    @property
    def offline_train_gpu_hours_per_epoch(self) -> float:
        return self.corpus.tokens / self.train_tok_s / 3600

    @property
    def online_train_gpu_hours_per_epoch(self) -> float:
        return self.corpus.tokens / self.online_tok_s / 3600

    @property
    def offline_total_gpu_hours(self) -> float:
        return self.capture_gpu_hours + self.epochs * self.offline_train_gpu_hours_per_epoch

    @property
    def online_total_gpu_hours(self) -> float:
        return self.epochs * self.online_train_gpu_hours_per_epoch

    @property
    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.cache_bytes > self.budget_bytes

    @property
    def recommendation(self) -> str:
        return "online" if self.over_budget else "offline"

    @property
    def reason(self) -> str:
        cache = format_bytes(self.cache_bytes)
        costs = (f"offline {format_gpu_hours(self.offline_total_gpu_hours)} (capture once + {self.epochs} epochs) "
                 f"vs online {format_gpu_hours(self.online_total_gpu_hours)} ({self.epochs} x (capture + train))")
        if self.over_budget:
            return (f"the cache ({cache}) exceeds the budget ({format_bytes(self.budget_bytes)}): train online "
                    f"(recipe online: true), which recomputes the target's states every epoch and stores none; "
                    f"{costs}")
        fits = (f"the cache ({cache}) fits the budget ({format_bytes(self.budget_bytes)})"
                if self.budget_bytes is not None else f"no budget set (the cache needs {cache})")
        return f"{fits}: capture once and train from the cache, the target runs once instead of every epoch; {costs}"

    def markdown(self) -> str:
        t, c, g = self.target, self.corpus, self.generation
        ref = self.reference
        lines = [f"**Cost plan: {self.recommendation} training.** {self.reason[0].upper()}{self.reason[1:]}.", ""]
        lines += [
            "| | |", "| --- | --- |",
            f"| target | {t.name}: {t.num_layers} layers, hidden {t.hidden_size:,}, MLP {t.intermediate_size:,}, "
            f"{t.num_heads} heads / {t.num_kv_heads} KV, head_dim {t.head_dim}, vocab {t.vocab_size:,}"
            + (f", {sum(1 for i in range(t.num_layers) if t.layer_type(i) == 'linear_attention')} linear-attention "
               "layers" if t.layer_types else "") + " |",
            f"| captured layers | {list(t.captured_layers)} ({len(t.captured_layers)} x {t.hidden_size:,} x "
            f"{t.dtype_bytes} B = {t.bytes_per_token:,} B per token) |",
            f"| corpus | {c.conversations:,} conversations x {c.tokens_per_sample:,.0f} tokens per sample "
            f"({c.source}) = {c.tokens:,.0f} tokens, {c.num_partitions:,} partitions |",
        ]
        if c.turns_per_prompt is not None and c.output_tokens_per_turn is not None:
            lines.append(f"| generated | {c.turns_per_prompt:.2f} turns per prompt x {c.output_tokens_per_turn:,.1f} "
                         f"output tokens per turn = {c.output_tokens:,.0f} tokens |")
        if g is not None:
            lines.append(f"| generation wall time | **{format_duration(g.wall_s)}** at {g.tokens_per_s:,.1f} tok/s "
                         f"({g.source}{': ' + g.note if g.note else ''}) |")
        else:
            lines.append("| generation wall time | not measured (no fleet throughput given) |")
        lines += [
            f"| hidden-state cache | **{format_bytes(self.cache_bytes)}** ({self.cache_bytes:,} B; hidden states "
            f"{format_bytes(self.hidden_bytes)})"
            + (f"; budget {format_bytes(self.budget_bytes)}: **{'exceeded' if self.over_budget else 'fits'}**"
               if self.budget_bytes is not None else "; no budget set") + " |",
            f"| capture (once, offline) | {format_gpu_hours(self.capture_gpu_hours)} at {self.capture_tok_s:,.0f} tok/s |",
            f"| offline training, per epoch | {format_gpu_hours(self.offline_train_gpu_hours_per_epoch)} at "
            f"{self.train_tok_s:,.0f} tok/s |",
            f"| online training, per epoch | {format_gpu_hours(self.online_train_gpu_hours_per_epoch)} at "
            f"{self.online_tok_s:,.0f} tok/s = 1/(1/capture + 1/train), its capture (plain forward) at "
            f"{self.online_capture_tok_s:,.0f} tok/s |",
            f"| {self.epochs} epochs | offline {format_gpu_hours(self.offline_total_gpu_hours)}, online "
            f"{format_gpu_hours(self.online_total_gpu_hours)} |",
        ]
        if g is not None and g.endpoints:
            lines += ["", "| endpoint | tok/s | share | alone |", "| --- | --- | --- | --- |"]
            lines += [f"| {e.endpoint} | {e.tokens_per_s:,.1f} | {e.share:.0%} | {format_duration(e.alone_wall_s)} |"
                      for e in g.endpoints]
        if self.throughput_source == "scaled":
            lines += ["", f"GPU figures are scaled, not measured at these shapes: one {ref.gpu} at {ref.shape.name} "
                      f"shapes captured {ref.capture_tok_s:,.0f} tok/s (online training's plain forward "
                      f"{ref.online_capture_tok_s:,.0f}) and trained {ref.train_tok_s:,.0f} tok/s (BENCHMARKS.md); tok/s(target) = tok/s(reference) x FLOPs per token(reference) / FLOPs per "
                      f"token(target): capture {t.capture_flops_per_token(c.tokens_per_sample) / 1e9:,.1f} GFLOP per "
                      f"token (reference {ref.shape.capture_flops_per_token(ref.capture_seq_len) / 1e9:,.1f}), "
                      f"training {self._train_flops_per_token() / 1e9:,.1f} GFLOP per token (reference "
                      f"{ref.shape.train_flops_per_sequence(ref.train_seq_len, ref.train_supervised) / ref.train_seq_len / 1e9:,.1f}). "
                      "Linear-attention recurrences are not counted (a hybrid ran 0.90x of its dense peer with fla "
                      "kernels, 0.59x without)."]
        lines += ["", "Cache bytes assume `supervise: last_turn` (one sample per conversation); `every_turn` "
                  "multiplies tokens (2.58x on ShareGPT, BENCHMARKS.md)."]
        return "\n".join(lines)

    def _train_flops_per_token(self) -> float:
        c = self.corpus
        return self.target.train_flops_per_sequence(
            c.tokens_per_sample, c.supervised, drafter_layers=self.drafter["num_layers"],
            block_size=self.drafter["block_size"], max_anchors=self.drafter["max_anchors"]) / c.tokens_per_sample

    def to_metadata(self) -> dict[str, Any]:
        t, c, g = self.target, self.corpus, self.generation
        meta: dict[str, Any] = {
            "target": t.name, "target_layers": t.num_layers, "target_hidden": t.hidden_size,
            "target_intermediate": t.intermediate_size, "target_heads": t.num_heads,
            "target_kv_heads": t.num_kv_heads, "target_head_dim": t.head_dim, "target_vocab": t.vocab_size,
            "captured_layers": ",".join(str(i) for i in t.captured_layers),
            "bytes_per_token": t.bytes_per_token,
            "conversations": c.conversations, "tokens_per_sample": round(c.tokens_per_sample, 1),
            "tokens_per_sample_source": c.source, "corpus_tokens": int(c.tokens),
            "cache_bytes": int(self.cache_bytes), "cache_gb": round(self.cache_bytes / 1e9, 6),
            "cache_tb": round(self.cache_bytes / 1e12, 3),
            "capture_tok_s": round(self.capture_tok_s, 1), "train_tok_s": round(self.train_tok_s, 1),
            "online_tok_s": round(self.online_tok_s, 1), "online_capture_tok_s": round(self.online_capture_tok_s, 1),
            "gpu_throughput_source": self.throughput_source,
            "capture_gpu_hours": _sig(self.capture_gpu_hours),
            "offline_train_gpu_hours_per_epoch": _sig(self.offline_train_gpu_hours_per_epoch),
            "online_train_gpu_hours_per_epoch": _sig(self.online_train_gpu_hours_per_epoch),
            "epochs": self.epochs, "offline_total_gpu_hours": _sig(self.offline_total_gpu_hours),
            "online_total_gpu_hours": _sig(self.online_total_gpu_hours),
            "recommendation": self.recommendation, "over_budget": self.over_budget,
        }
        if c.turns_per_prompt is not None:
            meta["turns_per_prompt"] = round(c.turns_per_prompt, 3)
        if c.output_tokens_per_turn is not None:
            meta["output_tokens_per_turn"] = round(c.output_tokens_per_turn, 1)
        if self.budget_bytes is not None:
            meta["budget_gb"] = round(self.budget_bytes / 1e9, 3)
        if g is not None:
            meta.update({"generation_source": g.source, "generation_wall_s": round(g.wall_s, 1)
                         if g.wall_s != float("inf") else -1.0, "generation_wall": format_duration(g.wall_s),
                         "generation_tokens_per_s": round(g.tokens_per_s, 1),
                         "generation_output_tokens": int(g.output_tokens)})
            meta.update({f"generation_tokens_per_s[{e.endpoint}]": round(e.tokens_per_s, 1) for e in g.endpoints})
        return meta


def plan_costs(target: TargetShape, corpus: CorpusShape, *, generation: GenerationCost | None = None,
               budget_bytes: int | None = None, epochs: int = DRAFTER_DEFAULTS["epochs"],
               capture_tok_s: float | None = None, train_tok_s: float | None = None,
               drafter_layers: int = DRAFTER_DEFAULTS["num_layers"], block_size: int = DRAFTER_DEFAULTS["block_size"],
               max_anchors: int = DRAFTER_DEFAULTS["max_anchors"], reference: Reference = REFERENCE) -> CostPlan:
    """The cost plan; GPU throughputs scaled from ``reference`` by FLOPs per token unless given (see the module)."""
    if corpus.tokens_per_sample <= 0:
        raise ValueError(f"tokens per sample must be positive, got {corpus.tokens_per_sample}")
    tokens = int(round(corpus.tokens))
    cache = estimate_partition_bytes(tokens, corpus.conversations, len(target.captured_layers), target.hidden_size,
                                     {2: "bfloat16", 4: "float32"}[target.dtype_bytes], num_parts=corpus.num_partitions)
    hidden = corpus.conversations * corpus.tokens_per_sample * bytes_per_token(
        len(target.captured_layers), target.hidden_size, {2: "bfloat16", 4: "float32"}[target.dtype_bytes])
    given = capture_tok_s is not None and train_tok_s is not None
    online_capture = capture_tok_s if capture_tok_s is not None else (
        reference.online_capture_flops_s / target.capture_flops_per_token(corpus.tokens_per_sample))
    if capture_tok_s is None:
        capture_tok_s = reference.capture_flops_s / target.capture_flops_per_token(corpus.tokens_per_sample)
    if train_tok_s is None:
        per_seq = target.train_flops_per_sequence(corpus.tokens_per_sample, corpus.supervised,
                                                  drafter_layers=drafter_layers, block_size=block_size,
                                                  max_anchors=max_anchors)
        train_tok_s = reference.train_flops_s / (
            per_seq / corpus.tokens_per_sample)
    drafter = {"num_layers": drafter_layers, "block_size": block_size, "max_anchors": max_anchors, "epochs": epochs}
    return CostPlan(target, corpus, generation, int(cache), int(round(hidden)), capture_tok_s, train_tok_s,
                    "given" if given else "scaled", online_capture, epochs, budget_bytes, drafter, reference)


def add_arguments(parser: Any) -> None:
    """The options of ``dflash plan`` (also ``python -m dflash_assets.planning.costs``)."""
    parser.add_argument("--conversations", type=int, required=True, help="conversations in the corpus")
    parser.add_argument("--tokens-per-sample", type=float, required=True, help="mean tokens of a tokenized sample")
    parser.add_argument("--target", default="qwen3.6-27b",
                        help=f"{', '.join(TARGETS)}, or a model directory (its config.json)")
    parser.add_argument("--captured-layers", default=None, help="DFlash layer ids, comma-separated (default: the rule)")
    parser.add_argument("--turns-per-prompt", type=float, default=None, help="assistant turns regenerated per prompt")
    parser.add_argument("--output-tokens-per-turn", type=float, default=None, help="generated tokens per turn")
    parser.add_argument("--output-tokens-per-prompt", type=float, default=None,
                        help="generated tokens per prompt (instead of turns x tokens per turn)")
    parser.add_argument("--generation-tok-s", type=float, default=None,
                        help="the fleet's generation throughput (generation_plan measures it)")
    parser.add_argument("--budget-tb", type=float, default=None, help="hidden-state cache budget in TB (1e12 B)")
    parser.add_argument("--epochs", type=int, default=DRAFTER_DEFAULTS["epochs"])
    parser.add_argument("--capture-tok-s", type=float, default=None, help="measured capture tok/s (default: scaled)")
    parser.add_argument("--train-tok-s", type=float, default=None, help="measured training tok/s (default: scaled)")
    parser.add_argument("--json", action="store_true", help="print to_metadata() as JSON instead of Markdown")


def run(args: Any) -> int:
    """Print the plan for ``args`` (``add_arguments``'s options)."""
    import json
    from pathlib import Path

    captured = [int(x) for x in args.captured_layers.split(",")] if args.captured_layers else None
    if args.target.lower() in TARGETS:
        target = TARGETS[args.target.lower()]
        if captured:
            target = target.with_captured(captured)
    elif (Path(args.target) / "config.json").is_file():
        config = json.loads((Path(args.target) / "config.json").read_text())
        target = TargetShape.from_config(config, captured, name=Path(args.target).name)
    else:
        raise SystemExit(f"--target: not one of {', '.join(TARGETS)} nor a directory with a config.json: "
                         f"{args.target!r}")
    turns, per_turn = args.turns_per_prompt, args.output_tokens_per_turn
    if args.output_tokens_per_prompt is not None:
        turns, per_turn = turns or 1.0, args.output_tokens_per_prompt / (turns or 1.0)
    corpus = CorpusShape(args.conversations, args.tokens_per_sample, turns, per_turn)
    generation = None
    if args.generation_tok_s:
        if corpus.output_tokens is None:
            raise SystemExit("--generation-tok-s needs the generated tokens: --output-tokens-per-prompt, or "
                             "--turns-per-prompt and --output-tokens-per-turn")
        generation = GenerationCost.from_throughput(args.generation_tok_s, corpus.output_tokens)
    budget = int(args.budget_tb * 1e12) if args.budget_tb is not None else None
    plan = plan_costs(target, corpus, generation=generation, budget_bytes=budget, epochs=args.epochs,
                      capture_tok_s=args.capture_tok_s, train_tok_s=args.train_tok_s)
    print(json.dumps(plan.to_metadata(), indent=1) if args.json else plan.markdown())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_assets.planning.costs", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
