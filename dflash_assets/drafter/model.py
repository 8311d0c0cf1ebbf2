"""DFlash drafter: a few Qwen3-style decoder layers that draft a whole block of tokens in one forward.

The drafter reads the target's hidden states of a few chosen layers (concatenated per token),
projects them with `fc` + `hidden_norm` into a context, and injects that context into every draft
layer as extra keys/values. Queries come only from the block tokens ([anchor, MASK x (B-1)]);
attention inside a block is bidirectional. The target's `embed_tokens` and `lm_head` are reused,
frozen: they live in `TargetHead`, never in the drafter's parameters or checkpoint.

Reads: a target model directory (config.json + *.safetensors) for `TargetHead`; a drafter
checkpoint directory (config.json + model.safetensors) in `load_drafter`.
Writes: drafter checkpoints (`save_drafter`): model.safetensors + config.json in the layout the
public DFlash inference code loads (a Qwen3 config plus `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `dflash_config: {target_layer_ids, mask_token_id}`), written
atomically (temp dir + rename).

Parameter names follow the public code: `layers.N.self_attn.{q,k,v,o}_proj`,
`layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.{gate,up,down}_proj`, `layers.N.input_layernorm`,
`layers.N.post_attention_layernorm`, `norm`, `fc`, `hidden_norm`.

Imports only torch, safetensors and numpy (no transformers needed at runtime).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_assets.store.manifest import pid_alive
from dflash_assets.target_model.conventions import dflash_target_layer_ids, text_config
from dflash_assets.torch_compile import flex_attention, is_block_mask

# Loss decay gamma per block size (DFlash paper / SpecForge defaults).
KNOWN_LOSS_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def loss_gamma(block_size: int) -> float:
    """Decay of the per-position loss weight exp(-(k-1)/gamma): 7 for B=16, 5 for 10, 4 for 8."""
    return KNOWN_LOSS_GAMMAS.get(block_size, max(1.0, block_size * 7.0 / 16.0))


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    num_hidden_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other target config keys worth keeping

    @classmethod
    def from_target_config(
        cls,
        target_config: dict[str, Any],
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
    ) -> "DrafterConfig":
        """Drafter shaped like the target's layers (same H, heads, head_dim, MLP width)."""
        tc = text_config(target_config)  # hybrid/multimodal nest the LM
        L = tc["num_hidden_layers"]
        H = tc["hidden_size"]
        n_heads = tc["num_attention_heads"]
        rope = tc.get("rope_parameters") or {}
        theta = rope.get("rope_theta", tc.get("rope_theta", 1_000_000.0))
        vocab = tc.get("vocab_size") or target_config["vocab_size"]
        if mask_token_id is None:
            raise ValueError("mask_token_id is required: resolve it with dflash_conventions.mask_token_id_in_dir")
        return cls(
            hidden_size=H,
            intermediate_size=tc["intermediate_size"],
            num_attention_heads=n_heads,
            num_key_value_heads=tc.get("num_key_value_heads", n_heads),
            head_dim=tc.get("head_dim") or H // n_heads,
            vocab_size=vocab,
            # as in public DFlash: as many target layers as draft layers, unless given
            target_layer_ids=list(target_layer_ids or dflash_target_layer_ids(L, num_layers)),
            num_target_layers=L,
            mask_token_id=int(mask_token_id),
            num_hidden_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=tc.get("max_position_embeddings", 40960),
            bos_token_id=tc.get("bos_token_id", target_config.get("bos_token_id")),
            eos_token_id=tc.get("eos_token_id", target_config.get("eos_token_id")),
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """config.json: a Qwen3 config plus the DFlash fields the public inference code reads."""
        n = self.num_hidden_layers
        d = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "dtype": str(dtype).removeprefix("torch."),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * n,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": n,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": n,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        return {**self.extra, **d}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        dc = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or {}
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            target_layer_ids=list(dc.get("target_layer_ids", d.get("target_layer_ids", []))),
            num_target_layers=d["num_target_layers"],
            mask_token_id=int(dc.get("mask_token_id", d.get("mask_token_id"))),
            num_hidden_layers=d["num_hidden_layers"],
            block_size=int(d.get("block_size", dc.get("block_size", 16))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            initializer_range=d.get("initializer_range", 0.02),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            extra={k: v for k, v in d.items() if k not in _OWN_KEYS},
        )


# keys `to_hf_dict` writes itself; anything else in a loaded config.json is carried in `extra`
_OWN_KEYS = {
    "architectures", "auto_map", "model_type", "block_size", "num_target_layers", "dflash_config",
    "attention_bias", "attention_dropout", "dtype", "head_dim", "hidden_act", "hidden_size",
    "initializer_range", "intermediate_size", "layer_types", "max_position_embeddings",
    "max_window_layers", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "sliding_window",
    "use_sliding_window", "tie_word_embeddings", "use_cache", "vocab_size", "bos_token_id",
    "eos_token_id", "target_layer_ids", "mask_token_id", "torch_dtype", "transformers_version",
}


# ----------------------------------------------------------------------------------------------
# Building blocks (Qwen3 numerics)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # casts only where the dtype changes: at batch 1 every operator costs the host a dispatch (decode_op_counts)
        dtype = x.dtype
        x = _cast(x, torch.float32)
        x = _cast(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps), dtype)
        # (cast back: under autocast an fp32 weight would otherwise promote the stream to fp32)
        return _cast(self.weight * x, dtype)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without dispatching an operator when `x` has that dtype already."""
    return x if x.dtype == dtype else x.to(dtype)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta

    def forward(self, position_ids: torch.Tensor):
        # made here in fp32 each call (no buffer, so model.to(bf16) cannot round the frequencies)
        hd = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=position_ids.device) / hd))
        freqs = position_ids[..., None].float() * inv_freq  # (b, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, T, hd)
        return emb.cos(), emb.sin()  # fp32; cast to the q/k dtype in apply_rope


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (b, nh, T, hd); cos, sin (b, T, hd)
    cos, sin = _cast(cos[:, None], x.dtype), _cast(sin[:, None], x.dtype)
    return x * cos + rotate_half(x) * sin


class SegmentedMask:
    """Attention over a packed row in pieces (SDPA), for training batches that pack many sequences in one row.

    The first `context` keys are context, the rest one per query. Each piece ``(q0, q1, c0, c1, mask)`` is a run of
    queries [q0, q1) that sees context keys [c0, c1) and its own queries' keys, by a bool mask
    (1, 1, q1 - q0, c1 - c0 + q1 - q0): only what a piece can see is computed, where one dense mask over the row
    would set every query against every key."""

    def __init__(self, context: int, pieces: list):
        self.context, self.pieces = context, pieces

    def attend(self, q, k, v) -> torch.Tensor:
        S, out = self.context, []
        for q0, q1, c0, c1, mask in self.pieces:
            kk = torch.cat([k[:, :, c0:c1], k[:, :, S + q0:S + q1]], dim=2)
            vv = torch.cat([v[:, :, c0:c1], v[:, :, S + q0:S + q1]], dim=2)
            out.append(F.scaled_dot_product_attention(q[:, :, q0:q1], kk, vv, attn_mask=mask, enable_gqa=True))
        return torch.cat(out, dim=2)


def attend(q, k, v, mask) -> torch.Tensor:
    """q (b, nh, tq, hd), k/v (b, nkv, tk, hd); mask: BlockMask (flex), bool (b,1,tq,tk), SegmentedMask or None."""
    if is_block_mask(mask):  # flex attention exists in torch >= 2.5; the SDPA path works without it
        return flex_attention(q, k, v, mask)
    if isinstance(mask, SegmentedMask):
        return mask.attend(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class DraftCache:
    """Per-layer keys/values of the context tokens seen so far (inference only).

    Only context K/V are kept: each draft call appends the new context tokens and then attends
    over [all context | this block]; block K/V are never cached, so nothing has to be cropped.
    """

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def extend(self, i: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        if self.k[i] is None:
            self.k[i], self.v[i] = k_ctx, v_ctx
        else:
            self.k[i] = torch.cat([self.k[i], k_ctx], dim=2)
            self.v[i] = torch.cat([self.v[i], v_ctx], dim=2)
        return self.k[i], self.v[i]


class DFlashAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.head_dim = hd
        self.q_proj = nn.Linear(H, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask=None, cache: DraftCache | None = None):
        # x (b, tq, H) block tokens; ctx (b, tc, H) projected target context; cos/sin (b, tc+tq, hd)
        b, tq, _ = x.shape
        tc = ctx.shape[1]
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, tq, -1, hd)).transpose(1, 2)  # (b, nh, tq, hd)
        # context and block share k_proj/v_proj and k_norm: keys = [ctx | block]
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(b, tc + tq, -1, hd)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(b, tc + tq, -1, hd)
        k = self.k_norm(k).transpose(1, 2)  # (b, nkv, tc+tq, hd)
        v = v.transpose(1, 2)  # (b, nkv, tc+tq, hd)
        q = apply_rope(q, cos[:, tc:], sin[:, tc:])  # queries sit at the block positions
        k = apply_rope(k, cos, sin)
        q, k = _cast(q, v.dtype), _cast(k, v.dtype)  # one dtype for the attention kernel (autocast)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(self.layer_idx, k[:, :, :tc], v[:, :, :tc])
            k = torch.cat([k_ctx, k[:, :, tc:]], dim=2)  # (b, nkv, all ctx + tq, hd)
            v = torch.cat([v_ctx, v[:, :, tc:]], dim=2)
        y = attend(q, k, v, mask)  # (b, nh, tq, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, tq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, ctx, cos, sin, mask=None, cache=None):
        # Self Attention (keys/values also over the target context)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, ctx, cos, sin, mask, cache)
        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class DFlashDrafter(nn.Module):
    """forward(x, target_hidden, position_ids) -> normed hidden states of the block tokens.

    x: (b, tq, H) embeddings of block tokens ([anchor, MASK...] per block, blocks concatenated).
    target_hidden: (b, tc, n*H) raw target features of the context tokens.
    position_ids: (b, tc + tq) absolute positions of [context | block tokens].
    mask: None (every query sees everything: inference), a bool (b, 1, tq, tc+tq) mask (SDPA), a
    flex `BlockMask` over the same (query, key) layout, or a `SegmentedMask` (SDPA in pieces, packed batches).
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, x, target_hidden, position_ids, mask=None, cache: DraftCache | None = None):
        ctx = self.hidden_norm(self.fc(target_hidden))  # (b, tc, H)
        cos, sin = self.rotary_emb(position_ids)  # (b, tc+tq, hd)
        h = x
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, mask, cache)
        return self.norm(h)  # (b, tq, H)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------------
