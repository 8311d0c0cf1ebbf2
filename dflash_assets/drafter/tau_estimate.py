"""tau while training: a drafter's expected acceptance length on held-out prompts, teacher-forced, no decoding.

A held-out slice (:class:`HeldoutSlice`) is a few prompts the recipe never trained on, each with the target's own
greedy continuation (the text a lossless decode writes) and the target's hidden states of the drafter's layers over
prompt + continuation. :func:`estimate_tau` runs the drafter once per sequence in the training layout (``loss``),
with a block anchored at every continuation token, and reads off which block positions predict the continuation:

- ``accuracy_by_position``: right predictions at block position k = 1..B-1 over all anchors (what training reports);
- ``acceptance_by_position``: the share of anchors whose first k predictions are all right, k = 0..B-1 (position 0,
  the verification's own token, is always accepted), and ``tau`` = their sum, the expected acceptance length of a
  verification that starts at a random continuation token;
- ``walk_tau``: the acceptance length of the verifications a greedy speculative decode makes over these predictions
  (a verification starts at the last accepted token, as ``decoding.SpeculativeDecoder`` runs them): the decoded tau.

:class:`TauWatch` evaluates inside ``training.train_drafter`` every N steps and at the end, keeps the history and the
best evaluation (its checkpoint is marked best), and says when the estimate has not improved for K evaluations (the
early stop); its state rides in the training state, so a resume keeps all three.

Reads and writes: :func:`save_slice` / :func:`load_slice`, one hidden-state cache part (``hidden_states.format``:
``hidden``, ``input_ids``, ``loss_mask`` = 1 on the continuation, ``cu_seqlens``; layer ids and prompt ids in its
header), written atomically. :func:`heldout_slice` builds it once per recipe, target and settings (the training work
directory keeps it, so a resumed run estimates on the same slice). Imports torch; transformers through the target.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash_assets.drafter.loss import block_layout, dflash_block_mask, dflash_dense_mask

__all__ = ["HeldoutSlice", "TauEstimate", "TauWatch", "build_slice", "save_slice", "load_slice", "estimate_tau",
           "teacher_forced_tau", "heldout_slice"]


@dataclass
class HeldoutSlice:
    """Held-out prompts with the target's greedy continuations and its features of the drafter's layers."""

    input_ids: list[torch.Tensor]  # per sequence (S,) int64: prompt + continuation
    prompt_lens: list[int]
    hidden: list[torch.Tensor]  # per sequence (S, n*H)
    layer_ids: tuple[int, ...]
    prompt_ids: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def continuation_tokens(self) -> int:
        return sum(len(ids) - p for ids, p in zip(self.input_ids, self.prompt_lens))


@torch.no_grad()
def build_slice(target, prompts: Sequence[Any], layer_ids: Sequence[int], *, max_new_tokens: int,
                stop_token_ids: Sequence[int] = ()) -> HeldoutSlice:
    """Each prompt (an ``EvalPrompt``) with the target's greedy continuation and the target's features at
    ``layer_ids`` over both (``LayerCapture``, as the cache and online training take them). A continuation shorter
    than 2 tokens has no anchor with a token after it and is left out."""
    from dflash_assets.drafter.decoding import greedy_generate
    from dflash_assets.target_model.layer_capture import LayerCapture

    dev = next(target.parameters()).device
    ids_out, lens, hidden, names = [], [], [], []
    for p in prompts:
        cont = greedy_generate(target, p.input_ids, max_new_tokens, stop_token_ids)
        if len(cont) < 2:
            continue
        seq = torch.tensor([list(p.input_ids) + cont], device=dev)
        with LayerCapture(target, layer_ids, cut=False) as capture:
            target(input_ids=seq, use_cache=False)
            feats = capture.features()[0]  # (S, n*H)
        ids_out.append(seq[0].cpu())
        lens.append(len(p.input_ids))
        hidden.append(feats.cpu())
        names.append(str(getattr(p, "prompt_id", len(names))))
    return HeldoutSlice(ids_out, lens, hidden, tuple(int(i) for i in layer_ids), tuple(names))


def save_slice(path: str | Path, heldout: HeldoutSlice, target_model: str = "") -> Path:
    """One hidden-state cache part (``hidden_states.format``: what training and the cache reader take), written
    atomically (temp file, then rename); loss_mask is 1 on the continuations."""
    from dflash_assets.hidden_states.format import SafetensorsStreamWriter, ShardMetadata, shard_tensor_specs

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden = torch.cat(heldout.hidden).contiguous()
    n = len(heldout.layer_ids)
    dtype = str(hidden.dtype).removeprefix("torch.")
    meta = ShardMetadata(target_model=target_model, layer_ids=heldout.layer_ids, dtype=dtype,
                         hidden_size=hidden.shape[-1] // n, prompt_ids=heldout.prompt_ids)
    cu = [0]
    for ids in heldout.input_ids:
        cu.append(cu[-1] + len(ids))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with SafetensorsStreamWriter(tmp, shard_tensor_specs(cu[-1], len(heldout), n, hidden.shape[-1] // n, dtype),
                                 meta.to_header(), fsync=False) as w:
        w.write("hidden", hidden)
        w.write("input_ids", torch.cat(heldout.input_ids).to(torch.int32))
        w.write("loss_mask", torch.cat([(torch.arange(len(ids)) >= p).to(torch.uint8)
                                        for ids, p in zip(heldout.input_ids, heldout.prompt_lens)]))
        w.write("cu_seqlens", torch.tensor(cu, dtype=torch.int64))
    os.replace(tmp, path)
    return path


def load_slice(path: str | Path) -> HeldoutSlice:
    from safetensors import safe_open

    from dflash_assets.hidden_states.format import ShardMetadata

    with safe_open(str(path), "pt") as f:
        meta = ShardMetadata.from_header(f.metadata() or {})
        t = {k: f.get_tensor(k) for k in ("hidden", "input_ids", "loss_mask", "cu_seqlens")}
    cu = t["cu_seqlens"].tolist()
    ids = [t["input_ids"][a:b].long() for a, b in zip(cu, cu[1:])]
    lens = [int((t["loss_mask"][a:b] == 0).sum()) for a, b in zip(cu, cu[1:])]
    hidden = [t["hidden"][a:b] for a, b in zip(cu, cu[1:])]
    return HeldoutSlice(ids, lens, hidden, tuple(meta.layer_ids), tuple(meta.prompt_ids))


@dataclass
class TauEstimate:
    tau: float  # expected acceptance length over every anchor: sum of acceptance_by_position
    walk_tau: float  # the verifications a greedy decode makes over these predictions
    accuracy_by_position: list[float]  # k = 1..B-1
    acceptance_by_position: list[float]  # k = 0..B-1: share of anchors whose first k predictions are right
    anchors: int
    sequences: int

    def to_dict(self) -> dict[str, Any]:
        return {"tau": round(self.tau, 4), "walk_tau": round(self.walk_tau, 4), "anchors": self.anchors,
                "sequences": self.sequences, "accuracy_by_position": [round(a, 4) for a in self.accuracy_by_position],
                "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position]}


def _walk(right: torch.Tensor, continuation: int, B: int) -> tuple[int, int]:
    """(verifications, tokens) of a greedy decode over one sequence's per-anchor predictions ``right`` (N, B-1):
    the prefill writes the first token, then each verification starts at the last token written."""
    rows = right.tolist()
    done, rounds, tokens = 1, 0, 0
    while done < continuation:
        accepted = next((k for k, ok in enumerate(rows[done - 1]) if not ok), B - 1)
        gained = min(accepted + 1, continuation - done)
        done, rounds, tokens = done + gained, rounds + 1, tokens + gained
    return rounds, tokens


@torch.no_grad()
def _sequence_predictions(drafter, head, ids, hidden, P: int, attention: str, chunk_rows: int) -> torch.Tensor:
    """(N, B-1) predicted tokens for blocks anchored at every continuation token but the last (positions P..S-2)."""
    cfg = drafter.config
    B, S, dev = cfg.block_size, ids.shape[0], ids.device
    anchors = torch.arange(P, S - 1, device=dev)[None]  # (1, N)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    noise, positions = block_layout(ids[None], anchors, keep, B, cfg.mask_token_id)
    position_ids = torch.cat([torch.arange(S, device=dev)[None], positions], 1)
    mask = (dflash_block_mask(anchors, keep, S, B) if attention == "flex"
            else dflash_dense_mask(anchors, keep, S, B))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        x = head.embed(noise).to(hidden.dtype)
        h = drafter(x, hidden[None], position_ids, mask)[0].view(-1, B, cfg.hidden_size)[:, 1:]  # (N, B-1, H)
        return torch.cat([head.logits(c).argmax(-1) for c in h.reshape(-1, cfg.hidden_size).split(chunk_rows)]
                         ).view(-1, B - 1)


@torch.no_grad()
def estimate_tau(drafter, head, heldout: HeldoutSlice, *, attention: str = "sdpa", chunk_rows: int = 256,
                 dtype: torch.dtype | None = None) -> TauEstimate:
    """The drafter on the slice's continuations, teacher-forced (see the module docstring)."""
    B = drafter.config.block_size
    dev = next(drafter.parameters()).device
    dtype = dtype or next(drafter.parameters()).dtype
    correct, counts = torch.zeros(B - 1), torch.zeros(B - 1)
    lead_at_least = torch.zeros(B - 1)
    anchors, rounds, tokens = 0, 0, 0
    for ids, P, hidden in zip(heldout.input_ids, heldout.prompt_lens, heldout.hidden):
        ids, hidden = ids.to(dev), hidden.to(dev, dtype)
        S = ids.shape[0]
        preds = _sequence_predictions(drafter, head, ids, hidden, P, attention, chunk_rows)  # (N, B-1)
        target_pos = torch.arange(P, S - 1, device=dev)[:, None] + torch.arange(1, B, device=dev)  # (N, B-1)
        valid = target_pos < S
        right = (preds == ids[target_pos.clamp(max=S - 1)]) & valid
        correct += right.sum(0).float().cpu()
        counts += valid.sum(0).float().cpu()
        lead = right.int().cumprod(1).sum(1).cpu()  # leading right predictions per anchor
        lead_at_least += (lead[:, None] >= torch.arange(1, B)).sum(0).float()
        anchors += right.shape[0]
        r, t = _walk(right.cpu(), S - P, B)
        rounds, tokens = rounds + r, tokens + t
    acceptance = [1.0] + (lead_at_least / max(anchors, 1)).tolist() if anchors else [0.0] * B
    return TauEstimate(tau=float(sum(acceptance)), walk_tau=tokens / rounds if rounds else 0.0,
                       accuracy_by_position=(correct / counts.clamp_min(1)).tolist(),
                       acceptance_by_position=acceptance, anchors=anchors, sequences=len(heldout))


