"""The preflight: before a recipe's long run, its own drafter memorizes a handful of its samples and decodes them.

A drafter that can be trained at all can memorize a few sequences: trained on them until it has, it must then draft
them whole when decoding, tau near the block size, losslessly. When it does not, the training layout and the
decoding disagree (block layout, masks, labels, the target layers the features come from), and a long run would
learn the wrong thing for hours. :func:`run_preflight` takes minutes at most (seconds at the demo's size, on a CPU):

1. the memorization set: the prompts of the first ``samples`` of the recipe's training sequences (the tokens before
   each one's first supervised token, at most ``prompt_tokens``), each with the target's greedy continuation of
   ``new_tokens + B`` tokens (what a lossless decode writes), and the target's features at the layers the
   recipe's data carries (a hidden-state cache's header; online, the drafter's own), as one cache part;
2. the recipe's drafter (its layers, block size, target layers, mask id, objective) trained on it by
   ``training.train_drafter`` with every anchor at learning rate ``lr`` until it has memorized the set: every
   block position right on it, or every prompt decoded at the most a drafter can get (at most ``steps`` steps);
3. the drafter decoded on those prompts for ``new_tokens`` tokens by ``decoding.evaluate_drafter`` (greedy,
   lossless checked), and teacher-forced (``tau_estimate``) on the features training saw and on those decoding sees;
4. the recipe's cached features themselves (offline) against the target's layers as decoding captures them
   (:func:`feature_layers`): each cached slot must be nearest to the drafter's layer, not a neighbour. A drafter
   that memorizes a few sequences can lean on its block tokens alone, so this is checked directly.

It passes when the features are the drafter's layers, the decode is lossless and tau reaches ``min_ratio`` of the
most a perfect drafter gets on these lengths; a failure names per-position accuracy at each point and what to look
at.

Reads the recipe's training files and the target directory; writes a work directory (the set, the drafter).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dflash_assets.drafter.recipe import DrafterRecipe

# Training accuracy (mean over block positions) at which the set counts as learned: the bar a failed preflight's
# diagnosis uses, and the point from which a chunk of training ends with a decode of the memorized prompts.
MEMORIZED = 0.95

__all__ = ["MEMORIZED", "PreflightResult", "PreflightFailed", "preflight_recipe", "perfect_tau", "feature_layers",
           "run_preflight"]


@dataclass
class PreflightResult:
    passed: bool
    tau: float  # decoded on the memorized prompts
    tau_max: float  # what a drafter right at every position gets on these lengths
    lossless: bool
    train_accuracy_by_position: list[float]  # against the labels training built
    forced_accuracy_by_position: list[float]  # teacher-forced, the features training saw, the true next tokens
    decode_accuracy_by_position: list[float]  # teacher-forced, the features decoding sees (the drafter's layers)
    acceptance_by_position: list[float]  # decoded: share of verifications accepting block position k = 1..B
    steps: int
    samples: int
    layer_ids: dict[str, list[int]]  # {"data": the features' layers, "drafter": the layers the checkpoint declares}
    wall_s: float
    features: dict[str, Any] | None = None  # ``feature_layers``: which layers the cached features are
    problems: list[str] = field(default_factory=list)  # what to look at, when it failed

    def summary(self) -> str:
        head = (f"preflight {'passed' if self.passed else 'FAILED'}: tau {self.tau:.2f} of at most "
                f"{self.tau_max:.2f} on {self.samples} memorized samples after {self.steps} steps, "
                f"lossless {self.lossless}")
        return "; ".join([head, *self.problems])

    def to_metadata(self) -> dict[str, Any]:
        r = lambda xs: [round(float(x), 3) for x in xs]  # noqa: E731
        return {"passed": self.passed, "tau": round(self.tau, 3), "tau_max": round(self.tau_max, 3),
                "lossless": self.lossless, "steps": self.steps, "samples": self.samples, "wall_s": round(self.wall_s, 1),
                "train_accuracy_by_position": r(self.train_accuracy_by_position),
                "forced_accuracy_by_position": r(self.forced_accuracy_by_position),
                "decode_accuracy_by_position": r(self.decode_accuracy_by_position),
                "acceptance_by_position": r(self.acceptance_by_position), "layer_ids": self.layer_ids,
                "features": self.features or "computed at the drafter's layers (online)",
                "problems": self.problems or ["none"], "summary": self.summary()}


class PreflightFailed(RuntimeError):
    def __init__(self, result: PreflightResult):
        super().__init__(result.summary())
        self.result = result


def preflight_recipe(recipe: DrafterRecipe, *, samples: int, steps: int, lr: float) -> DrafterRecipe:
    """The recipe's drafter, trained to memorize: same shapes, layers, mask id and objective; all samples in
    one batch, every anchor, a flat learning rate after one warm-up step, no estimate, no early stop."""
    return dataclasses.replace(
        recipe, name=f"{recipe.name}-preflight", epochs=steps, batch_size=samples, max_anchors=4096, lr=lr,
        warmup_ratio=0.0, weight_decay=0.0, partitions=(), online=False, save_every=10**9, compile=False,
        cache_limit_gb=None, init_from=None, checkpoint_dtype="float32", tau_prompts=0, early_stop_patience=None,
        max_length=max(recipe.max_length, 4096))


def perfect_tau(continuation: int, block_size: int) -> float:
    """tau of a drafter right at every position on a continuation of this length: the prefill writes the first
    token, each verification then B (the last one what is left)."""
    done, rounds = 1, 0
    while done < continuation:
        done, rounds = done + min(block_size, continuation - done), rounds + 1
    return (continuation - 1) / rounds if rounds else 0.0


def _prompts(recipe: DrafterRecipe, data_files: Sequence[str | Path], samples: int, prompt_tokens: int):
    """(prompts, the layers the data's features come from): the first `samples` training sequences' prompts."""
    from dflash_assets.drafter.data import CacheSamples, ParquetSamples
    from dflash_assets.drafter.decoding import EvalPrompt

    files = [str(f) for f in data_files]
    if recipe.online and all(f.endswith(".parquet") for f in files):
        data = ParquetSamples(files, recipe.max_length, recipe.block_size)
    else:
        data = CacheSamples(files, recipe.max_length, recipe.block_size, need_hidden=False)
    prompts = []
    for i in range(len(data)):
        s = data[i]
        first = int(np.argmax(s.loss_mask)) if s.loss_mask.any() else 0
        if first > 0:
            prompts.append(EvalPrompt(tuple(int(t) for t in s.input_ids[max(0, first - prompt_tokens):first]),
                                      "preflight", f"sample-{i}"))
        if len(prompts) == samples:
            break
    if not prompts:
        raise ValueError(f"recipe {recipe.name}: no training sequence has a prompt before its supervised tokens")
    return prompts, (None if recipe.online else list(getattr(data, "layer_ids", None) or []) or None)


def _memorize(pre: DrafterRecipe, part: Path, target_dir, out: Path, device,
              decodes_whole: Callable[[Any], bool] | None = None, chunk: int = 20):
    """Train in chunks of steps until the set is memorized (one step is one epoch: the batch is the whole set), or
    the steps run out. Memorized: every block position right on every anchor, or, once training is right on most
    of them (``MEMORIZED``), ``decodes_whole(drafter)``: the memorized prompts decoded at the most a drafter can
    get (some anchors, e.g. under dpace's weights the block's last positions, come right only long after).
    Returns (the last TrainResult, the drafter)."""
    from dflash_assets.drafter.training import train_drafter

    done = 0
    while True:
        done = min(done + chunk, pre.epochs)
        trained = train_drafter(pre, [part], target_dir, out, resume=True, device=device, max_steps=done)
        accuracy = trained.accuracy_by_position
        if done >= pre.epochs or min(accuracy) >= 1.0:
            break
        if decodes_whole is not None and float(np.mean(accuracy)) >= MEMORIZED:
            drafter = _load_drafter(trained, out)
            if decodes_whole(drafter):
                return trained, drafter
    return trained, _load_drafter(trained, out)


def _load_drafter(trained, out: Path):
    """The drafter of the latest training state under ``out``, in float32, for decoding."""
    from safetensors.torch import load_file

    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig
    from dflash_assets.drafter.state import latest_state_dir

    drafter = DFlashDrafter(DrafterConfig.from_hf_dict(trained.config))
    drafter.load_state_dict(load_file(str(latest_state_dir(out / "state") / "drafter.safetensors")))
    return drafter.float().eval()


@torch.no_grad()
def feature_layers(recipe: DrafterRecipe, data_files: Sequence[str | Path], model, drafter_layers: Sequence[int],
                   samples: int = 2, max_tokens: int = 256) -> dict[str, Any] | None:
    """Which of the target's layers the recipe's cached features are: for each cached slot, the layer among the
    drafter's layer and its neighbours whose output (``LayerCapture``, what decoding feeds the drafter) is nearest
    to it, by relative error over the first ``samples`` sequences' first ``max_tokens`` tokens. None for an online
    recipe (its features are computed at the drafter's layers, by the same capture as decoding)."""
    from dflash_assets.drafter.data import CacheSamples
    from dflash_assets.target_model.layer_capture import LayerCapture

    if recipe.online:
        return None
    data = CacheSamples([str(f) for f in data_files], recipe.max_length, recipe.block_size, need_hidden=True)
    n_layers = len(LayerCapture(model, [0], cut=False).layers)
    candidates = sorted({c for layer in drafter_layers for c in (layer - 1, layer, layer + 1) if 0 <= c < n_layers})
    dev = next(model.parameters()).device
    err = torch.zeros(len(drafter_layers), len(candidates))
    for i in range(min(samples, len(data))):
        s = data[i]
        ids = torch.as_tensor(s.input_ids[:max_tokens], device=dev)[None]
        cached = s.hidden[:max_tokens].float().view(ids.shape[1], len(data.layer_ids), -1)  # (T, n, H)
        if cached.shape[1] != len(drafter_layers):
            return {"matches": False, "cached": list(data.layer_ids), "nearest": [],
                    "drafter": list(drafter_layers), "relative_error": None}
        with LayerCapture(model, candidates, cut=False) as capture:
            model(input_ids=ids, use_cache=False)
            fresh = capture.features()[0].float().view(ids.shape[1], len(candidates), -1).cpu()  # (T, m, H)
        for j in range(len(drafter_layers)):
            err[j] += ((fresh - cached[:, j:j + 1]).norm(dim=(0, 2)) / cached[:, j].norm().clamp_min(1e-6)).cpu()
    nearest = [candidates[int(e.argmin())] for e in err]
    own = [float(err[j, candidates.index(layer)]) / max(samples, 1) for j, layer in enumerate(drafter_layers)]
    return {"matches": nearest == list(drafter_layers), "cached": list(data.layer_ids), "nearest": nearest,
            "drafter": list(drafter_layers), "relative_error": [round(e, 4) for e in own]}


def _drafter_layers(recipe: DrafterRecipe, target_dir: str | Path) -> list[int]:
    """The target layers the recipe's drafter takes when its data names none: its own, else the default rule."""
    from dflash_assets.drafter.model import DrafterConfig, load_target_config

    config = DrafterConfig.from_target_config(load_target_config(target_dir), num_layers=recipe.num_layers,
                                              block_size=recipe.block_size, mask_token_id=0,
                                              target_layer_ids=list(recipe.target_layer_ids or []) or None)
    return list(config.target_layer_ids)


def _diagnose(r: PreflightResult, memorized: float = MEMORIZED, min_acc: float = 0.75) -> list[str]:
    """What to look at, from where accuracy is lost: training, the labels, the features' layers, or decoding.
    Teacher-forced accuracy counts every anchor, also those near a sequence's end that training never anchors
    (no full block fits): it sits below training's on a memorized set, hence the lower bar ``min_acc``."""
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    train, forced, decode = (mean(x) for x in (r.train_accuracy_by_position, r.forced_accuracy_by_position,
                                                r.decode_accuracy_by_position))
    if not r.lossless:
        return ["the speculative decode differs from the target's greedy output: a verification bug (decoding)"]
    if train < memorized:
        return [f"training did not memorize {r.samples} samples in {r.steps} steps (accuracy {train:.2f}): check the "
                "masks (a block must see the context before its anchor: loss.dflash_dense_mask / dflash_block_mask), "
                "the loss weights and lr, or give it more steps"]
    if forced < min_acc:
        return [f"training learned its labels (accuracy {train:.2f}) but they are not the next tokens (accuracy "
                f"{forced:.2f} against them): check loss.block_labels (label k = token anchor + k), the anchors and "
                "loss_mask alignment with input_ids"]
    if decode < min_acc:
        return [f"the drafter predicts from the features it trained on (accuracy {forced:.2f}) but not from those "
                f"decoding gives it (accuracy {decode:.2f}): the data's target layers {r.layer_ids['data']} are not "
                f"the checkpoint's {r.layer_ids['drafter']} (recipe target_layer_ids against the cache's)"]
    return [f"teacher-forced accuracy is {decode:.2f} but decoding reaches tau {r.tau:.2f} of {r.tau_max:.2f}: the "
            "decode path (positions, the draft cache, block layout at decode time) differs from training's"]


def run_preflight(recipe: DrafterRecipe, data_files: Sequence[str | Path], target_dir: str | Path, *,
                  samples: int = 2, prompt_tokens: int = 32, new_tokens: int | None = None, steps: int = 200,
                  lr: float = 3e-3, min_ratio: float = 0.8, device: str | None = None,
                  work_dir: str | Path | None = None, log: Callable[[str], None] = print) -> PreflightResult:
    """Memorize, decode, judge (see the module docstring). ``new_tokens`` (default B + 1: one verification that
    can accept every block position, after the prefill's token); ``steps``: at most, training stops once the set is
    memorized (``_memorize``); ``min_ratio``: of ``perfect_tau``, for a pass."""
    from dflash_assets.drafter.decoding import EvalPrompt, evaluate_drafter, load_target
    from dflash_assets.drafter.model import TargetHead
    from dflash_assets.drafter.tau_estimate import build_slice, estimate_tau, save_slice

    t0 = time.perf_counter()
    B = recipe.block_size
    new_tokens = new_tokens or B + 1
    prompts, data_layers = _prompts(recipe, data_files, samples, prompt_tokens)
    data_layers = data_layers or _drafter_layers(recipe, target_dir)
    model = load_target(target_dir, device, torch.float32)  # float32: the lossless check is exact
    drafter_layers = list(recipe.target_layer_ids or data_layers)
    features = feature_layers(recipe, data_files, model, drafter_layers)
    own = Path(tempfile.mkdtemp(prefix="dflash-preflight-")) if work_dir is None else Path(work_dir)
    try:
        seen = build_slice(model, prompts, data_layers, max_new_tokens=new_tokens + B)
        part = save_slice(own / "memorize.safetensors", seen, target_model=str(target_dir))
        memorized = [EvalPrompt(tuple(ids[:n].tolist()), "preflight", pid)
                     for ids, n, pid in zip(seen.input_ids, seen.prompt_lens, seen.prompt_ids)]
        dev = next(model.parameters()).device

        def decodes_whole(drafter) -> bool:
            got = evaluate_drafter(drafter.to(dev), model, memorized, max_new_tokens=new_tokens, check_lossless=True)
            return bool(got.lossless) and got.tau >= perfect_tau(new_tokens, B)

        trained, drafter = _memorize(preflight_recipe(recipe, samples=len(seen), steps=steps, lr=lr), part,
                                     target_dir, own / "train", device, decodes_whole)
        drafter = drafter.to(dev)
        layers = {"data": list(data_layers), "drafter": list(drafter.config.target_layer_ids)}
        head = TargetHead.from_model(model)
        forced = estimate_tau(drafter, head, seen)
        at_decode = forced if layers["data"] == layers["drafter"] else estimate_tau(
            drafter, head, build_slice(model, memorized, layers["drafter"], max_new_tokens=new_tokens + B))
        decoded = evaluate_drafter(drafter, model, memorized, max_new_tokens=new_tokens, check_lossless=True)
    finally:
        if work_dir is None:
            shutil.rmtree(own, ignore_errors=True)
    from dflash_assets.chart_data import share_at_least

    counts = decoded.acceptance_length_counts + [0] * (B + 1 - len(decoded.acceptance_length_counts))
    result = PreflightResult(
        passed=False, tau=float(decoded.tau), tau_max=perfect_tau(new_tokens, B), lossless=bool(decoded.lossless),
        train_accuracy_by_position=list(trained.accuracy_by_position),
        forced_accuracy_by_position=forced.accuracy_by_position,
        decode_accuracy_by_position=at_decode.accuracy_by_position, acceptance_by_position=share_at_least(counts),
        steps=trained.steps, samples=len(seen), layer_ids=layers, wall_s=time.perf_counter() - t0,
        features=features)
    aligned = features is None or features["matches"]
    result.passed = aligned and result.lossless and result.tau >= min_ratio * result.tau_max
    if not aligned:
        result.problems = [f"the cached features are the target's layers {features['nearest']} (nearest of each "
                           f"slot; the cache's header says {features['cached']}), the drafter takes "
                           f"{features['drafter']}: the data's target layers are not the checkpoint's (recipe "
                           "target_layer_ids against the cache's, or the capture's layer numbering: layer id i is "
                           "the output of decoder layer i)"]
    elif not result.passed:
        result.problems = _diagnose(result)
    log(result.summary())
    return result
