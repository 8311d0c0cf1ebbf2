"""The embedded default, materialized end to end (what ``make demo`` runs; tests and the reliability bench too).

1. Builds the tiny target (cached) and starts ``transformers serve`` on it, on 127.0.0.1.
2. Ingests the first ``prompts`` valid prompts of the embedded ShareGPT file,
   ``shard_size`` per shard (the ``prompt_corpus`` report says how many records were read),
   then materializes ``generation_plan`` (the cost plan) with a pilot of ``pilot_prompts``
   real prompts, before any completions.
3. Per shard, one run: ``raw_prompts`` -> ``completions`` -> ``tokenized_samples``
   (with its blocking checks) -> ``hidden_state_cache``.
4. Registers the recipe ``demo-v1`` (every good shard but the last; the last is
   held out) and materializes ``drafter_checkpoint`` and ``drafter_eval``.

Every run is recorded in the Dagster instance with its full event log; the
console shows only what ``progress`` prints: one ``StageResult`` per asset
and partition (ok / failed / skipped, seconds, a key number or two, read
back from the run's events). ``run_demo`` returns a ``DemoSummary``: stages,
check outcomes per shard, tau, the plan's predictions against what the run measured
(completions wall time summed over shards, cache bytes from the manifests), and a
plain-words explanation of every failure.
Reads and writes only through the Dagster instance and the store resource.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import dagster as dg

log = logging.getLogger("dflash.demo")

PER_SHARD_ASSETS = ["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"]
DRAFTER_ASSETS = ["drafter_checkpoint", "drafter_eval"]

# The runs' console logger stays quiet: every event still goes to the instance's event log (the UI shows it).
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}

# What a failed check means and what to do next, in words (printed by the demo, kept in the summary).
CHECK_ADVICE = {
    "empty_response_ratio": (
        "too many answers are stubs or empty (the reasoning never closed, or nothing came after </think>); "
        "a drafter trained on them learns nothing, so the shard's GPU stage did not run",
        "open the check in the UI (make ui -> tokenized_samples -> Checks) and read the example prompt_ids; "
        "if turns were cut at max_new_tokens, raise it, else fix the engine or target; then materialize "
        "completions and tokenized_samples of the shard again"),
    "schema": (
        "the samples table breaks its own invariants (column types, list lengths, mask sums)",
        "this is a bug in tokenization: report it with the shard's tokenized_samples file"),
    "thinking_ratio": (
        "too few samples carry reasoning although thinking mode was requested",
        "check that the engine renders the chat template with enable_thinking and splits the reasoning out"),
    "truncation_ratio": (
        "many samples were cut at max_length, so their ends are not trained on",
        "raise tokenized_samples' max_length, or accept it for very long prompts"),
}


@dataclass
class StageResult:
    """One asset of one partition in one run, as the console shows it."""

    asset: str
    partition: str
    status: str  # ok | failed | skipped
    seconds: float | None
    numbers: str = ""  # a key number or two, from the materialization's metadata
    error: str | None = None  # first line of the step's error, when it failed
    tau: float | None = None  # drafter_eval only: the acceptance length

    def line(self) -> str:
        secs = f"{self.seconds:5.0f} s" if self.seconds is not None else "      -"
        detail = self.numbers if self.status == "ok" else (self.error or self.numbers)
        return f"  {self.partition:<12} {self.asset:<19} {self.status:<7} {secs}  {detail}".rstrip()


@dataclass
class CheckOutcome:
    name: str
    passed: bool
    blocking: bool
    description: str


@dataclass
class PlanCheck:
    """One prediction of ``generation_plan`` against what the run measured."""

    what: str
    predicted: float
    measured: float
    unit: str
    missing: list[str] = field(default_factory=list)  # shards the plan covers but the run did not measure

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.measured if self.measured else None

    def line(self) -> str:
        ratio = f"{self.ratio:.2f}" if self.ratio is not None else "-"
        skipped = f"; not measured: {', '.join(self.missing)} (skipped after a failed check), so the ratio " \
                  f"overstates the plan" if self.missing else ""
        return f"  plan vs run: {self.what} predicted {self.predicted:,.1f} {self.unit}, measured " \
               f"{self.measured:,.1f} {self.unit} (predicted/measured {ratio}){skipped}"


@dataclass
class DemoSummary:
    shards: list[str]
    failed_shards: list[str]
    recipe: str | None
    tau: float | None
    drafter_ok: bool
    stages: list[StageResult] = field(default_factory=list)
    checks: dict[str, list[CheckOutcome]] = field(default_factory=dict)  # by partition (shard or recipe)
    tau_untrained: float | None = None  # an untrained drafter of the same shape on the same prompts (baseline=True)
    failures: list[str] = field(default_factory=list)  # what failed, what it means, what to do
    wall_s: float = 0.0
    plan_checks: list[PlanCheck] = field(default_factory=list)  # the cost plan's predictions vs the run
    answers: list[tuple[str, str]] = field(default_factory=list)  # (user prompt, the target's answer), first shard

    @property
    def ok(self) -> bool:
        return not self.failures

    def __getitem__(self, key: str) -> Any:  # summary["tau"], as callers of the dict it used to be write
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards, "failed_shards": self.failed_shards, "recipe": self.recipe, "tau": self.tau,
            "tau_untrained": self.tau_untrained,
            "drafter_ok": self.drafter_ok, "ok": self.ok, "failures": self.failures, "wall_s": round(self.wall_s, 1),
            "answers": [list(a) for a in self.answers],
            "plan_checks": [{"what": c.what, "predicted": c.predicted, "measured": c.measured, "unit": c.unit,
                             "ratio": c.ratio, "missing": c.missing} for c in self.plan_checks],
            "stages": [vars(s) for s in self.stages],
            "checks": {shard: {c.name: {"passed": c.passed, "blocking": c.blocking, "description": c.description}
                               for c in checks} for shard, checks in self.checks.items()},
        }


def demo_recipe(shards: list[str]):
    from dflash_assets.drafter.training import DrafterRecipe

    train = shards[:-1] if len(shards) > 1 else shards
    return DrafterRecipe(name="demo-v1", num_layers=2, block_size=8, epochs=3, lr=3e-3, max_anchors=64,
                         max_length=1024, partitions=tuple(train), save_every=20)


def demo_run_config(max_new_tokens: int, max_turns: int, seed: int = 0) -> dict[str, Any]:
    return {"ops": {"completions": {"config": {"max_new_tokens": max_new_tokens, "max_turns": max_turns,
                                               "seed": seed}}}}


def run_demo(instance: dg.DagsterInstance, *, prompts: int = 16, shard_size: int = 8, max_new_tokens: int = 96,
             max_turns: int = 2, engine_concurrency: int = 2, eval_prompts: int = 4, eval_new_tokens: int = 48,
             seed: int = 0, drafter: bool = True, store: Any = None, target: str | None = None,
             baseline: bool = False, progress: Callable[[StageResult], None] | None = None,
             pilot_prompts: int = 4, engine: str = "serve") -> DemoSummary:
    """Materialize the whole graph on the embedded default; see the module docstring.

    ``seed`` is the completions' sampling seed; ``drafter=False`` stops after the
    per-shard stages. ``progress`` gets every ``StageResult`` as soon as its run ends.
    ``target``: another local target directory (e.g. the converted SmolLM2), served by
    ``transformers serve`` in float32 and used by every stage instead of the tiny target.
    ``baseline``: also measure tau of an untrained drafter on the same held-out prompts.
    ``pilot_prompts``: the cost plan's pilot before any completions (0: no plan).
    ``engine``: "serve" (``transformers serve`` on 127.0.0.1, ``engine_concurrency`` requests in flight)
    or "inprocess" (the batched in-process Transformers engine in each completions step: the requests
    in flight, ``engine_concurrency`` of them, are one ``generate`` call; far faster on CPU).
    """
    if engine not in ("serve", "inprocess"):
        raise ValueError(f"engine must be 'serve' or 'inprocess', not {engine!r}")
    from dagster_project.definitions import defs
    from dagster_project.partitions import register_recipe
    from dagster_project.deployment import get_profile, store_for_profile
    from dagster_project.resources import EngineFleetResource, TargetModelResource, deployment_resource
    from dflash_assets.embedded.defaults import embedded_default_target, embedded_engine_server
    from dflash_assets.generation.server import local_engine_server

    t_start = time.time()
    report = progress or (lambda stage: log.info(stage.line()))
    summary = DemoSummary(shards=[], failed_shards=[], recipe=None, tau=None, drafter_ok=False)
    if engine == "inprocess":
        label = "inprocess://" + Path(target or embedded_default_target()).name
        server, endpoint = contextlib.nullcontext(), f"transformers:{label}"
    else:
        server = (embedded_engine_server("transformers", port=0) if target is None  # the tiny target, on 127.0.0.1
                  else local_engine_server("transformers", target, port=0, dtype="float32"))
        log.info("starting the engine: %s", server.command)
    with server:
        if engine == "serve":
            endpoint = f"openai:{server.url}"
        store = store or store_for_profile(get_profile())  # a StoreResource; tests pass s3://... on moto's S3
        resources = {**defs.resources, "store": deployment_resource(store), "engines": deployment_resource(
            EngineFleetResource(endpoints=[endpoint], max_concurrency=engine_concurrency))}
        if target is not None:
            resources["target"] = deployment_resource(TargetModelResource(model_path=str(target), dtype="float32"))

        metadata: dict[tuple[str, str], dict[str, Any]] = {}  # (asset, partition) -> its materialization's values

        def materialize(selection: list[str], partition: str | None, run_config: dict[str, Any]) -> list[StageResult]:
            result = dg.materialize(defs.assets, selection=selection, partition_key=partition, instance=instance,
                                    resources=resources, run_config={**run_config, **QUIET_CONSOLE},
                                    raise_on_error=False)
            for asset in selection:
                for m in result.asset_materializations_for_node(asset):
                    metadata[(asset, partition or "")] = {k: getattr(v, "value", v) for k, v in m.metadata.items()}
            stages = _stage_results(instance, result, selection, partition or "")
            for stage in stages:
                summary.stages.append(stage)
                report(stage)
            checks = _check_outcomes(result)
            if checks:
                summary.checks[partition or ""] = checks
            return stages

        corpus = materialize(["prompt_corpus"], None, {"ops": {"prompt_corpus": {"config": {
            "limit": prompts, "max_prompts_per_shard": shard_size}}}})
        if corpus[0].status != "ok":
            summary.failures.append(f"prompt_corpus failed: {corpus[0].error}. Nothing else ran.")
            summary.wall_s = time.time() - t_start
            return summary
        summary.shards = sorted(instance.get_dynamic_partitions("prompt_shards"))
        if pilot_prompts:  # the cost plan before any completions, from a pilot of real prompts
            completions_config = demo_run_config(max_new_tokens, max_turns, seed)["ops"]["completions"]["config"]
            materialize(["generation_plan"], None, {"ops": {"generation_plan": {"config": {
                "pilot_prompts": pilot_prompts, "completions": completions_config}}}})
        for shard in summary.shards:
            stages = materialize(PER_SHARD_ASSETS, shard, demo_run_config(max_new_tokens, max_turns, seed))
            if not summary.answers and any(s.asset == "completions" and s.status == "ok" for s in stages):
                summary.answers = first_answers(store.open(), shard)
                for user, answer in summary.answers:
                    log.info("    %s", answer_line(user, answer))
            if any(s.status != "ok" for s in stages):
                summary.failed_shards.append(shard)
                summary.failures += _explain_shard(shard, stages, summary.checks.get(shard, []))
        plan = metadata.get(("generation_plan", ""))
        if plan is not None:
            summary.plan_checks = plan_checks(plan, {s: metadata.get(("completions", s), {}) for s in summary.shards},
                                              store.open())
            for check in summary.plan_checks:
                log.info(check.line().strip())
    good = [s for s in summary.shards if s not in summary.failed_shards]
    if drafter and not good:
        summary.failures.append("no shard passed its checks, so no drafter was trained.")
    elif drafter:
        recipe = demo_recipe(good)
        register_recipe(instance, store.open(), recipe)
        summary.recipe = recipe.name
        stages = materialize(DRAFTER_ASSETS, recipe.name, {"ops": {"drafter_eval": {"config": {
            "num_prompts": eval_prompts, "max_new_tokens": eval_new_tokens}}}})
        summary.drafter_ok = all(s.status == "ok" for s in stages)
        summary.tau = next((s.tau for s in stages if s.asset == "drafter_eval" and s.tau is not None), None)
        for check in summary.checks.get(recipe.name, []):
            if not check.passed:
                summary.failures.append(f"recipe {recipe.name}: check {check.name} failed: {check.description}. "
                                        f"See it in the UI (make ui -> drafter_eval -> Checks).")
        for stage in stages:
            if stage.status != "ok":
                summary.failures.append(f"{stage.asset} of recipe {recipe.name} {stage.status}: "
                                        f"{stage.error or 'an upstream step failed'}. See the run in the UI (make ui).")
        if baseline and summary.drafter_ok:
            summary.tau_untrained = untrained_tau(store.open(), recipe.name, target, eval_prompts, eval_new_tokens)
            log.info("untrained drafter: tau %.3f on the same held-out prompts", summary.tau_untrained)
    summary.wall_s = time.time() - t_start
    return summary


def plan_checks(plan: dict[str, Any], completions: dict[str, dict[str, Any]], store: Any) -> list[PlanCheck]:
    """The cost plan's completions wall time and cache bytes against the run's: the completions' ``wall_s``
    summed over shards, and the cache's bytes as its manifests list them. The plan covers every shard; a shard
    the run did not materialize (a failed check upstream) is named in the check, since its share of the
    prediction has nothing measured against it."""
    from dflash_assets.store import layout

    checks = []
    shards = sorted(completions)
    walls = {s: m["wall_s"] for s, m in completions.items() if "wall_s" in m}
    if "generation_wall_s" in plan and walls:
        checks.append(PlanCheck("completions wall time", float(plan["generation_wall_s"]), float(sum(walls.values())),
                                "s", missing=[s for s in shards if s not in walls]))
    entries = layout.list_hidden_state_entries(store)
    if "cache_bytes" in plan and entries:
        measured = sum(e["bytes"] if e["bytes"] is not None else store.size(e["key"])
                       for parts in entries.values() for e in parts)
        checks.append(PlanCheck("cache bytes", plan["cache_bytes"] / 1e6, measured / 1e6, "MB",
                                missing=[s for s in shards if s not in entries]))
    return checks


def first_answers(store: Any, shard: str, count: int = 2) -> list[tuple[str, str]]:
    """The first ``count`` (user prompt, final answer) pairs of a shard's completions, as the target wrote them."""
    from dflash_assets.generation.examples import answer_examples
    from dflash_assets.store import layout

    return answer_examples(store.read_parquet(layout.completions(shard), columns=["messages"]), count)