def teacher_forced_tau(target, drafter, prompts: Sequence[Any], *, max_new_tokens: int,
                       stop_token_ids: Sequence[int] = ()) -> TauEstimate:
    """`estimate_tau` on the target's greedy continuations of ``prompts``, built here with a loaded target."""
    from dflash_assets.drafter.model import TargetHead

    heldout = build_slice(target, prompts, drafter.config.target_layer_ids, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_token_ids)
    return estimate_tau(drafter, TargetHead.from_model(target), heldout)


@dataclass
class TauWatch:
    """The estimate inside a training run: when to evaluate, the history, the best, the early stop."""

    heldout: HeldoutSlice
    head: Any  # the target's TargetHead
    every: int
    patience: int | None = None
    attention: str = "sdpa"
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    since_best: int = 0

    def due(self, step: int, stop: int) -> bool:
        return step % self.every == 0 or step == stop

    def evaluate(self, drafter, step: int, tokens: int) -> dict[str, Any]:
        """Estimate tau now; the entry joins the history, and becomes the best if it beats the best so far."""
        was_training = drafter.training
        drafter.eval()
        try:
            est = estimate_tau(drafter, self.head, self.heldout, attention=self.attention)
        finally:
            drafter.train(was_training)
        entry = {"step": step, "tokens": tokens, **est.to_dict()}
        self.history = [h for h in self.history if h["step"] != step] + [entry]
        if self.best is None or entry["tau"] > self.best["tau"]:
            self.best, self.since_best = {"step": step, "tokens": tokens, "tau": entry["tau"]}, 0
        else:
            self.since_best += 1
        return entry

    @property
    def stop_reason(self) -> str | None:
        """Why to stop now (the estimate has not improved for `patience` evaluations), else None."""
        if self.patience is None or self.best is None or self.since_best < self.patience:
            return None
        return (f"early stop: the held-out tau estimate has not improved for {self.since_best} evaluations "
                f"(best {self.best['tau']:.3f} at step {self.best['step']})")

    def state(self) -> dict[str, Any]:
        return {"history": self.history, "best": self.best, "since_best": self.since_best}

    def restore(self, doc: dict[str, Any] | None) -> None:
        doc = doc or {}
        self.history, self.best = list(doc.get("history", [])), doc.get("best")
        self.since_best = int(doc.get("since_best", 0))