# The target's frozen embedding and head


def _target_weight_files(target_dir: Path) -> list[Path]:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [target_dir / n for n in names]
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {target_dir}")
    return files


def load_target_tensors(target_dir: str | Path, suffixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Read the tensors whose names end with the given suffixes, e.g. {"embed": "embed_tokens.weight"}."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in _target_weight_files(Path(target_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                for name, suffix in suffixes.items():
                    # prefer the language model's tensors (skip e.g. vision towers / MTP heads)
                    if key.endswith(suffix) and "mtp" not in key and "visual" not in key:
                        if name not in found or len(key) < len(found[name][0]):
                            found[name] = (key, f.get_tensor(key))
    return {name: t for name, (_, t) in found.items()}


class TargetHead(nn.Module):
    """The target's `embed_tokens` and `lm_head`, frozen (requires_grad False, outside any optimizer)."""

    def __init__(self, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head_weight, requires_grad=False)

    @classmethod
    def from_target_dir(cls, target_dir: str | Path, dtype=None, device=None) -> "TargetHead":
        t = load_target_tensors(target_dir, {"embed": "embed_tokens.weight", "head": "lm_head.weight"})
        if "embed" not in t:
            raise KeyError(f"no embed_tokens.weight in {target_dir}")
        embed = t["embed"]
        head = t.get("head", embed)  # tied embeddings: the head is the embedding matrix
        dtype = dtype or embed.dtype
        return cls(embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype))

    @classmethod
    def from_model(cls, target: nn.Module) -> "TargetHead":
        """The head of a loaded target (a Transformers causal LM), sharing its tensors, on its device and dtype."""
        return cls(target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h.to(self.lm_head.weight.dtype))


