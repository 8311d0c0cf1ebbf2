"""Train a DFlash drafter on the hidden-state cache (or online from the target), resumable, DDP.

Reads: hidden-state cache files (safetensors per partition: `hidden` [T, n_layers*H],
`input_ids` int32, `loss_mask` uint8, `cu_seqlens` int64) or, in online mode, tokenized samples
(Parquet with `input_ids`/`loss_mask` list columns, or safetensors with `input_ids`, `loss_mask`,
`cu_seqlens`) plus the target model directory (its config, `embed_tokens` and `lm_head`; in online
mode the whole target, cut after the last captured layer).
Writes (under out_dir): `state/step-NNNNNNNN/` training state for resume (drafter.safetensors,
optimizer.safetensors, history.safetensors, trainer.json; no pickle), `state/latest`, and at the
end `drafter/` (model.safetensors + config.json, the public DFlash layout). Every write is
atomic (temp dir + rename).

One training step (per sequence): pick random anchors where loss_mask = 1 and position <=
len - B (at most `max_anchors`); block j = [token at anchor_j, MASK x (B-1)] at positions
anchor_j .. anchor_j+B-1; a block sees the target context strictly before its anchor, itself
bidirectionally, and no other block; label k (k >= 1) is token anchor_j + k, masked by loss_mask,
weighted exp(-(k-1)/gamma). The loss is sum(w * CE) / sum(w) over the global batch (all ranks),
so N processes with batch b train the same run as 1 process with batch N*b.

Multi-GPU: `python -m torch.distributed.run --nproc-per-node N -m dflash_assets.drafter.training
--recipe recipe.json --data f1.safetensors ... --target DIR --out DIR`.

The loop reads top to bottom here; its parts live beside it: `recipe` (what a run is), `data`
(samples, anchors, batches in step order), `loss` (blocks, masks, the head's cross-entropy, one
step), `state` (resumable state on disk), `model` (the drafter and the target's head).

Imports only torch, safetensors and numpy at module level (pyarrow, transformers lazily).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dflash_assets.drafter.data import BatchLoader, BatchPlan, open_training_data
from dflash_assets.drafter.loss import train_step
from dflash_assets.drafter.model import (
    DFlashDrafter,
    DrafterConfig,
    TargetHead,
    clean_stale_temps,
    load_target_config,
    save_drafter,
)
from dflash_assets.drafter.recipe import DrafterRecipe, TrainResult
from dflash_assets.drafter.state import latest_state_dir, load_training_state, save_training_state
from dflash_assets.drafter.step_profile import StepProfiler
from dflash_assets.drafter.tau_estimate import HeldoutSlice, TauWatch
from dflash_assets.target_model.conventions import mask_token_id_in_dir
from dflash_assets.target_model.layer_capture import LayerCapture
from dflash_assets.target_model.packed_attention import packed_row_kwargs
from dflash_assets.torch_compile import (allow_recompiles, apply_inductor_workarounds, current_flex_kernel_options,
                                         drafter_flex_kernel_options, flex_kernel_options)

__all__ = ["DrafterRecipe", "TrainResult", "TargetFeatures", "train_drafter", "main"]


# ----------------------------------------------------------------------------------------------
# Online mode: the target's hidden states of the chosen layers, computed on the fly


class TargetFeatures:
    """The target cut after its last needed layer, with hooks: input_ids (b, T) -> (b, T, n*H), or a training
    batch -> its context features in the batch's layout (`for_batch`).

    The same `LayerCapture` as the hidden-state cache, so online and offline features are identical. Attention
    is the cache's ``packed_causal`` (`target_model.packed_attention`): a packed batch runs the target over its
    samples' real tokens one after another, each attending inside its own sample (flash varlen on CUDA), not
    over rows padded to the longest. With `compile` (a compiled recipe on a GPU), its norms and MLPs compiled as the
    cache's capture compiles them (`hidden_states.capture.compile_elementwise`), instead of chains of eager
    elementwise kernels."""

    def __init__(self, target_dir: str | Path, layer_ids: Sequence[int], device, dtype, compile: bool = False):
        from dflash_assets.hidden_states.packing import register_packed_attention, resolve_packing
        from dflash_assets.target_model.loading import load_causal_lm

        model = load_causal_lm(target_dir, dtype=dtype)
        self.packed = resolve_packing(model, device, "auto")  # a hybrid target without its kernels: rows only
        if self.packed:
            model.set_attn_implementation(register_packed_attention())
        self.capture = LayerCapture(model, layer_ids, cut=True).__enter__()  # held for the target's lifetime
        self.model = self.capture.text_model.to(device).eval().requires_grad_(False)
        if compile:
            from dflash_assets.hidden_states.capture import compile_elementwise

            compile_elementwise(self.model)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # right padding never changes earlier positions of a causal model
        self.model(input_ids=input_ids, use_cache=False)
        return self.capture.features()

    @torch.no_grad()
    def for_batch(self, batch) -> torch.Tensor:
        """The context features of a training batch (`drafter.data.Batch`) in its layout: packed (1, Sc, n*H),
        the samples' real tokens through the target as one packed row (zeros in the end padding, which no
        block sees), else (b, S, n*H) from its padded rows."""
        if not (batch.packed and self.packed):
            return self(batch.input_ids)
        S, T, Sc = batch.input_ids.shape[1], batch.num_tokens, batch.ctx_index.shape[1]
        where = batch.ctx_index[0, :T]  # sample * S + position of each real token
        bounds = torch.cat([batch.ctx_start, batch.ctx_start.new_tensor([T])]).to(torch.int32)
        self.model(input_ids=batch.input_ids.reshape(-1).index_select(0, where)[None],
                   **packed_row_kwargs(bounds, where % S, S), use_cache=False)
        return torch.nn.functional.pad(self.capture.features(), (0, 0, 0, Sc - T))



# ----------------------------------------------------------------------------------------------
# The training loop


BUDGET_WARMUP_STEPS = 5  # steps not timed for a time budget (compilation, allocator warm-up)
BUDGET_MEASURE_STEPS = 15  # steps timed after them: the first cut
BUDGET_REPLAN_EVERY = 50  # then the plan is cut again every this many steps, at the recent pace (budget_pace)
BUDGET_PACE_WINDOWS = 3  # the pace of a cut: the median of this many latest windows' step times


def budget_steps(step: int, step_s: float, seconds_left: float, planned: int) -> int:
    """The total steps a time budget allows: those done, plus what fits the seconds left at `step_s` each
    (never more than planned, never fewer than done)."""
    return max(step, min(planned, step + int(max(seconds_left, 0.0) / max(step_s, 1e-9))))


def budget_pace(window_step_s: list[float]) -> float:
    """The step time a cut plans with: the median of the latest `BUDGET_PACE_WINDOWS` windows' step times. One
    slow window (a recompilation for a new batch width, a checkpoint written) moves it not at all, a lasting
    change of pace within two windows; the cosine schedule, which follows each cut, stays smooth (planned with
    the latest window alone, one window of 1,050 ms/step among ~305 ms ones on an H200 would cut a plan of 1,137
    steps to 447 and the learning rate from 2.85e-4 to 1.31e-4 for 50 steps, then back)."""
    return float(np.median(window_step_s[-BUDGET_PACE_WINDOWS:]))


def lr_lambda(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def f(step: int) -> float:  # linear warmup, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))

    return f


def _dist_info() -> tuple[int, int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def _resolve_device(device, local_rank: int) -> torch.device:
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": this process's current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


@dataclass
class _Parts:
    """What a run trains with: the drafter (and its DDP wrapper), the target's head and features, the optimizer."""

    config: DrafterConfig
    drafter: DFlashDrafter
    model: torch.nn.Module
    head: TargetHead
    features: TargetFeatures | None
    optimizer: torch.optim.Optimizer
    compiled: bool
    flex_tiles: dict  # flex attention's Triton tiles in the steps (empty: flex's own)