def answer_line(user: str, answer: str, width: int = 150) -> str:
    """One console line: a prompt and the target's answer, each on one line and cut to fit."""
    from dflash_assets.generation.examples import one_line

    return f"Q: {one_line(user, 60)}  A: {one_line(answer, width - 70)}"


def untrained_tau(store: Any, recipe_name: str, target: str | None, num_prompts: int, max_new_tokens: int) -> float:
    """tau of a freshly initialized drafter (the recipe's shape and seed, no training) on the held-out prompts
    that ``drafter_eval`` decoded: the floor a trained drafter is measured against."""
    import json

    import torch

    from dflash_assets.drafter.decoding import evaluate_drafter
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig
    from dflash_assets.drafter.stages import heldout_prompts, load_recipe
    from dflash_assets.embedded.defaults import default_target_spec
    from dflash_assets.store import layout
    from dflash_assets.target.spec import TargetModelSpec

    spec = default_target_spec() if target is None else TargetModelSpec(model_path=str(target), dtype="float32")
    recipe = load_recipe(store, recipe_name)
    prompts, _ = heldout_prompts(store, recipe, spec, num_prompts)
    files = layout.drafter_checkpoint_files(store, recipe_name, ("config.json",))
    config = DrafterConfig.from_hf_dict(json.loads(store.read_bytes(files["config.json"])))
    torch.manual_seed(recipe.seed)
    tok = spec.load_tokenizer()
    stop = sorted({i for i in (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id) if isinstance(i, int)})
    return float(evaluate_drafter(DFlashDrafter(config), spec.model_path, prompts, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop, check_lossless=False).tau)


