"""The drafter stages over the store: recipes, training a checkpoint, measuring acceptance length.

Recipes (one ``drafter_recipes`` partition each) live in the store as ``drafter_recipes/<name>.json`` (a
:class:`DrafterRecipe`); the partition key is the recipe's name, which carries its version (``demo-v1``).

- :func:`train_recipe` reads the hidden-state cache partitions the recipe selects (or, for an online recipe, the
  tokenized samples, after checking their quality gate), trains in a work directory on the GPU host (resumable: a
  killed run continues from its last saved state there), and publishes
  ``drafter_checkpoint/<recipe>/<version>/{model.safetensors,config.json,train_metrics.json,provenance.json}``,
  then ``drafter_checkpoint/<recipe>/manifest.json`` naming them (last, so a kill never mixes files of two runs;
  see ``store.manifest``).
- :func:`train_recipe` with ``preflight`` first proves the recipe's layout on a handful of its samples
  (``drafter.preflight``) and writes ``drafter_preflight/<recipe>.json``; it estimates tau while training on the
  recipe's held-out prompts (``drafter.tau_estimate``) and marks the best checkpoint in ``train_metrics.json``.
- :func:`eval_recipe` downloads the checkpoint its manifest names, renders held-out prompts
  (shards the recipe did not train on) with the target's chat template, runs
  greedy speculative decoding against the target, checks losslessness, and
  writes ``drafter_eval/<recipe>.json`` (tau overall and by slice); with a
  promotion margin it also decides promotion among the run's checkpoints and
  writes ``drafter_promoted/<family>/manifest.json`` when one wins
  (``drafter.promotion``).
- A recipe with ``init_from: promoted`` trains from the weights that manifest
  names (a warm start after the target changed) when the shapes match.

``pipes_stage_train`` / ``pipes_stage_eval`` are the entry points of the
Pipes worker on the GPU host. Imports torch and transformers lazily through
the training and decoding modules; pyarrow only where Parquet is read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from dflash_assets.atomic_write import atomic_path
from dflash_assets.cache_keys import content_key
from dflash_assets.store import layout
from dflash_assets.store.manifest import publish_files
from dflash_assets.chart_data import curve_points, share_at_least
from dflash_assets.drafter.promotion import prompt_slices, tau_by_slice
from dflash_assets.drafter.recipe import DrafterRecipe

logger = logging.getLogger(__name__)

CHECKPOINT_FILES = ("model.safetensors", "config.json")


def save_recipe(store: Any, recipe: DrafterRecipe) -> str:
    """Store a recipe under its name (the partition key); returns the key."""
    if not recipe.name or "/" in recipe.name:
        raise ValueError(f"recipe name must be a non-empty partition key without '/': {recipe.name!r}")
    store.write_json(layout.drafter_recipe(recipe.name), recipe.to_dict())
    return layout.drafter_recipe(recipe.name)


def load_recipe(store: Any, name: str) -> DrafterRecipe:
    if not store.exists(layout.drafter_recipe(name)):
        raise FileNotFoundError(f"no recipe {name!r} in the store ({layout.drafter_recipe(name)}); register it first")
    return DrafterRecipe.from_dict(store.read_json(layout.drafter_recipe(name)))


def training_shards(store: Any, recipe: DrafterRecipe) -> list[str]:
    """The shards a recipe trains on: its explicit selection, else every shard with a cache (or samples)."""
    if recipe.partitions:
        return list(recipe.partitions)
    if recipe.online:
        return layout.list_sample_shards(store)
    return list(layout.list_hidden_state_parts(store))


def _cache_entries(store: Any, recipe: DrafterRecipe, shards: list[str]) -> list[dict[str, Any]]:
    """The cache parts a recipe trains on, in order, each ``{"key", "bytes"}`` (from the manifests)."""
    entries = layout.list_hidden_state_entries(store)
    out = []
    for shard in shards:
        if not entries.get(shard):
            raise FileNotFoundError(f"recipe {recipe.name!r} selects {shard!r}, which has no hidden-state cache; "
                                    f"materialize hidden_state_cache for it first")
        out += [{"key": e["key"], "bytes": e["bytes"] if e["bytes"] is not None else store.size(e["key"])}
                for e in entries[shard]]
    return out


def _training_files(store: Any, recipe: DrafterRecipe, shards: list[str]) -> list[Path]:
    if recipe.online:
        from dflash_assets.tokenization.quality import verified_samples_path

        return [verified_samples_path(store, s) for s in shards]  # refused unless the gate passed these bytes
    return [store.local_path(e["key"]) for e in _cache_entries(store, recipe, shards)]


def torch_dtype(name: str | None):
    """A torch dtype by name ("float32", "bfloat16", as ``hidden_states.format.torch_dtype`` reads it); None stays
    None (the loader's default)."""
    from dflash_assets.hidden_states.format import torch_dtype as by_name

    return None if name is None else by_name(name)


def default_work_dir() -> Path:
    from dflash_assets.target_model.tokenizer import default_cache_root

    return default_cache_root() / "train"


def train_recipe(store: Any, name: str, target: Any, *, work_dir: str | None = None, device: str | None = None,
                 max_steps: int | None = None, log: Callable[[str], None] = logger.info,
                 log_every: int = 10, time_budget_s: float | None = None,
                 provenance_inputs: dict[str, Any] | None = None, preflight: bool = False,
                 preflight_run: str = "", profile_steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train the recipe ``name`` against ``target`` (a ``TargetModelSpec``); returns metadata.

    ``preflight``: first prove the recipe's drafter memorizes a handful of its samples and decodes them
    (``drafter.preflight``); its report goes to ``drafter_preflight/<name>.json`` (with ``preflight_run``, the
    orchestrator's run id), and a failure raises ``PreflightFailed`` before the long run. A run that resumes a saved
    state passed it before: the report says so.

    ``provenance_inputs``: what only the orchestrator knows, for ``provenance.json`` (``provenance.build_provenance``:
    ``generation_settings``, ``decontamination``, ``dagster_code_versions``); published with the checkpoint.

    ``time_budget_s``: the steps are cut to what fits (``train_drafter``). Every saved state (each
    ``recipe.save_every`` steps) also leaves a learning-curve checkpoint, published beside the final one as
    ``curve-step-NNNNNNNN.safetensors`` and listed (step, sequence tokens) in ``train_metrics.json``'s
    ``curve``; ``eval_recipe(curve_prompts=...)`` measures tau on them. ``profile_steps``: see ``train_drafter``."""
    from dflash_assets.cache_keys import build_fingerprint
    from dflash_assets.drafter.training import train_drafter

    recipe = load_recipe(store, name)
    shards = training_shards(store, recipe)
    if not shards:
        raise FileNotFoundError(f"recipe {name!r}: no training data in the store yet")
    files, source, data_sig = _training_inputs(store, recipe, shards, work_dir, log)
    # The work dir is keyed by the recipe, its data and the trainer's code (and torch), so changed data or
    # a changed trainer never resumes (or re-publishes) a stale run.
    data_tag = content_key(data_sig, length=8)
    code_tag = build_fingerprint(modules=["dflash_assets.drafter.training"], packages=["torch"]).digest[:8]
    work = Path(work_dir or default_work_dir()) / f"{name}-{recipe.fingerprint()}-{data_tag}-{code_tag}"
    log(f"recipe {name}: {len(shards)} shards, {len(files)} files, work dir {work} (resumes from its last state)")

    def on_step(m: dict[str, Any]) -> None:
        if "tau" in m:
            log(f"step {m['step']}: held-out tau estimate {m['tau']['tau']:.3f} (greedy walk {m['tau']['walk_tau']:.3f}); "
                f"best {m['best']['tau']:.3f} at step {m['best']['step']}")
        elif m.get("budget"):
            log(f"step {m['step']}: {m['step_s'] * 1000:.0f} ms/step after warm-up (the last "
                f"{m['window_step_s'] * 1000:.0f}): {m['total_steps']} steps fit the time budget")
        elif m["step"] % log_every == 0 or m["step"] == 1:
            log(f"step {m['step']}: loss {m['loss']:.4f}, lr {m['lr']:.2e}, {m.get('tokens_per_s', 0):.0f} tok/s, "
                f"padding {m.get('padded_block_share', 0):.1%} of block tokens, "
                f"{m.get('padded_context_share', 0):.1%} of context tokens")

    curve_dir = work / "curve"
    curve: list[dict[str, Any]] = []

    def on_save(step: int, tokens: int, drafter: Any) -> None:
        from safetensors.torch import save_file

        from dflash_assets.drafter.model import drafter_state_dict

        curve_dir.mkdir(parents=True, exist_ok=True)
        path = curve_dir / f"curve-step-{step:08d}.safetensors"
        with atomic_path(path) as tmp:
            save_file({k: v.detach().to("cpu", torch_dtype(recipe.checkpoint_dtype)).contiguous()
                       for k, v in drafter_state_dict(drafter).items()}, str(tmp))
        curve[:] = [c for c in curve if c["step"] != step] + [{"step": step, "tokens": tokens, "file": path.name}]

    for path in sorted(curve_dir.glob("curve-step-*.json")) if curve_dir.exists() else []:  # an earlier run's points
        curve.append(json.loads(path.read_text()))

    def on_save_recorded(step: int, tokens: int, drafter: Any) -> None:
        on_save(step, tokens, drafter)
        (curve_dir / f"curve-step-{step:08d}.json").write_text(json.dumps(curve[-1]))

    init_weights, warm_start = _warm_start(store, recipe, work, log)
    preflight_summary = "not run" if not preflight else _preflight(
        store, recipe, files if source is None else [store.local_path(files[0])], target, work, device,
        preflight_run, log)
    heldout = _heldout_factory(store, recipe, target, work, device, log)
    train = functools.partial(train_drafter, recipe, files, target.model_path, work, resume=True, log=on_step,
                              device=device, max_steps=max_steps, source=source, time_budget_s=time_budget_s,
                              on_save=on_save_recorded, heldout=heldout, profile_steps=profile_steps)
    try:
        try:
            result = train(init_weights=init_weights)
        except ValueError as e:
            if init_weights is None or "other tensors or shapes" not in str(e):
                raise
            log(f"recipe {name}: the promoted drafter's shapes differ from this run's ({e}): random init")
            warm_start = {**(warm_start or {}), "skipped": "shapes differ"}
            result = train()
    finally:
        if source is not None:
            source.close()  # its local parts go with it
    if result.data_stats:
        log(f"recipe {name}: part cache {result.data_stats}")
    if result.checkpoint_dir is None:
        raise RuntimeError(f"recipe {name}: stopped at step {result.steps}/{result.total_steps} before the end; "
                           f"run again to resume from {result.state_dir}")
    prefix, metrics, provenance, curve, best = _publish_checkpoint(
        store, recipe, shards, target, result, curve, curve_dir, provenance_inputs)
    return _train_metadata(store, recipe, shards, result, metrics, curve, best, preflight_summary, prefix,
                           provenance, warm_start)


def _train_metadata(store: Any, recipe: Any, shards: list[str], result: Any, metrics: dict, curve: list[dict],
                    best: dict | None, preflight_summary: str, prefix: str, provenance: dict,
                    warm_start: dict | None) -> dict[str, Any]:
    """What ``train_recipe`` returns: the run's figures, its chart data and where its checkpoint is."""
    from dflash_assets.drafter.provenance import provenance_summary

    name = recipe.name
    losses = result.losses
    return {
        "recipe": name, "recipe_fingerprint": recipe.fingerprint(), "shards": shards,
        "steps": result.steps, "total_steps": result.total_steps,
        "first_loss": float(losses[0]) if losses else float("nan"), "final_loss": float(metrics["final_loss"]),
        "tokens_per_s": round(float(result.tokens_per_s), 1), "mean_accuracy": round(float(metrics["mean_accuracy"]), 4),
        # the steps alone (the loop's aside_s in tau estimates and saved states left out), and past the first step
        # of each batch shape (new_shape_s, where compiles are): the rate a longer run keeps
        **{k: round(float(getattr(result, k)), 1) for k in ("steps_tokens_per_s", "aside_s", "warm_tokens_per_s",
                                                            "new_shape_s")}, "new_shape_steps": result.new_shape_steps,
        "sequence_tokens": result.sequence_tokens,
        "draft_tokens_per_sequence_token": round(float(metrics["draft_tokens_per_sequence_token"]), 3),
        # the share of the block and context tokens computed that was padding (the packed layout keeps it small)
        "padded_block_share": round(float(metrics["padded_block_share"]), 4),
        "padded_context_share": round(float(metrics["padded_context_share"]), 4),
        "resumed_from_step": result.resumed_from_step if result.resumed_from_step is not None else 0,
        "wall_s": round(result.wall_s, 1), "num_sequences": result.num_sequences,
        # Chart data: [step, mean loss] points (at most 200), and accuracy at block positions k = 1..B-1.
        "loss_curve": curve_points(losses, max_points=200),
        "accuracy_by_position": [round(float(a), 4) for a in result.accuracy_by_position],
        "curve_checkpoints": [[c["step"], c["tokens"]] for c in curve],
        "objective": objective_of(recipe),
        # Chart data: [step, held-out tau estimate] per evaluation while training; the best is marked
        "tau_while_training": [[h["step"], h["tau"]] for h in result.tau_history],
        # the same estimates against the sequence tokens trained so far: runs of other data compare at equal tokens
        "tau_by_tokens": [[h["tokens"], h["tau"]] for h in result.tau_history],
        "best_checkpoint": (f"step {best['step']} ({best['file']}): tau estimate {best['tau']:.3f}" if best
                            else "none (no tau estimate while training)"),
        "stop_reason": result.stop_reason,
        "preflight": preflight_summary,
        "checkpoint": store.url(prefix),
        "provenance": provenance_summary(provenance),
        **({"warm_start": warm_start} if warm_start else {}),
        **({"part_cache": result.data_stats} if result.data_stats else {}),
        **({"profile": result.profile} if result.profile else {}),
        # flex attention's Triton tiles in the steps (torch_compile.DRAFTER_FLEX_TILES on a GPU it names)
        **({"flex_kernel_options": result.flex_kernel_options} if result.flex_kernel_options else {}),
    }


def _training_inputs(store: Any, recipe: Any, shards: list[str], work_dir: str | None,
                     log: Callable[[str], None]) -> tuple[list, Any, list]:
    """The recipe's training files, the bounded part cache they are read through (an s3 store with
    ``cache_limit_gb``: the parts stay in the store), and the (name, size) signature of its data."""
    name = recipe.name
    source = None
    if recipe.cache_limit_gb and not recipe.online and str(getattr(store, "uri", "")).startswith("s3://"):
        # parts stay in the store; at most cache_limit_gb of them on this host's disk at once
        from dflash_assets.hidden_states.part_cache import BoundedPartCache

        entries = _cache_entries(store, recipe, shards)
        files = [e["key"] for e in entries]
        source = BoundedPartCache(store, files, int(recipe.cache_limit_gb * 1e9),
                                  sizes={e["key"]: e["bytes"] for e in entries},
                                  cache_dir=Path(work_dir or default_work_dir()) / "parts")
        data_sig = [(Path(e["key"]).name, e["bytes"]) for e in entries]
        log(f"recipe {name}: parts read through a local cache of at most {recipe.cache_limit_gb} GB "
            f"({sum(e['bytes'] for e in entries) / 1e9:.3f} GB of parts in the store)")
    else:
        files = _training_files(store, recipe, shards)
        data_sig = [(Path(f).name, Path(f).stat().st_size) for f in files]
    return files, source, data_sig


def _warm_start(store: Any, recipe: Any, work: Path,
                log: Callable[[str], None]) -> tuple[Path | None, dict | None]:
    """``init_from: promoted``: the family's promoted drafter's weights (copied under ``work``) and what it was;
    (None, None) otherwise, or when the family has none yet (random init)."""
    name = recipe.name
    init_weights, warm_start = None, None
    if recipe.init_from == "promoted":  # a refresh: start from the family's promoted drafter
        from dflash_assets.drafter.promotion import read_promoted

        promoted = read_promoted(store, recipe.family_name)
        if promoted is None:
            log(f"recipe {name}: init_from promoted, but {recipe.family_name} has none yet: random init")
        else:
            init_weights = work / "init" / "model.safetensors"
            init_weights.parent.mkdir(parents=True, exist_ok=True)
            init_weights.write_bytes(store.read_bytes(promoted["files"]["model.safetensors"]))
            warm_start = {"recipe": promoted["recipe"], "checkpoint": promoted["checkpoint"], "tau": promoted["tau"]}
    return init_weights, warm_start


def _publish_checkpoint(store: Any, recipe: Any, shards: list[str], target: Any, result: Any, curve: list[dict],
                        curve_dir: Path, provenance_inputs: dict[str, Any] | None) -> tuple:
    """train_metrics.json and provenance.json written beside the checkpoint, then every file published under a
    new version with the manifest last; (its prefix, the metrics, the provenance, the curve, the best point)."""
    name = recipe.name
    metrics = result.to_metadata()
    metrics_path = Path(result.checkpoint_dir).parent / "train_metrics.json"
    curve, best = _mark_curve(curve, result)
    metrics_path.write_text(json.dumps({**metrics, "losses": result.losses, "recipe": recipe.to_dict(),
                                        "shards": shards, "target": target.model_path, "curve": curve,
                                        "best_checkpoint": best, "objective": objective_of(recipe)},
                                       indent=2, default=str))
    # every file under a new version, the manifest last: a kill never leaves a new model beside an old config
    legacy = [layout.drafter_checkpoint_file(name, f) for f in (*CHECKPOINT_FILES, "train_metrics.json")]
    from dflash_assets.drafter.provenance import PROVENANCE_FILE, build_provenance, provenance_summary, write_provenance

    provenance = build_provenance(store, recipe, shards, target,
                                  checkpoint_files={f: Path(result.checkpoint_dir) / f for f in CHECKPOINT_FILES},
                                  training={"steps": result.steps, "sequence_tokens": result.sequence_tokens},
                                  **(provenance_inputs or {}))
    provenance_path = write_provenance(metrics_path.parent / PROVENANCE_FILE, provenance)
    manifest = publish_files(
        store, layout.drafter_checkpoint_manifest(name), layout.drafter_checkpoint_prefix(name),
        {**{f: Path(result.checkpoint_dir) / f for f in CHECKPOINT_FILES}, "train_metrics.json": metrics_path,
         PROVENANCE_FILE: provenance_path, **{c["file"]: curve_dir / c["file"] for c in curve}},
        extra={"recipe": name, "recipe_fingerprint": recipe.fingerprint()},
        stale=[k for k in legacy if store.exists(k)])
    prefix = f"{layout.drafter_checkpoint_prefix(name)}/{manifest['version']}"
    return prefix, metrics, provenance, curve, best


def preflight_key(name: str) -> str:
    return f"drafter_preflight/{name}.json"


def _preflight(store: Any, recipe: DrafterRecipe, files: list[Any], target: Any, work: Path, device: str | None,
               run: str, log: Callable[[str], None]) -> str:
    """``drafter.preflight.run_preflight`` on the recipe's first training file, its report in the store; raises
    ``PreflightFailed`` when it fails. Skipped (and said so in the report) when the run resumes a saved state."""
    from dflash_assets.drafter.preflight import PreflightFailed, run_preflight
    from dflash_assets.drafter.state import latest_state_dir

    state = latest_state_dir(work / "state")
    base = {"recipe": recipe.name, "recipe_fingerprint": recipe.fingerprint(), "run": run}
    if state is not None:
        log(f"recipe {recipe.name}: resumes {state.name}; its preflight passed before that state was trained")
        summary = f"not run again: the run resumes {state.name}, trained after a passed preflight"
        store.write_json(preflight_key(recipe.name), {**base, "passed": True, "summary": summary})
        return summary
    log(f"recipe {recipe.name}: preflight (memorize a handful of samples, decode them)")
    result = run_preflight(recipe, files[:1], target.model_path, device=device, log=log)
    store.write_json(preflight_key(recipe.name), {**base, **result.to_metadata()})
    if not result.passed:
        raise PreflightFailed(result)
    return result.summary()


def objective_of(recipe: DrafterRecipe) -> str:
    """The training objective as the UI and provenance show it: "dflash (gamma 7)" or "dpace (alpha 0.5)"."""
    if recipe.objective == "dpace":
        return f"dpace (alpha {recipe.dpace_alpha:g})"
    return f"dflash (gamma {recipe.loss_gamma:g})"


def _heldout_factory(store: Any, recipe: DrafterRecipe, target: Any, work: Path, device: str | None,
                     log: Callable[[str], None]) -> Callable[[Any], Any] | None:
    """For ``train_drafter(heldout=...)``: a function of the drafter's config that builds the held-out slice tau is
    estimated on while training (``tau_estimate.heldout_slice``), or None when the recipe asks for none."""
    if recipe.tau_prompts <= 0:
        return None

    def make(config: Any) -> Any:
        from dflash_assets.drafter.tau_estimate import heldout_slice

        prompts, held_out = heldout_prompts(store, recipe, target, recipe.tau_prompts)
        if not held_out or not prompts:
            log(f"recipe {recipe.name}: no held-out prompt (it trains on every shard): no tau estimate while training")
            return None
        return heldout_slice(prompts, recipe, target, config.target_layer_ids, work, device=device, log=log)

    return make


def _mark_curve(curve: list[dict[str, Any]], result: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The run's learning-curve checkpoints (up to its last step) with their tau estimate, the best one marked;
    and the best as ``{"step", "tokens", "tau", "file"}`` (None without estimates)."""
    taus = {h["step"]: h["tau"] for h in result.tau_history}
    best_step = result.best["step"] if result.best else None
    out = []
    for c in sorted((c for c in curve if c["step"] <= result.steps), key=lambda c: c["step"]):
        c = {k: v for k, v in c.items() if k not in ("tau_estimate", "best")}
        if c["step"] in taus:
            c["tau_estimate"] = taus[c["step"]]
        out.append({**c, **({"best": True} if c["step"] == best_step else {})})
    best = next(({**result.best, "file": c["file"]} for c in out if c.get("best")), None)
    return out, best


def heldout_prompts(store: Any, recipe: DrafterRecipe, target: Any, num_prompts: int) -> tuple[list[Any], bool]:
    """Rendered prompts from shards the recipe did not train on; (prompts, held_out). Held out means disjoint by
    prompt_id and by text: a prompt whose first user turn matches a trained user turn exactly or nearly (the
    decontamination rule; ShareGPT repeats texts under new ids) is left out (``decontamination.heldout_selection``).
    A recipe that trains on every shard gets the last shard's prompts, and held_out False."""
    from dflash_assets.drafter.decoding import EvalPrompt
    from dflash_assets.drafter.decontamination import heldout_selection

    shards = layout.list_raw_prompt_shards(store)
    trained = set(training_shards(store, recipe))
    selection = heldout_selection(store, sorted(trained), num_prompts)
    chat = target.chat()
    thinking = bool(chat.thinking)
    prompts: list[EvalPrompt] = []
    for shard in [s for s in shards if s not in trained] or shards[-1:]:
        table = store.read_parquet(layout.raw_prompts(shard))  # shards written before agentic prompts: no tools
        for row in table.to_pylist():
            if selection.held_out and row["prompt_id"] not in selection.ids:
                continue
            messages = ([{"role": "system", "content": row["system"]}] if row["system"] else [])
            messages.append({"role": "user", "content": row["user_turns"][0]})
            ids = chat.encode(chat.render(messages, add_generation_prompt=True))
            kept = tuple(ids[-1024:])
            slices = prompt_slices(thinking=thinking, has_tools=bool(row.get("tools")), prompt_tokens=len(ids),
                                   category=row["category"])
            prompts.append(EvalPrompt(kept, row["category"] or "unknown", row["prompt_id"], slices))
            if len(prompts) >= num_prompts:
                return prompts, selection.held_out
    return prompts, selection.held_out


def _serving_speed(target: Any, drafter_dir: str, prompts: list[Any], device: str | None, max_new_tokens: int,
                   stop: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Batch-1 decoding as a server runs it (``graph_decoding.graph_decode_speed``): a bfloat16 copy of the target
    and the drafter, static caches, one CUDA graph per step on both sides; or why this target cannot."""
    from dflash_assets.drafter.decoding import load_target
    from dflash_assets.drafter.graph_decoding import graph_decode_speed
    from dflash_assets.drafter.model import load_drafter

    model = load_target(target.model_path, device, "bfloat16")
    param = next(model.parameters())
    drafter = load_drafter(drafter_dir, device=param.device, dtype=param.dtype)
    try:
        speed = graph_decode_speed(model, drafter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    except ValueError as e:  # not a full-attention target, an attention implementation that takes no mask
        log(f"serving-speed decoding skipped: {e}")
        return {"skipped": str(e)}
    finally:
        del model, drafter
        if param.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    log(f"batch-1 decode as served ({'CUDA graphs' if speed['graphs'] else 'eager'}, {speed['dtype']}): "
        f"{speed['target_tokens_per_s']:.1f} tok/s target alone, {speed['speculative_tokens_per_s']:.1f} tok/s "
        f"speculative ({speed['speedup']:.2f}x), {speed['outputs_equal']}/{speed['num_prompts']} outputs equal")
    return speed


def eval_recipe(store: Any, name: str, target: Any, *, num_prompts: int = 16, max_new_tokens: int = 128,
                device: str | None = None, log: Callable[[str], None] = logger.info, dtype: str | None = None,
                speed_prompts: int = 0, curve_prompts: int = 0, promotion_margin: float | None = None,
                workers: int = 1, serving_speed_prompts: int = 0) -> dict[str, Any]:
    """Acceptance length tau of the recipe's checkpoint on held-out prompts, and the lossless check.

    ``promotion_margin``: also decide promotion (``drafter.promotion``): the run's checkpoints (the learning-curve
    ones on the first ``curve_prompts`` prompts, and the final one) against the family's promoted checkpoint,
    re-measured on the same prompts when it loads on this target; at most this much tau lost on any slice.

    ``dtype``: the target's (and drafter's) precision (default: ``decoding.evaluation_dtype``'s; float32 makes
    the lossless check exact). ``speed_prompts``: also time decoding at batch 1 on that many of the prompts,
    target alone against speculative (``decode_speed``). ``serving_speed_prompts``: also time them as a server
    decodes: bfloat16, static caches, a CUDA graph per step on both sides (``graph_decoding``; eager on a CPU),
    reported as ``serving_speed``; a target that path cannot run reports why. ``curve_prompts``: also measure tau of the training
    run's learning-curve checkpoints (``train_recipe``) on that many prompts: the learning curve.

    ``workers``: decode the prompts in that many processes of this host, each with its own copy of the target
    (``eval_workers``; batch-1 decoding leaves a GPU mostly idle). Same tau and rows, less wall time; the speed
    measurement stays in this process, alone."""
    from dflash_assets.drafter.decoding import decode_speed, evaluate_drafter, load_target
    from dflash_assets.drafter.eval_workers import EvalWorkers
    from dflash_assets.drafter.model import load_drafter

    recipe = load_recipe(store, name)
    prompts, held_out = heldout_prompts(store, recipe, target, num_prompts)
    if not held_out:
        log(f"recipe {name} trained on every shard: evaluating on training prompts (tau is optimistic)")
    stop = sorted(target.chat().stop_ids)
    files = layout.drafter_checkpoint_files(store, name, CHECKPOINT_FILES)
    if missing := [f for f in CHECKPOINT_FILES if f not in files]:
        raise FileNotFoundError(f"recipe {name!r} has no published checkpoint ({', '.join(missing)} missing); "
                                "materialize drafter_checkpoint first")
    # this process's own target: for decoding without workers, and for the speed measurement
    model = load_target(target.model_path, device, dtype) if workers <= 1 or speed_prompts > 0 else None
    speed, curve = None, []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dflash-eval-"))
        pool = (stack.enter_context(EvalWorkers(target.model_path, workers, device=device, dtype=dtype))
                if workers > 1 else None)  # closed before tmp goes: no worker reads a removed checkpoint

        def evaluate(drafter_dir: str, some: list[Any], check_lossless: bool = False) -> Any:
            if pool is not None:
                return pool.evaluate(drafter_dir, some, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                     check_lossless=check_lossless)
            return evaluate_drafter(drafter_dir, model, some, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                    check_lossless=check_lossless)

        for fname in CHECKPOINT_FILES:
            Path(tmp, fname).write_bytes(store.read_bytes(files[fname]))
        log(f"recipe {name}: speculative decoding of {len(prompts)} prompts, {max_new_tokens} new tokens each"
            + (f", {workers} worker processes" if pool is not None else ""))
        result = evaluate(tmp, prompts, check_lossless=True)
        log(f"recipe {name}: tau {result.tau:.3f}, lossless {result.lossless}")
        if speed_prompts > 0:
            param = next(model.parameters())
            drafter = load_drafter(tmp, device=param.device, dtype=param.dtype)
            speed = decode_speed(model, drafter, prompts[:speed_prompts], max_new_tokens=max_new_tokens,
                                 stop_token_ids=stop)
            log(f"recipe {name}: batch-1 decode {speed['target_tokens_per_s']:.1f} tok/s target alone, "
                f"{speed['speculative_tokens_per_s']:.1f} tok/s speculative ({speed['speedup']:.2f}x)")
        serving = _serving_speed(target, tmp, prompts[:serving_speed_prompts], device, max_new_tokens, stop, log) \
            if serving_speed_prompts > 0 else None
        if curve_prompts > 0:
            curve = _learning_curve(store, files, tmp, prompts[:curve_prompts], evaluate, log)
        promotion = None
        if promotion_margin is not None:
            promotion = _promote(store, recipe, files, prompts, result.per_prompt, curve, curve_prompts,
                                 promotion_margin, evaluate, log)
    metrics = result.to_metadata()
    store.write_json(layout.drafter_eval(name), {**metrics, "per_prompt": result.per_prompt, "held_out": held_out,
                                                 "decode_speed": speed, "serving_speed": serving,
                                                 "learning_curve": curve})
    counts = result.acceptance_length_counts + [0] * (recipe.block_size + 1 - len(result.acceptance_length_counts))
    by_cat = "\n".join(["| category | tau |", "| --- | ---: |"]
                       + [f"| {c} | {t:.3f} |" for c, t in sorted(result.tau_by_category.items())])
    return {
        "tau": round(float(result.tau), 4), "tau_by_category": by_cat, "lossless": bool(result.lossless),
        "num_mismatches": int(result.num_mismatches), "num_verifications": int(result.num_verifications),
        "num_new_tokens": int(result.num_new_tokens), "num_prompts": len(prompts), "held_out": held_out,
        # Chart data: share of verifications that accepted block position k (k = 1..B); sums to tau.
        "acceptance_by_position": [round(x, 4) for x in share_at_least(counts)],
        "wall_s": round(float(result.wall_s), 1), "workers": workers,
        **({"decode_speed": speed} if speed is not None else {}),
        **({"serving_speed": serving} if serving is not None else {}),
        # Chart data: [sequence tokens trained, tau on the first curve_prompts prompts] per saved checkpoint.
        **({"learning_curve": [[c["tokens"], c["tau"]] for c in curve]} if curve else {}),
        # Chart data: {slice: [[tokens, tau], ...]} over the curve checkpoints (and tau by slice of the final one).
        **({"learning_curve_by_slice": _curve_by_slice(curve)} if curve else {}),
        "tau_by_slice": tau_by_slice(result.per_prompt),
        **({"promotion": promotion} if promotion is not None else {}),
    }


def _curve_by_slice(curve: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for point in curve:
        for name, tau in point.get("slices", {}).items():
            out.setdefault(name, []).append([point["tokens"], tau])
    return out


def _promote(store: Any, recipe: DrafterRecipe, files: dict[str, str], prompts: list[Any],
             final_rows: list[dict[str, Any]], curve: list[dict[str, Any]], curve_prompts: int, margin: float,
             evaluate: Callable[..., Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Decide promotion among the run's checkpoints, all measured on the same prompts; write the promoted
    manifest when one wins. Returns the decision as metadata."""
    from dflash_assets.drafter.promotion import Candidate, decide_promotion, read_promoted, write_promoted

    n = min(curve_prompts, len(prompts)) if curve else len(prompts)
    sequence_tokens = max((c["tokens"] for c in curve), default=0)
    metrics = json.loads(store.read_bytes(files["train_metrics.json"])) if "train_metrics.json" in files else {}
    sequence_tokens = int(metrics.get("sequence_tokens", 0) or sequence_tokens)
    rows = final_rows[:n]  # greedy decoding: the final checkpoint's rows on the first n prompts
    final_files = {f: files[f] for f in (*CHECKPOINT_FILES, "provenance.json") if f in files}
    candidates = [Candidate("final", sequence_tokens, round(_pooled_tau(rows), 4), tau_by_slice(rows), final_files)]
    for point in curve:
        candidates.append(Candidate(point["file"], point["tokens"], point["tau"], point.get("slices", {}),
                                    {**final_files, "model.safetensors": files[point["file"]]}))
    family = recipe.family_name
    previous = read_promoted(store, family)
    missing_previous = None
    previous_weights = (previous or {}).get("files", {}).get("model.safetensors")
    if previous is not None and not (previous_weights and store.exists(previous_weights)):
        # Before promotions kept their own copy, re-running the promoted recipe deleted its weights: nothing can
        # serve that drafter any more, so this run's best replaces it rather than failing against a ghost.
        missing_previous = {"recipe": previous.get("recipe"), "checkpoint": previous.get("checkpoint"),
                            "tau": previous.get("tau")}
        log(f"{family}'s promoted checkpoint ({previous.get('recipe')}:{previous.get('checkpoint')}) has no weights "
            f"in the store any more; this run's best checkpoint replaces it")
        previous = None
    if previous is not None:  # the promoted checkpoint re-measured on these prompts, when it loads on this target
        try:
            old = _evaluate_files(store, previous["files"], prompts[:n], evaluate)
            previous = {**previous, "tau_recorded": previous["tau"], "tau": round(_pooled_tau(old), 4),
                        "slices": tau_by_slice(old), "remeasured": True}
        except (KeyError, OSError, RuntimeError, ValueError) as e:
            log(f"promoted checkpoint of {family} not re-measured ({type(e).__name__}: {e}); its recorded tau is used")
            previous = {**previous, "remeasured": False}
    decision = decide_promotion(candidates, previous, margin,
                                is_promoted=lambda c: previous is not None and _same_weights(
                                    store, c.files.get("model.safetensors"), previous["files"].get("model.safetensors")))
    if decision.already_promoted:
        log(f"{recipe.name}:{decision.candidate.name} is {family}'s promoted drafter already (same weights)")
    elif decision.promoted and decision.candidate is not None:
        write_promoted(store, family, recipe.name, decision.candidate,
                       provenance_key=files.get("provenance.json"), config_key=files.get("config.json"))
        log(f"promoted {recipe.name}:{decision.candidate.name} as {family} (tau {decision.candidate.tau:.3f})")
    else:
        log(f"not promoted: {'; '.join(decision.reasons)}")
    return {**decision.to_metadata(), "family": family, "margin": margin, "prompts": n,
            "remeasured_previous": bool(previous and previous.get("remeasured")),
            "replaced_missing_previous": missing_previous or "no"}


def _same_weights(store: Any, key: str | None, other: str | None) -> bool:
    """Whether two safetensors files in the store hold the same tensors (names, dtypes, shapes, values).

    Not their bytes: safetensors writes the metadata map in no fixed order, so one drafter saved twice (a re-run
    that resumes from its final state) can differ in the header alone."""
    from safetensors import SafetensorError, safe_open

    if not key or not other:
        return False
    if key == other:
        return True
    try:
        with safe_open(str(store.local_path(key)), "pt") as a, safe_open(str(store.local_path(other)), "pt") as b:
            if set(a.keys()) != set(b.keys()):
                return False
            for name in a.keys():
                x, y = a.get_tensor(name), b.get_tensor(name)
                if x.dtype != y.dtype or x.shape != y.shape or not bool((x == y).all()):
                    return False
            return True
    except (KeyError, OSError, ValueError, SafetensorError):  # gone, or not a safetensors file
        return False


def _pooled_tau(rows: list[dict[str, Any]]) -> float:
    n = sum(r["verifications"] for r in rows)
    return sum(r["accepted_tokens"] for r in rows) / n if n else 0.0


def _evaluate_files(store: Any, files: dict[str, str], prompts: list[Any],
                    evaluate: Callable[..., Any]) -> list[dict[str, Any]]:
    """Per-prompt rows of the checkpoint whose files (model.safetensors, config.json keys) are given."""
    with tempfile.TemporaryDirectory(prefix="dflash-promoted-") as tmp:
        for fname in CHECKPOINT_FILES:
            Path(tmp, fname).write_bytes(store.read_bytes(files[fname]))
        return evaluate(tmp, prompts).per_prompt


def _learning_curve(store: Any, files: dict[str, str], checkpoint_dir: str, prompts: list[Any],
                    evaluate: Callable[..., Any], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """tau of each learning-curve checkpoint the training run published (``train_recipe``), in step order. Each
    checkpoint gets a directory of its own beside the final one's: its weights and the final one's config."""
    metrics = json.loads(store.read_bytes(files["train_metrics.json"])) if "train_metrics.json" in files else {}
    points = []
    for point in metrics.get("curve", []):
        if point["file"] not in files:
            continue
        local = Path(checkpoint_dir) / "curve" / Path(point["file"]).stem
        local.mkdir(parents=True)
        (local / "config.json").write_bytes((Path(checkpoint_dir) / "config.json").read_bytes())
        (local / "model.safetensors").write_bytes(store.read_bytes(files[point["file"]]))
        result = evaluate(str(local), prompts)
        points.append({"step": point["step"], "tokens": point["tokens"], "tau": round(float(result.tau), 4),
                       "file": point["file"], "slices": tau_by_slice(result.per_prompt)})
        log(f"learning curve: step {point['step']}, {point['tokens']} tokens: tau {result.tau:.3f}")
    return points


def pipes_stage_train(call: Any) -> Any:
    """``python -m dflash_assets.pipes_worker drafter_checkpoint``."""
    from dflash_assets.stage_io import StageResult
    from dflash_assets.target_model.spec import TargetModelSpec

    cfg = dict(call.config)
    target = TargetModelSpec(**cfg.pop("target"))
    meta = train_recipe(call.store, call.partition_key, target, log=call.log.info, **cfg)
    return StageResult(metadata=meta, data_version=meta["recipe_fingerprint"])


def pipes_stage_eval(call: Any) -> Any:
    """``python -m dflash_assets.pipes_worker drafter_eval``; reports the ``lossless`` check."""
    from dflash_assets.stage_io import CheckOutcome, StageResult
    from dflash_assets.target_model.spec import TargetModelSpec

    cfg = dict(call.config)
    target = TargetModelSpec(**cfg.pop("target"))
    meta = eval_recipe(call.store, call.partition_key, target, log=call.log.info, **cfg)
    checks = [CheckOutcome("lossless", passed=meta["lossless"], severity="ERROR",
                           metadata={"num_mismatches": meta["num_mismatches"], "num_prompts": meta["num_prompts"]})]
    if "promotion" in meta:  # not promoted = the run regressed or did not beat the promoted checkpoint
        p = meta["promotion"]
        checks.append(CheckOutcome("promotion", passed=bool(p.get("passed", p["promoted"])), severity="ERROR",
                                   metadata={k: v for k, v in p.items() if v is not None}))
    return StageResult(metadata=meta, checks=checks)


def recipe_from_json(text: str) -> DrafterRecipe:
    return DrafterRecipe.from_dict(json.loads(text))