def _build_parts(recipe: DrafterRecipe, data, target_dir, device: torch.device, world: int,
                 init_weights, attention: str) -> _Parts:
    """Configs and models: fp32 master weights, bf16 autocast on GPU; the target's head is frozen, outside the
    optimizer; flex's tiles where the run's `attention` is flex."""
    cuda = device.type == "cuda"
    target_cfg = load_target_config(target_dir)
    layer_ids = list(recipe.target_layer_ids or getattr(data, "layer_ids", None) or []) or None
    config = DrafterConfig.from_target_config(
        target_cfg, num_layers=recipe.num_layers, block_size=recipe.block_size,
        mask_token_id=mask_token_id_in_dir(target_dir, recipe.mask_token_id), target_layer_ids=layer_ids)
    torch.manual_seed(recipe.seed)
    drafter = DFlashDrafter(config).to(device)
    if init_weights is not None:
        from safetensors.torch import load_file

        from dflash_assets.drafter.model import drafter_state_dict

        init = load_file(str(init_weights))
        own = drafter_state_dict(drafter)
        if sorted(init) != sorted(own) or any(init[k].shape != own[k].shape for k in own):
            raise ValueError(f"{init_weights}: the drafter to start from has other tensors or shapes than this run's")
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in init.items()})
    head = TargetHead.from_target_dir(target_dir, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    compiled = recipe.compile and cuda
    features = None
    if recipe.online:
        features = TargetFeatures(target_dir, config.target_layer_ids, device, torch.bfloat16 if cuda else torch.float32,
                                  compile=compiled)
    if compiled:
        apply_inductor_workarounds()
        allow_recompiles()
        for layer in drafter.layers:
            layer.compile()
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device.index] if cuda else None, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay,
                                  **({"fused": True} if cuda else {}))
    # flex's tiles: those set by the caller (torch_compile.set_flex_kernel_options), else the drafter's for this GPU
    tiles = current_flex_kernel_options() or (
        drafter_flex_kernel_options(device, config.head_dim) if attention == "flex" else {})
    return _Parts(config, drafter, model, head, features, optimizer, compiled, tiles)


