"""The Dagster instance (``$DAGSTER_HOME/dagster.yaml``) of each deployment profile.

- ``local``: SQLite under ``$DAGSTER_HOME`` (Dagster's own default; the file
  only caps concurrent runs for a small machine and turns telemetry off).
  No file at all works too: that is the embedded default.
- ``cluster``: run, event-log and schedule storage in PostgreSQL
  (``dagster-postgres``), connection from ``DAGSTER_PG_HOST``, ``_PORT``,
  ``_USER``, ``_PASSWORD``, ``_DB`` (resolved by Dagster when the instance
  loads, never written into the file); a queued run coordinator, run
  monitoring, and at most one run per ``dflash/gpu_host`` tag value.

``deploy/<profile>/dagster.yaml`` are these texts (tests keep them equal).
``python -m dagster_project.instance_config cluster --write $DAGSTER_HOME``
writes one. Reads nothing; writes only the file asked for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["INSTANCE_YAML", "POSTGRES_ENV", "instance_yaml", "write_instance_yaml", "postgres_env"]

POSTGRES_ENV = ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB")

_LOCAL = """\
# Dagster instance for DFLASH_PROFILE=local (the embedded default).
# Storage: SQLite under $DAGSTER_HOME, Dagster's default, so nothing to set.
# Deleting this file changes only the settings below.
concurrency:
  runs:
    max_concurrent_runs: 2  # the dev machine has 2 cores
  pools:
    default_limit: 1  # pool "gpu": one GPU step at a time unless `dagster instance concurrency set gpu N`; pool "ingest": keep 1
python_logs:  # the library's log lines (progress, warnings) go into each step's event log, where the UI shows them
  managed_python_loggers:
    - dflash_assets
  python_log_level: INFO
telemetry:
  enabled: false
"""

_CLUSTER = """\
# Dagster instance for DFLASH_PROFILE=cluster: one orchestrator (webserver +
# daemon) whose runs, events, schedules and sensor cursors live in PostgreSQL,
# so any host with this file and the DAGSTER_PG_* variables sees the same
# state. GPU work leaves the orchestrator through Dagster Pipes (see
# dagster_project/pipes.py), so runs themselves stay on this host.
storage:
  postgres:
    postgres_db:
      hostname:
        env: DAGSTER_PG_HOST
      port:
        env: DAGSTER_PG_PORT
      username:
        env: DAGSTER_PG_USER
      password:
        env: DAGSTER_PG_PASSWORD
      db_name:
        env: DAGSTER_PG_DB
      # dagster-postgres ships psycopg2; SQLAlchemy >= 2.1 maps plain postgresql:// to psycopg 3
      scheme: postgresql+psycopg2
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
concurrency:
  runs:
    max_concurrent_runs: 32
    tag_concurrency_limits:
      # a run pinned to a GPU host (tag dflash/gpu_host=NAME) waits for that host
      - key: dflash/gpu_host
        value:
          applyLimitPerUniqueValue: true
        limit: 1
  pools:
    granularity: op  # GPU assets use pool "gpu": dagster instance concurrency set gpu <number of GPU hosts>
    default_limit: 1  # safe until that is set: one GPU step at a time; pool "ingest" (prompt_corpus) stays at 1
run_monitoring:
  enabled: true
  start_timeout_seconds: 300
  max_resume_run_attempts: 0
python_logs:  # the library's log lines (progress, warnings) go into each step's event log, where the UI shows them
  managed_python_loggers:
    - dflash_assets
  python_log_level: INFO
telemetry:
  enabled: false
"""

INSTANCE_YAML: dict[str, str] = {"local": _LOCAL, "cluster": _CLUSTER}


def instance_yaml(profile: str) -> str:
    if profile not in INSTANCE_YAML:
        raise ValueError(f"unknown profile {profile!r}; expected one of {sorted(INSTANCE_YAML)}")
    return INSTANCE_YAML[profile]


def write_instance_yaml(dagster_home: str | Path, profile: str) -> Path:
    """Write ``dagster.yaml`` for ``profile`` into ``dagster_home`` (created if missing)."""
    home = Path(dagster_home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    path.write_text(instance_yaml(profile))
    return path


def postgres_env(host: str, port: int, user: str, password: str, db: str) -> dict[str, str]:
    """The DAGSTER_PG_* variables the cluster file reads."""
    return dict(zip(POSTGRES_ENV, (host, str(port), user, password, db)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print or write the dagster.yaml of a deployment profile.")
    parser.add_argument("profile", choices=sorted(INSTANCE_YAML))
    parser.add_argument("--write", metavar="DAGSTER_HOME", help="write DAGSTER_HOME/dagster.yaml instead of printing")
    args = parser.parse_args(argv)
    if args.write:
        print(write_instance_yaml(args.write, args.profile))
    else:
        sys.stdout.write(instance_yaml(args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