def load_target_config(target_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(target_dir) / "config.json").read_text())


# ----------------------------------------------------------------------------------------------
# Save / load


def _atomic_dir(dest: Path):
    """A temp dir beside ``dest`` named ``.<name>.tmp-<pid>-*`` (:func:`clean_stale_temps` finds it after a kill)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and the directories themselves, so a rename publishes durable data."""
    for p in sorted(root.rglob("*"), reverse=True):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(root)


def _swap_into_place(tmp: Path, dest: Path):
    """Fsync tmp, rename it onto dest (an existing dest is moved aside first, removed afterwards), fsync the parent."""
    _fsync_tree(tmp)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_STALE = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-.*)?")


def clean_stale_temps(directory: Path) -> list[Path]:
    """Remove temp and moved-aside dirs/files a killed writer left in ``directory`` (``.<name>.tmp-<pid>-*``,
    ``.<name>.old-<pid>``) whose process is gone; if ``<name>`` itself is missing, a moved-aside old copy is
    put back first (a kill between the two renames of :func:`_swap_into_place`). Returns what was removed."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for p in sorted(directory.iterdir()):
        m = _STALE.fullmatch(p.name)
        if m is None or pid_alive(int(m.group("pid"))):
            continue
        dest = directory / m.group("name")
        if ".old-" in p.name and not dest.exists():
            os.replace(p, dest)  # the new copy never landed: the old one is still the current one
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def drafter_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: the drafter's own parameters only (never the target's embed/head)."""
    m = getattr(drafter, "module", drafter)  # unwrap DDP
    m = getattr(m, "_orig_mod", m)  # unwrap torch.compile
    return {k: v.detach() for k, v in m.state_dict().items()}


def save_drafter(drafter: nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 metadata: dict[str, str] | None = None) -> Path:
    """Write model.safetensors + config.json atomically; returns out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    m = getattr(getattr(drafter, "module", drafter), "_orig_mod", getattr(drafter, "module", drafter))
    tmp = _atomic_dir(out)
    try:
        tensors = {k: v.to("cpu", dtype).contiguous() for k, v in drafter_state_dict(m).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(m.config.to_hf_dict(dtype), indent=2) + "\n")
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_drafter(ckpt_dir: str | Path, device=None, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a checkpoint written by `save_drafter` (or a public DFlash checkpoint of the same layout)."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt_dir)
    config = DrafterConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        model = DFlashDrafter(config)
    state = load_file(str(ckpt / "model.safetensors"), device=str(device or "cpu"))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


__all__ = [
    "DFlashDrafter", "DrafterConfig", "DraftCache", "TargetHead", "attend",
    "drafter_state_dict", "load_drafter", "load_target_config",
    "load_target_tensors", "loss_gamma", "save_drafter", "SegmentedMask",
]