def _batch_plan(recipe: DrafterRecipe, data, world: int, rank: int) -> BatchPlan:
    window = None  # with a cache limit, samples are shuffled within windows of parts that fit half of it
    if getattr(data, "groups", None) is not None and (recipe.cache_limit_gb or recipe.online):
        window = getattr(data, "max_bytes", None) or int((recipe.cache_limit_gb or 0) * 1e9)
        window //= 2
    return BatchPlan(len(data), recipe, world, rank, groups=getattr(data, "groups", None),
                     group_bytes=getattr(data, "group_bytes", None), window_bytes=window or None)


@dataclass
class _Progress:
    """What the loop accumulates and a saved state carries: step, losses, accuracy counts, tokens, tau, why it
    stopped."""

    step: int = 0
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)
    acc_counts: dict[str, Any] = field(default_factory=dict)
    tokens_before: int = 0  # sequence tokens trained by earlier invocations (resume)
    tokens_seen: int = 0  # this invocation
    draft_tokens: int = 0
    draft_slots: int = 0  # block tokens computed, padding included (this invocation)
    context_slots: int = 0  # context tokens computed, padding included (this invocation)
    aside_s: float = 0.0  # seconds of the loop in tau estimates and saved states (this invocation)
    stop_reason: str = ""
    # the steps whose batch shapes this invocation met first (a compiled step compiles there): their count,
    # seconds and sequence tokens
    shapes_seen: set = field(default_factory=set)
    new_shape_steps: int = 0
    new_shape_s: float = 0.0
    new_shape_tokens: int = 0

    def count_shapes(self, shapes: tuple, seconds: float, tokens: int) -> None:
        """A step's time and tokens go to the new-shape tally when its batch shapes are new to this invocation."""
        if shapes in self.shapes_seen:
            return
        self.shapes_seen.add(shapes)
        self.new_shape_steps += 1
        self.new_shape_s += seconds
        self.new_shape_tokens += tokens

    def step_rates(self, loop_s: float) -> dict[str, Any]:
        """``TrainResult``'s rates of the steps: alone (``aside_s`` left out), and past their first batch shapes."""
        return {"steps_tokens_per_s": self.tokens_seen / max(loop_s - self.aside_s, 1e-9), "aside_s": self.aside_s,
                "warm_tokens_per_s": self.warm_tokens_per_s(loop_s), "new_shape_steps": self.new_shape_steps,
                "new_shape_s": self.new_shape_s}

    def warm_tokens_per_s(self, loop_s: float) -> float:
        """Sequence tokens per second of the steps whose shapes were met before (no tau estimates, saved states
        or compiles): the rate a longer run keeps; 0 when every step met new shapes."""
        seconds = loop_s - self.aside_s - self.new_shape_s
        tokens = self.tokens_seen - self.new_shape_tokens
        return tokens / seconds if tokens > 0 and seconds > 0 else 0.0

    @property
    def tokens(self) -> int:
        return self.tokens_before + self.tokens_seen

    def count(self, epoch: int, stats: torch.Tensor, B: int) -> None:
        if epoch != self.acc_counts.get("epoch"):
            self.acc_counts = {"epoch": epoch, "correct": [0.0] * (B - 1), "count": [0.0] * (B - 1)}
        self.acc_counts["correct"] = [a + float(c) for a, c in zip(self.acc_counts["correct"], stats[1:B])]
        self.acc_counts["count"] = [a + float(c) for a, c in zip(self.acc_counts["count"], stats[B : 2 * B - 1])]