# -- reading a run back -----------------------------------------------------------------------

# The key numbers of each asset's materialization: (metadata key, format) pairs; missing keys are left out.
_NUMBERS: dict[str, list[tuple[str, str]]] = {
    "prompt_corpus": [("valid", "{} prompts"), ("num_shards", "{} shards"), ("records_read", "{} records read")],
    "raw_prompts": [("num_prompts", "{} prompts"), ("num_user_turns", "{} user turns")],
    "generation_plan": [("generation_wall", "completions predicted {}"), ("cache_gb", "cache {:.4f} GB"),
                        ("recommendation", "{} training")],
    "completions": [("prompts_done", "{} prompts done"), ("completion_tokens", "{} tokens"),
                    ("tokens_per_s", "{:.0f} tok/s"), ("finish_length", "{} turns cut at max_new_tokens")],
    "tokenized_samples": [("samples", "{} samples"), ("loss_tokens", "{} supervised tokens")],
    "hidden_state_cache": [("num_tokens", "{} tokens"), ("gb", "{} GB")],
    "drafter_checkpoint": [("steps", "{} steps"), ("final_loss", "final loss {:.2f}")],
    "drafter_eval": [("tau", "tau {:.3f}"), ("lossless", "lossless {}")],
}


def _numbers(asset: str, metadata: dict[str, Any]) -> str:
    parts = []
    for key, fmt in _NUMBERS.get(asset, []):
        if key in metadata:
            value = getattr(metadata[key], "value", metadata[key])
            try:
                parts.append(fmt.format(value))
            except (TypeError, ValueError):
                parts.append(f"{key} {value}")
    return ", ".join(parts)


