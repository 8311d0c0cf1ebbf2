"""Benchmark: does the demo pass its own checks on every run? Runs the demo's stages N times with varied seeds,
under one or several CPU kernel levels.

Each run is what ``make demo-tiny`` does (``dagster_project.demo.run_demo``:
the tiny target served by ``transformers serve``, the first ``--prompts``
ShareGPT prompts, ``--shard-size`` per shard, every per-shard stage with its
checks), in a fresh Dagster home and store under a temp dir, with the
completions' sampling seed ``--seed-base + i``; with ``--target smollm2``,
what ``make demo`` does (SmolLM2-135M-Instruct on the in-process engine, the
demo's defaults for that target unless given). The drafter stages run only
with ``--drafter`` (then tau is reported too). The target comes from the
cache (``$DFLASH_CACHE``), built once if missing; its build time is reported
apart.

Prints one JSON object: runs, failed partitions per run, every check's
outcome per partition, wall time per run, tau per run (with ``--drafter``),
the cost plan's predicted/measured ratios per run (completions wall time,
cache bytes), totals, the target's weight digest, and the machine.

``--kernels default,avx2,avx512`` repeats all of it once per CPU kernel level
(``ATEN_CPU_CAPABILITY``, in a child process each): the trained bytes of the
tiny target depend on the kernels, so each level builds (and caches, under its
own key) a target of its own, and the object holds one report per level.

    .venv/bin/python bench/demo_reliability.py --runs 10
    .venv/bin/python bench/demo_reliability.py --runs 3 --target smollm2
    .venv/bin/python bench/demo_reliability.py --runs 3 --kernels default,avx2,avx512

Reads: the cache. Writes: a temp dir (``--workdir`` to keep it), the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402


def one_run(workdir: Path, index: int, args: argparse.Namespace, target: Path) -> dict:
    import dagster as dg

    from dagster_project.demo import TARGET_DEFAULTS, run_demo
    from dagster_project.instance_config import write_instance_yaml
    from dagster_project.resources import StoreResource

    home = workdir / f"run-{index:02d}"
    home.mkdir(parents=True)
    write_instance_yaml(home, "local")
    seed = args.seed_base + index
    t0 = time.time()
    os.environ["DAGSTER_HOME"] = str(home)  # DagsterInstance.get() reads it
    engine = {} if args.target == "tiny" else {  # SmolLM2 as make demo runs it
        "target": str(target), "engine": "inprocess", "engine_concurrency": 32,
        "max_empty_ratio": TARGET_DEFAULTS["smollm2"]["max_empty_ratio"]}
    with dg.DagsterInstance.get() as instance:
        summary = run_demo(instance, prompts=args.prompts, shard_size=args.shard_size, seed=seed,
                           max_new_tokens=args.max_new_tokens, drafter=args.drafter,
                           store=StoreResource(uri=str(home / "dflash-store")),
                           progress=lambda s: print(f"run {index}:{s.line()}", file=sys.stderr, flush=True), **engine)
    result = summary.to_dict()
    return {"run": index, "seed": seed, "wall_s": round(time.time() - t0, 1), "ok": result["ok"],
            "failed_partitions": result["failed_shards"], "checks": result["checks"], "tau": result["tau"],
            "failures": result["failures"], "plan_checks": result["plan_checks"],
            "stage_seconds": {f"{s['partition']}/{s['asset']}": round(s["seconds"] or 0.0, 1)
                              for s in result["stages"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed-base", type=int, default=1000, help="run i samples with seed seed-base + i")
    parser.add_argument("--target", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny (default): make demo-tiny's target and engine; smollm2: make demo's")
    parser.add_argument("--prompts", type=int, default=None, help="default: the demo's for the target")
    parser.add_argument("--shard-size", type=int, default=None, help="default: the demo's for the target")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the demo's for the target")
    parser.add_argument("--drafter", action="store_true", help="also train and evaluate the drafter (tau)")
    parser.add_argument("--workdir", help="keep every run's home and store here")
    parser.add_argument("--kernels", help="comma-separated ATEN_CPU_CAPABILITY levels to repeat everything under, "
                        "each in a child process (default: this process's own)")
    args = parser.parse_args()
    from dagster_project.demo import TARGET_DEFAULTS

    for key in ("prompts", "shard_size", "max_new_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, TARGET_DEFAULTS[args.target][key])
    if args.kernels:
        print(json.dumps(per_kernel_level(args), indent=2))
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.simplefilter("ignore")  # Dagster's beta/preview notes; the runs' own logs stay in each instance

    from dflash_assets.embedded.defaults import embedded_default_target
    from dflash_assets.embedded.tiny_targets import cpu_capability

    t0 = time.time()
    if args.target == "tiny":
        target = embedded_default_target()
    else:
        from dagster_project.demo import demo_target_settings
        from dflash_assets.embedded.smollm2 import smollm2_target_path

        target = smollm2_target_path()
        os.environ.update(demo_target_settings(target))  # the assets' code versions name it, as make demo's do
    target_s = time.time() - t0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="demo-reliability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(one_run(workdir, i, args, target))
            print(f"run {i}: {'ok' if runs[-1]['ok'] else 'FAILED ' + str(runs[-1]['failed_partitions'])} "
                  f"in {runs[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = sum(len(r["failed_partitions"]) for r in runs)
    partitions = sum(len(r["checks"]) for r in runs)
    check_failures: dict[str, int] = {}
    for r in runs:
        for checks in r["checks"].values():
            for name, outcome in checks.items():
                check_failures[name] = check_failures.get(name, 0) + (not outcome["passed"])
    print(json.dumps({
        "runs": len(runs), "partitions": partitions, "failed_partitions": failed,
        "runs_with_a_failure": sum(not r["ok"] for r in runs), "check_failures": check_failures,
        "wall_s_per_run": [r["wall_s"] for r in runs], "tau": [r["tau"] for r in runs] if args.drafter else None,
        "plan_predicted_over_measured": [{c["what"]: c["ratio"] for c in r["plan_checks"]} for r in runs],
        "target": str(target), "target_ready_s": round(target_s, 1), "settings": vars(args),
        "cpu_capability": cpu_capability(), "target_weights_sha256": _sha256(Path(target) / "model.safetensors"),
        "machine": machine_info("dagster", "torch", "transformers"),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "per_run": runs,
    }, indent=2))


def per_kernel_level(args: argparse.Namespace) -> dict:
    """This script once per ``--kernels`` level, in a child process with ``ATEN_CPU_CAPABILITY`` set; the reports
    side by side, and whether the tiny targets they built differ."""
    import subprocess

    reports = {}
    for level in args.kernels.split(","):
        argv = [sys.executable, __file__, "--runs", str(args.runs), "--seed-base", str(args.seed_base),
                "--target", args.target, "--prompts", str(args.prompts), "--shard-size", str(args.shard_size),
                "--max-new-tokens", str(args.max_new_tokens), *(["--drafter"] if args.drafter else [])]
        if args.workdir:
            argv += ["--workdir", str(Path(args.workdir) / level)]
        print(f"kernel level {level}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        from dflash_assets.embedded.tiny_targets import cap_onednn_to_kernel_level

        env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
        cap_onednn_to_kernel_level(env)  # oneDNN at the same level, as on a CPU of that level (AMX: else a crash)
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True, env=env)
        reports[level] = json.loads(done.stdout)
    digests = {level: r["target_weights_sha256"] for level, r in reports.items()}
    return {"kernels": list(reports), "target_weights_sha256": digests,
            "distinct_targets": len(set(digests.values())),
            "runs_with_a_failure": {level: r["runs_with_a_failure"] for level, r in reports.items()},
            "check_failures": {level: r["check_failures"] for level, r in reports.items()},
            "per_kernel_level": reports}


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":
    main()