def _resume(progress: _Progress, src: Path, parts: _Parts, scheduler, device, recipe: DrafterRecipe, world: int,
            watch: TauWatch | None) -> int | None:
    """Load the state in `src` into the run; returns the total steps it had planned (a budget's cut plan stays
    cut)."""
    doc, history = load_training_state(src, parts.model, parts.optimizer, scheduler, device)
    if doc["recipe_fingerprint"] != recipe.fingerprint() or doc["world_size"] != world:
        raise ValueError(f"{src} is a different run (recipe or world size changed); use a new out_dir")
    progress.step = progress.resumed_from = doc["step"]
    progress.losses = history["losses"].tolist()
    progress.acc_counts = doc["accuracy_counts"]
    progress.tokens_before = int(doc.get("tokens_seen", 0))
    progress.stop_reason = doc.get("stop_reason", "")
    if watch is not None:
        watch.restore(doc.get("tau"))
    return doc.get("total_steps")


class _BudgetCut:
    """A time budget's cuts of the plan: the step time measured after warm-up, then again every
    `BUDGET_REPLAN_EVERY` steps at the recent pace (`budget_pace`)."""

    def __init__(self, budget_s: float | None, first_step: int, planned: int, t_loop: float):
        self.budget_s, self.first_step, self.planned, self.t_loop = budget_s, first_step, planned, t_loop
        self.t_measure, self.measured_from, self.window_paces = None, first_step, []

    def after_step(self, step: int, cuda: bool, world: int, device) -> int | None:
        """The new total after this step, when the budget cuts the plan here; else None."""
        done = step - self.first_step
        first_cut = BUDGET_WARMUP_STEPS + BUDGET_MEASURE_STEPS
        if self.budget_s is None or not (done in (BUDGET_WARMUP_STEPS, first_cut) or (
                done > first_cut and (done - first_cut) % BUDGET_REPLAN_EVERY == 0)):
            return None
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.t_measure is None:
            self.t_measure, self.measured_from = now, step
            return None
        self.window_paces.append((now - self.t_measure) / (step - self.measured_from))
        self.t_measure, self.measured_from = now, step
        cut = budget_steps(step, budget_pace(self.window_paces), self.budget_s - (now - self.t_loop), self.planned)
        if world > 1:  # every rank stops at the same step
            t = torch.tensor([cut], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            cut = int(t)
        return cut


def _tau_watch(recipe: DrafterRecipe, heldout, parts: _Parts, attention: str, rank: int) -> TauWatch | None:
    """rank 0's estimate of tau while training, when the run has a held-out slice (or a function making one)."""
    if rank != 0 or heldout is None or recipe.tau_prompts <= 0:
        return None
    if callable(heldout):
        heldout = heldout(parts.config)
    if heldout is None or len(heldout) == 0:
        return None
    if list(heldout.layer_ids) != list(parts.config.target_layer_ids):
        raise ValueError(f"the held-out slice has the target's layers {list(heldout.layer_ids)}, the drafter takes "
                         f"{list(parts.config.target_layer_ids)}")
    return TauWatch(heldout, parts.head, recipe.tau_every or recipe.save_every, recipe.early_stop_patience,
                    attention)


def _tau_stop(watch: TauWatch | None, recipe: DrafterRecipe, parts: _Parts, step: int, total: int, tokens: int,
              log, device, world: int) -> str | None:
    """Evaluate tau when due (rank 0); the early stop's reason, the same on every rank, or None."""
    if step % (recipe.tau_every or recipe.save_every) != 0 and step != total:
        return None
    reason = None
    if watch is not None:
        entry = watch.evaluate(parts.drafter, step, tokens)
        if log is not None:
            log({"step": step, "total_steps": total, "tau": entry, "best": watch.best})
        reason = watch.stop_reason if step < total else None
    if world > 1 and recipe.early_stop_patience is not None:
        flag = torch.tensor([1 if reason else 0], device=device)
        dist.broadcast(flag, 0)
        reason = reason or ("early stop (rank 0's held-out tau estimate)" if int(flag) else None)
    return reason


def train_drafter(
    recipe: DrafterRecipe,
    data_files: Sequence[str | Path],
    target_dir: str | Path,
    out_dir: str | Path,
    resume: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
    *,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    source: Any = None,
    time_budget_s: float | None = None,
    on_save: Callable[[int, int, DFlashDrafter], None] | None = None,
    init_weights: str | Path | None = None,
    heldout: HeldoutSlice | Callable[[DrafterConfig], HeldoutSlice | None] | None = None,
    packed: bool = True,
    profile_steps: tuple[int, int] | None = None,
) -> TrainResult:
    """Train (or continue training) a drafter; see the module docstring for what is read and written.

    data_files: hidden-state cache partitions (offline) or tokenized-sample files (recipe.online).
    source: where cache parts are read (default: data_files are local paths); a ``BoundedPartCache`` reads store
    keys through a bounded local cache, told the plan's part order so it fetches ahead; closed at the end.
    max_steps: stop after this global step (a resumable state is saved there); for smoke runs/tests.
    log: called on every rank-0 step with {"step", "loss", "lr", "tokens_per_s", "acc_by_pos", ...}, and at each
    tau estimate with {"step", "tau", "best"}.
    time_budget_s: the steps are cut to what fits this many seconds of training, at the step time measured
    after warm-up (steps `BUDGET_WARMUP_STEPS` to `BUDGET_WARMUP_STEPS + BUDGET_MEASURE_STEPS`), and cut again
    every `BUDGET_REPLAN_EVERY` steps at the recent pace (`budget_pace`; never past the recipe's plan): early steps
    that meet new batch widths are slower (H200: 1.26 s/step over steps 5-20 against 0.6 on average). The cosine
    schedule follows the latest cut; the run ends with a checkpoint.
    on_save: called on rank 0 at every saved state with (step, sequence tokens trained so far, the drafter).
    init_weights: a drafter ``model.safetensors`` to start from (a warm start) instead of random weights; its
    tensors must have the new drafter's names and shapes (else ValueError). A resumed state overrides it.
    heldout: tau while training (``tau_estimate``): a held-out slice, or a function of the drafter's config that
    makes one (None: none). Every ``recipe.tau_every`` steps (default ``save_every``) and at the end, rank 0
    estimates tau, a state is saved, the best is kept (``TrainResult.best``); ``recipe.early_stop_patience`` ends it.
    packed: batches in the packed layout (``data.Batch``: every sample's blocks and context in one row, no sample
    padded to the longest), else one padded row per sample (always so with SDPA on a GPU); the same losses either
    way, so the recipe does not name it. The padded shares of what was computed are in the result and each log.
    profile_steps: (start, stop): the steps after ``start`` up to ``stop`` profiled on rank 0 (``step_profile``).
    """
    t_start = time.perf_counter()
    rank, world, local_rank = _dist_info()
    device = _resolve_device(device, local_rank)
    cuda = device.type == "cuda"
    out = Path(out_dir)
    state_root = out / "state"
    if rank == 0:  # what a killed earlier run left half-written (temp dirs, a moved-aside copy)
        for d in (out, state_root):
            clean_stale_temps(d)
    if world > 1:
        dist.barrier()
    attention = recipe.attention if recipe.attention != "auto" else ("flex" if cuda else "sdpa")
    # packed SDPA attends piece by piece (loss.dflash_segmented_mask): right for a CPU, not for a GPU's launches
    packed = packed and not (cuda and attention == "sdpa")
    B = recipe.block_size
    data = open_training_data(data_files, recipe, source=source)
    if len(data) == 0:
        raise ValueError("no training sequence has an anchor position (loss_mask empty?)")
    parts = _build_parts(recipe, data, target_dir, device, world, init_weights, attention)
    plan = _batch_plan(recipe, data, world, rank)
    total = plan.total_steps
    schedule = {"total": total}  # a time budget cuts it once the step time is known; the cosine follows
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        parts.optimizer, lambda k: lr_lambda(schedule["total"], recipe.warmup_ratio)(k))
    watch = _tau_watch(recipe, heldout, parts, attention, rank)
    progress = _Progress(acc_counts={"epoch": 0, "correct": [0.0] * (B - 1), "count": [0.0] * (B - 1)})
    src = latest_state_dir(state_root) if resume else None
    if src is not None:
        total = schedule["total"] = int(_resume(progress, src, parts, scheduler, device, recipe, world, watch) or total)
    tau_on = heldout is not None and recipe.tau_prompts > 0  # known alike on every rank (rank 0 holds the slice)
    profiler = StepProfiler(*profile_steps, device) if profile_steps is not None and rank == 0 else None
    with flex_kernel_options(parts.flex_tiles):
        t_loop = _train_loop(recipe, parts, data, plan, scheduler, schedule, progress, watch, tau_on, state_root,
                             device, attention, world, rank, max_steps, source, time_budget_s, log, on_save, packed,
                             profiler)
    total = schedule["total"]
    data_stats = source.stats.as_dict() if hasattr(source, "stats") else {}
    if source is not None and hasattr(source, "close"):
        source.close()
    ckpt = None
    if progress.step >= total:
        ckpt = out / "drafter"
        if rank == 0:
            save_drafter(parts.drafter, ckpt, dtype=getattr(torch, recipe.checkpoint_dtype),
                         metadata={"recipe": json.dumps(recipe.to_dict(), default=list)})
        if world > 1:
            dist.barrier()
    acc = [c / max(n, 1.0) for c, n in zip(progress.acc_counts["correct"], progress.acc_counts["count"])]
    return TrainResult(
        checkpoint_dir=ckpt, state_dir=latest_state_dir(state_root), steps=progress.step, total_steps=total,
        losses=progress.losses, tokens_per_s=progress.tokens_seen / max(t_loop, 1e-9), accuracy_by_position=acc,
        **progress.step_rates(t_loop),
        resumed_from_step=progress.resumed_from, wall_s=time.perf_counter() - t_start, num_sequences=len(data),
        world_size=world, config=parts.config.to_hf_dict(), data_stats=data_stats, draft_tokens=progress.draft_tokens,
        sequence_tokens=progress.tokens_seen, draft_slots=progress.draft_slots, context_slots=progress.context_slots,
        tau_history=watch.history if watch else [], best=watch.best if watch else None,
        stop_reason=progress.stop_reason, flex_kernel_options=parts.flex_tiles,
        profile=profiler.summary() if profiler is not None else None)