def _stage_results(instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult, selection: list[str],
                   partition: str) -> list[StageResult]:
    started: dict[str, float] = {}
    ended: dict[str, tuple[str, float, str | None]] = {}
    for entry in instance.all_logs(result.run_id):
        event = entry.dagster_event
        if event is None or event.step_key is None:
            continue
        if event.event_type == dg.DagsterEventType.STEP_START:
            started[event.step_key] = entry.timestamp
        elif event.event_type == dg.DagsterEventType.STEP_SUCCESS:
            ended[event.step_key] = ("ok", entry.timestamp, None)
        elif event.event_type == dg.DagsterEventType.STEP_FAILURE:
            error = event.step_failure_data.error
            message = (error.message if error else "step failed").strip().splitlines()
            ended[event.step_key] = ("failed", entry.timestamp, " ".join(message[:2])[:300])
    stages = []
    for asset in selection:
        status, end, error = ended.get(asset, ("skipped", None, "not run: an upstream step failed"))
        seconds = end - started[asset] if end is not None and asset in started else None
        metadata = {}
        for m in result.asset_materializations_for_node(asset):
            metadata = dict(m.metadata)
        stage = StageResult(asset, partition, status, seconds, _numbers(asset, metadata), error)
        if asset == "drafter_eval" and "tau" in metadata:
            stage.tau = float(getattr(metadata["tau"], "value", metadata["tau"]))
        stages.append(stage)
    return stages


def _check_outcomes(result: dg.ExecuteInProcessResult) -> list[CheckOutcome]:
    return [CheckOutcome(e.check_name, e.passed, bool(e.blocking), e.description or "")
            for e in result.get_asset_check_evaluations()]


def _explain_shard(shard: str, stages: list[StageResult], checks: list[CheckOutcome]) -> list[str]:
    """Plain words for a failed shard: which check or stage, what it means, what to do next."""
    lines = []
    for check in checks:
        if not check.passed:
            meaning, todo = CHECK_ADVICE.get(check.name, ("the check failed", "open it in the UI (make ui)"))
            kind = "blocking check" if check.blocking else "check"
            lines.append(f"{shard}: {kind} {check.name} failed: {check.description}. What it means: {meaning}. "
                         f"Next: {todo}.")
    for stage in stages:
        if stage.status == "failed" and not (stage.asset == "tokenized_samples" and lines):
            lines.append(f"{shard}: {stage.asset} failed: {stage.error}. See the run in the UI (make ui).")
    return lines or [f"{shard}: the run failed; see it in the UI (make ui)."]