def heldout_slice(prompts: Sequence[Any], recipe: Any, target: Any, layer_ids: Sequence[int], work_dir: str | Path,
                  *, device=None, log: Callable[[str], None] = print) -> HeldoutSlice | None:
    """The recipe's held-out slice: ``prompts`` (its first ``recipe.tau_prompts`` held-out prompts, as
    ``stages.heldout_prompts`` picks them: shards it does not train on, cleared by the decontamination rule, the
    prompts ``drafter_eval`` decodes first) with the target's greedy continuations of ``recipe.tau_new_tokens``
    tokens. Built once and kept in ``work_dir`` under a key of the prompts, the target, the layers and the length.
    None when there is no prompt: then nothing is estimated."""
    import hashlib

    if not prompts:
        return None
    key = hashlib.sha256(json.dumps([[p.prompt_id for p in prompts], target.config_fingerprint(), list(layer_ids),
                                     recipe.tau_new_tokens]).encode()).hexdigest()[:12]
    path = Path(work_dir) / f"heldout-{key}.safetensors"
    if path.exists():
        return load_slice(path)
    from dflash_assets.drafter.decoding import load_target

    model = load_target(target.model_path, device)
    try:
        heldout = build_slice(model, prompts, layer_ids, max_new_tokens=recipe.tau_new_tokens,
                              stop_token_ids=sorted(target.chat().stop_ids))
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    log(f"recipe {recipe.name}: tau estimate on {len(heldout)} held-out prompts, "
        f"{heldout.continuation_tokens} continuation tokens of the target's own")
    return load_slice(save_slice(path, heldout)) if len(heldout) else None