def _train_loop(recipe, parts: _Parts, data, plan: BatchPlan, scheduler, schedule, progress: _Progress,
                watch: TauWatch | None, tau_on: bool, state_root: Path, device, attention: str, world: int, rank: int,
                max_steps, source, time_budget_s, log, on_save, packed: bool = True,
                profiler: StepProfiler | None = None) -> float:
    """Steps from `progress.step` to the plan's end (or max_steps, or an early stop); returns the loop's seconds."""
    B, cuda = recipe.block_size, device.type == "cuda"
    total = schedule["total"]
    stop = min(total, max_steps) if max_steps is not None else total
    if source is not None and hasattr(source, "set_schedule") and progress.step < stop:
        to_cache = np.asarray([source.part_index(k) for k in data.group_keys], dtype=np.int32)
        source.set_schedule(to_cache[data.groups[plan.sample_order(progress.step, stop)]])
    loader = BatchLoader(data, plan, progress.step, stop, cuda, packed=packed) if progress.step < stop else None
    t_loop = time.perf_counter()
    budget = _BudgetCut(time_budget_s, progress.step, plan.total_steps, t_loop)
    while progress.step < stop:
        if profiler is not None:
            profiler.before_step(progress.step + 1)
        t_step = time.perf_counter()
        _, cpu_batch = loader.next()
        batch = cpu_batch.to(device)
        hidden = parts.features.for_batch(batch) if parts.features is not None else batch.hidden
        if not cuda:
            hidden = hidden.float()  # fp32 on CPU (the cache may hold bf16)
        stats, w_total = train_step(parts.model, parts.head, parts.optimizer, batch, hidden, block_size=B,
                                    mask_token_id=parts.config.mask_token_id, gamma=recipe.loss_gamma,
                                    attention=attention, grad_clip=recipe.grad_clip, compiled_loss=parts.compiled,
                                    world=world, objective=recipe.objective, dpace_alpha=recipe.dpace_alpha)
        scheduler.step()
        progress.step += 1
        step = progress.step
        cut = budget.after_step(step, cuda, world, device)
        if cut is not None:
            total = schedule["total"] = cut
            stop = min(total, max_steps) if max_steps is not None else total
            if log is not None and rank == 0:
                log({"step": step, "total_steps": total, "budget": True, "step_s": budget_pace(budget.window_paces),
                     "window_step_s": budget.window_paces[-1]})
        # metrics over the global batch: real tokens (sequence, draft), then what was computed (padding included)
        stats = torch.cat([stats, torch.tensor([float(batch.num_tokens), float(cpu_batch.keep.sum()) * B,
                                                float(cpu_batch.block_slots * B), float(cpu_batch.context_slots)],
                                               device=device)])
        if world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        step_loss = float(stats[0] / w_total.cpu().clamp_min(1e-6))
        progress.losses.append(step_loss)
        tokens, drafted, draft_slots, context_slots = (int(x) for x in stats[-4:])
        progress.count_shapes(cpu_batch.shapes, time.perf_counter() - t_step, tokens)  # stats.cpu() waited for it
        progress.tokens_seen += tokens
        progress.draft_tokens += drafted
        progress.draft_slots += draft_slots
        progress.context_slots += context_slots
        epoch = (step - 1) // plan.steps_per_epoch
        progress.count(epoch, stats, B)
        if profiler is not None:
            profiler.after_step(step)
        if log is not None and rank == 0:
            el = time.perf_counter() - t_loop
            log({"step": step, "total_steps": total, "epoch": epoch, "loss": step_loss, "tokens": tokens,
                 "lr": scheduler.get_last_lr()[0], "tokens_per_s": progress.tokens_seen / max(el, 1e-9),
                 "padded_block_share": 1.0 - drafted / max(draft_slots, 1),
                 "padded_context_share": 1.0 - tokens / max(context_slots, 1),
                 "acc_by_pos": (stats[1:B] / stats[B : 2 * B - 1].clamp_min(1)).tolist()})
        # on the plan's grid and at its end (not at max_steps), the same on every rank: each saves a state there
        t_aside = time.perf_counter()  # the step's GPU work is done: its stats were read back above
        evaluated = tau_on and (step % (recipe.tau_every or recipe.save_every) == 0 or step == total)
        reason = _tau_stop(watch, recipe, parts, step, total, progress.tokens, log, device, world)
        if reason:  # the plan ends here: the schedule, a resume and the published checkpoint all see it
            total = schedule["total"] = stop = step
            progress.stop_reason = reason
        elif step >= total:
            progress.stop_reason = "completed" + (f" (a time budget cut the plan of {plan.total_steps} steps)"
                                                  if total < plan.total_steps else "")
        if step % recipe.save_every == 0 or step == stop or evaluated:
            _save_state(rank, world, state_root, step, parts.model, parts.optimizer, scheduler, recipe, total,
                        progress, watch)
            if on_save is not None and rank == 0:
                on_save(step, progress.tokens, parts.drafter)
        progress.aside_s += time.perf_counter() - t_aside
    if profiler is not None:
        profiler.after_step(progress.step, last=True)  # a window the run stopped inside ends with it
    if loader is not None:
        loader.close()
    return time.perf_counter() - t_loop


