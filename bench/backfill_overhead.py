"""Benchmark: orchestration overhead of a daemon backfill of 1,000 small partitions vs a plain loop.

Work: ``raw_prompts`` (the cheap, batchable CPU stage) over a source of N
distinct one-line prompts ingested with ``max_prompts_per_shard=1``, so N
``prompt_shards`` partitions of one prompt each.

1. Loop: ingest into a fresh local store (not timed), then time one Python
   loop calling ``materialize_prompt_shard(store, key)`` for every shard:
   the same library function the asset calls, in-process, no Dagster.
2. Daemon: start ``dagster dev`` (webserver + daemon, SQLite instance,
   ``max_concurrent_runs`` 2 for the 2-core machine) on this file as the code
   location, ingest through a ``prompt_corpus`` run (not timed), then time
   ``launchPartitionBackfill`` of every ``raw_prompts`` partition, as the UI
   launches it, until (a) the last partition's materialization event and
   (b) the backfill's own completion (COMPLETED_SUCCESS).

The code location (``defs`` below, built when ``DFLASH_BENCH_LOCATION=1``)
holds the project's own ``prompt_corpus`` and ``raw_prompts``; ``--policy``
swaps only the latter's ``BackfillPolicy`` (``with_attributes``), so the
benchmark always measures the asset as committed.

Prints one JSON object: seconds, overhead ratios ((daemon - loop) / loop),
the number and spans of runs, the daemon's tick wait, and the machine.

    .venv/bin/python bench/backfill_overhead.py --partitions 1000 --policy multi_run --max-partitions-per-run 500

Reads: nothing outside a temp dir (``--workdir`` to keep it). Writes: the temp
dir (source, two stores, the Dagster home).
"""


import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.machine import machine_info  # noqa: E402
import dagster as dg  # noqa: E402

from dagster_project.assets.prompts import prompt_corpus  # noqa: E402
from dagster_project.partitions import prompt_shards  # noqa: E402
from dagster_project.resources import StoreResource  # noqa: E402
from dflash_assets.prompts.shards import materialize_prompt_shard  # noqa: E402

LOCATION_ENV = "DFLASH_BENCH_LOCATION"
POLICY_ENV = "DFLASH_BENCH_POLICY"  # "single_run" | "multi_run:<N>" | "none" | "project"


def policy_from_spec(spec: str) -> dg.BackfillPolicy:
    if spec == "single_run":
        return dg.BackfillPolicy.single_run()
    if spec.startswith("multi_run:"):
        return dg.BackfillPolicy.multi_run(max_partitions_per_run=int(spec.split(":", 1)[1]))
    if spec == "none":  # one partition per run, what a backfill does without a policy
        return dg.BackfillPolicy.multi_run(max_partitions_per_run=1)
    raise ValueError(f"unknown policy {spec!r}")


def bench_definitions() -> dg.Definitions:
    from dagster_project.assets import prompts

    spec = os.environ.get(POLICY_ENV, "multi_run:500")
    asset = prompts.raw_prompts if spec == "project" else prompts.raw_prompts.with_attributes(
        backfill_policy=policy_from_spec(spec))
    return dg.Definitions(assets=[prompt_corpus, asset], resources={"store": StoreResource()})


if os.environ.get(LOCATION_ENV) == "1":
    defs = bench_definitions()


# --- the benchmark -------------------------------------------------------------------


def write_source(path: Path, n: int) -> None:
    lines = (json.dumps({"messages": [{"role": "user", "content": f"bench question {i}: what is {i} + {i}?"}]})
             for i in range(n))
    path.write_text("\n".join(lines) + "\n")


def run_loop(source: Path, store_dir: Path) -> dict:
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source
    from dflash_assets.store.backends import LocalStore

    store = LocalStore(store_dir)
    t0 = time.perf_counter()
    report = ingest_prompt_source(str(source), store, IngestConfig(max_prompts_per_shard=1))
    ingest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for key in report.shard_keys:
        materialize_prompt_shard(store, key)
    return {"loop_s": time.perf_counter() - t0, "ingest_s": ingest_s, "partitions": len(report.shard_keys)}


def run_daemon(source: Path, workdir: Path, policy_spec: str, timeout_s: float, storage: str) -> dict:
    if storage == "postgres":
        from tests.postgres_fixture import running_postgres

        with running_postgres() as pg:
            saved = {k: os.environ.get(k) for k in pg.env()}
            os.environ.update(pg.env())  # this process reads the instance too
            try:
                return _run_daemon(source, workdir, policy_spec, timeout_s, pg.env())
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return _run_daemon(source, workdir, policy_spec, timeout_s, None)


def _run_daemon(source: Path, workdir: Path, policy_spec: str, timeout_s: float, pg_env: dict | None) -> dict:
    from dagster._core.storage.dagster_run import RunsFilter

    from tests.dagster_dev import POSTGRES_STORAGE_YAML, dagster_dev, instance_yaml

    workspace = workdir / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_file:\n"
        f"      relative_path: {Path(__file__).resolve()}\n"
        "      attribute: defs\n"
        f"      working_directory: {REPO_ROOT}\n"
        "      location_name: dflash_assets\n"
    )
    env = {LOCATION_ENV: "1", POLICY_ENV: policy_spec,
           "DFLASH_STORE": str(workdir / "dagster-store"), "DFLASH_PROMPT_SOURCE": str(source), **(pg_env or {})}
    storage_yaml = POSTGRES_STORAGE_YAML if pg_env else ""
    t_start = time.perf_counter()
    with dagster_dev(workdir / "home", env=env, workspace=workspace,
                     dagster_yaml=instance_yaml(max_concurrent_runs=2, storage_yaml=storage_yaml)) as dev:
        startup_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        run_id = dev.launch_run(["prompt_corpus"], {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": 1}}}})
        if (status := dev.wait_for_run(run_id, timeout_s)) != "SUCCESS":
            raise RuntimeError(f"ingest run {run_id} ended {status}; log {dev.log_path}")
        ingest_s = time.perf_counter() - t0
        instance = dev.instance()
        partitions = len(instance.get_dynamic_partitions(prompt_shards.name))

        backfill_id = dev.launch_partition_backfill(["raw_prompts"], title="backfill_overhead bench")
        launched_at = time.time()
        state = dev.wait_for_backfill(backfill_id, timeout_s, poll_s=0.5)
        seen_done = time.time()
        times = dev.graphql("query($id: String!) { partitionBackfillOrError(backfillId: $id) { "
                            "... on PartitionBackfill { timestamp endTimestamp } } }", {"id": backfill_id})
        times = times["partitionBackfillOrError"]
        created = times["timestamp"]

        key = dg.AssetKey("raw_prompts")
        materialized = instance.get_materialized_partitions(key)
        last_event = instance.fetch_materializations(key, limit=1, ascending=False).records[0].timestamp
        records = instance.get_run_records(filters=RunsFilter(tags={"dagster/backfill": backfill_id}))
        run_spans = sorted((r.create_timestamp.timestamp(), r.start_time, r.end_time) for r in records)
        first_created = run_spans[0][0] if run_spans else None
        starts = [s for _, s, _ in run_spans if s]
        ends = [e for _, _, e in run_spans if e]
        return {
            "status": state["status"],
            "partitions": partitions,
            "materialized": len(materialized),
            "runs": len(records),
            "runs_failed": sum(r.dagster_run.status.value != "SUCCESS" for r in records),
            "to_materialized_s": last_event - created,
            "to_completed_s": (times["endTimestamp"] or seen_done) - created,
            "tick_wait_s": (first_created - created) if first_created else None,
            # from the first run's creation: what remains once the daemon has picked the backfill up
            "first_run_to_materialized_s": (last_event - first_created) if first_created else None,
            "planned_events_s": _planned_events_s(instance, records),
            "runs_span_s": (max(ends) - min(starts)) if starts and ends else None,
            "run_wall_s": [round(e - s, 2) for _, s, e in run_spans if s and e],
            "launch_to_seen_done_s": seen_done - launched_at,
            "ingest_s": ingest_s,
            "startup_s": startup_s,
        }


def _planned_events_s(instance, records) -> float | None:
    """Seconds the daemon spent writing the runs' ASSET_MATERIALIZATION_PLANNED events (one per partition)."""
    spans = []
    for record in records:
        planned = [e.timestamp for e in instance.all_logs(record.dagster_run.run_id,
                                                           of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED)]
        if planned:
            spans.append(max(planned) - record.create_timestamp.timestamp())
    return max(spans) if spans else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--policy", default="multi_run", choices=["multi_run", "single_run", "project", "none"],
                        help="BackfillPolicy of raw_prompts (project: the project's own asset)")
    parser.add_argument("--max-partitions-per-run", type=int, default=500, help="for --policy multi_run")
    parser.add_argument("--storage", default="sqlite", choices=["sqlite", "postgres"],
                        help="instance storage: SQLite under DAGSTER_HOME (local profile) or a throwaway "
                             "PostgreSQL (tests/postgres_fixture.py: fsync off) like the cluster profile")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--workdir", help="keep everything here (default: a temp dir, removed)")
    parser.add_argument("--goal", type=float, default=0.25, help="overhead goal: (daemon - loop) / loop")
    args = parser.parse_args(argv)

    spec = {"multi_run": f"multi_run:{args.max_partitions_per_run}"}.get(args.policy, args.policy)
    info = machine_info("dagster")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-backfill-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        source = workdir / "prompts.jsonl"
        write_source(source, args.partitions)
        loop = run_loop(source, workdir / "loop-store")
        daemon = run_daemon(source, workdir, spec, args.timeout, args.storage)
        n = daemon["partitions"]
        expected_runs = (n if spec == "none" else 1 if spec == "single_run"
                         else math.ceil(n / args.max_partitions_per_run) if args.policy == "multi_run" else None)
        out = {
            "bench": "backfill_overhead",
            "asset": "raw_prompts",
            "partitions": n,
            "policy": spec,
            "instance_storage": args.storage + (" (fsync=off, synchronous_commit=off)" if args.storage == "postgres" else ""),
            "expected_runs": expected_runs,
            "loop_s": round(loop["loop_s"], 2),
            "daemon_to_materialized_s": round(daemon["to_materialized_s"], 2),
            "daemon_to_completed_s": round(daemon["to_completed_s"], 2),
            "overhead_to_materialized": round(daemon["to_materialized_s"] / loop["loop_s"] - 1, 3),
            "overhead_to_completed": round(daemon["to_completed_s"] / loop["loop_s"] - 1, 3),
            "overhead_from_first_run": round(daemon["first_run_to_materialized_s"] / loop["loop_s"] - 1, 3),
            "goal": args.goal,
            "goal_met_to_materialized": daemon["to_materialized_s"] / loop["loop_s"] - 1 < args.goal,
            "goal_met_to_completed": daemon["to_completed_s"] / loop["loop_s"] - 1 < args.goal,
            "daemon": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in daemon.items()},
            "loop": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in loop.items()},
            "machine": info,
        }
        if loop["partitions"] != n or daemon["materialized"] != n:
            out["error"] = f"partition counts differ: loop {loop['partitions']}, dagster {n}, " \
                           f"materialized {daemon['materialized']}"
        print(json.dumps(out, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