def _save_state(rank, world, state_root, step, model, optimizer, scheduler, recipe, total, progress: _Progress,
                watch: TauWatch | None):
    if rank == 0:
        trainer = {"recipe": recipe.to_dict(), "recipe_fingerprint": recipe.fingerprint(), "world_size": world,
                   "total_steps": total, "accuracy_counts": progress.acc_counts, "tokens_seen": progress.tokens,
                   "stop_reason": progress.stop_reason, "tau": watch.state() if watch is not None else None}
        save_training_state(state_root, step, model, optimizer, scheduler, trainer,
                            {"losses": torch.tensor(progress.losses, dtype=torch.float64)})
    if world > 1:
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# CLI (torchrun entry point)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="recipe JSON file (DrafterRecipe fields)")
    p.add_argument("--data", nargs="+", required=True, help="cache / tokenized-sample files")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--result", default=None, help="write the TrainResult metrics JSON here (rank 0)")
    p.add_argument("--log-every", type=int, default=10)
    a = p.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    recipe = DrafterRecipe.from_dict(json.loads(Path(a.recipe).read_text()))

    def log(m):
        if m["step"] % a.log_every == 0 or m["step"] == m["total_steps"]:
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in m.items()
                              if k != "acc_by_pos"}), flush=True)

    res = train_drafter(recipe, a.data, a.target, a.out, resume=not a.no_resume, log=log, max_steps=a.max_steps)
    if _dist_info()[0] == 0 and a.result:
        Path(a.result).write_text(json.dumps({**res.to_metadata(), "losses": res.losses}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

