"""Remote side of a GPU stage launched through Dagster Pipes: ``python -m dflash_assets.pipes_worker STAGE``.

The orchestrator (``dagster_project.pipes.GpuHostLauncher``) starts this module
on a GPU host, over ssh, kubectl or as a local subprocess. The host needs only
this package and access to the store: no Dagster, no shared filesystem.

Reads:
- the Pipes bootstrap parameters (``DAGSTER_PIPES_CONTEXT`` and
  ``DAGSTER_PIPES_MESSAGES``, base64 + zlib JSON, in the environment);
- with ``--env-stdin``, one JSON object of extra environment variables
  (credentials) on standard input, so they never appear in a command line;
- the Pipes context: from the S3 store (``PipesS3ContextLoader``) when the
  store is ``s3://``, else from a file under the local store's ``_pipes/``;
- the stage's inputs, through the store named in the context's extras.

Writes: the stage's outputs through the store, and Pipes messages (log lines,
the asset materialization with its metadata, asset check results) back to the
orchestrator through the same channel (``PipesS3MessageWriter`` or a file).

Stages are plain functions ``fn(call: StageCall) -> StageResult`` in
:data:`STAGES`; each GPU stage's adapter imports its library when that stage
runs, so GPU code is never imported for another stage nor by the orchestrator.
Imports ``dagster_pipes`` (a small, dependency-free package), never ``dagster``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from dflash_assets.stage_io import CheckOutcome, StageCall, StageFn, StageResult

__all__ = [
    "CheckOutcome",
    "StageCall",
    "StageResult",
    "STAGES",
    "STAGE_CHECKS",
    "register_stage",
    "resolve_stage",
    "run_stage",
    "main",
]

# Keys of the Pipes extras the orchestrator sends (dagster_project.pipes builds them).
EXTRA_STAGE = "dflash_stage"
EXTRA_STORE_URI = "dflash_store_uri"
EXTRA_CONFIG = "dflash_config"
EXTRA_PARTITION_KEYS = "dflash_partition_keys"  # all keys of the run (one, or many for a single-run backfill)


def _selftest(call: StageCall) -> StageResult:
    """Read ``config["input_key"]`` from the store, write its reverse to ``config["output_key"]``.

    Reports what the host saw (cwd, host name, the *names* of its environment
    variables, whether ``dagster`` got imported) so tests can prove that
    nothing leaked from the orchestrator. ``config["fail"]`` raises on purpose;
    ``config["hang_s"]`` sleeps that long first (a hung stage).
    """
    cfg = call.config
    data = call.store.read_bytes(cfg["input_key"])
    call.log.info(f"selftest: read {len(data)} bytes from {cfg['input_key']} (partition {call.partition_key})")
    if cfg.get("fail"):
        raise RuntimeError(f"selftest asked to fail: {cfg['fail']}")
    if cfg.get("hang_s"):  # a stage that hangs: the launcher's timeout must stop it
        time.sleep(float(cfg["hang_s"]))
    out = data[::-1]
    call.store.write_bytes(cfg["output_key"], out)
    call.log.info(f"selftest: wrote {len(out)} bytes to {cfg['output_key']}")
    digest = hashlib.sha256(out).hexdigest()
    roundtrip = hashlib.sha256(call.store.read_bytes(cfg["output_key"])).hexdigest() == digest
    return StageResult(
        metadata={
            "bytes": len(out),
            "sha256": digest,
            "host": socket.gethostname(),
            "cwd": os.getcwd(),
            "env_names": sorted(os.environ),
            "imports_dagster": "dagster" in sys.modules,
            "partition_keys": call.partition_keys,
        },
        checks=[CheckOutcome("selftest_roundtrip", passed=roundtrip, metadata={"sha256": digest})],
        data_version=digest[:16],
    )


# The GPU stages live in the stage libraries, which import torch: each adapter imports its stage on
# call, so the orchestrator (which reads this module for its constants) never loads torch.
def _hidden_state_cache(call: StageCall) -> StageResult:
    from dflash_assets.hidden_states.stage import pipes_stage

    return pipes_stage(call)


def _drafter_checkpoint(call: StageCall) -> StageResult:
    from dflash_assets.drafter.stages import pipes_stage_train

    return pipes_stage_train(call)


def _drafter_eval(call: StageCall) -> StageResult:
    from dflash_assets.drafter.stages import pipes_stage_eval

    return pipes_stage_eval(call)


# Stage name -> ``fn(call: StageCall) -> StageResult``.
STAGES: dict[str, StageFn] = {
    "selftest": _selftest,
    "hidden_state_cache": _hidden_state_cache,
    "drafter_checkpoint": _drafter_checkpoint,
    "drafter_eval": _drafter_eval,
}

# Check names each stage reports: the asset that launches it must declare these
# as check specs (dagster_project.pipes.check_specs_for builds them).
STAGE_CHECKS: dict[str, tuple[str, ...]] = {"selftest": ("selftest_roundtrip",), "drafter_eval": ("lossless",)}


def register_stage(name: str, fn: StageFn, checks: tuple[str, ...] = ()) -> None:
    STAGES[name] = fn
    STAGE_CHECKS[name] = tuple(checks)


def resolve_stage(name: str) -> StageFn:
    """The stage function for ``name``."""
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}; known: {sorted(STAGES)}")
    return STAGES[name]


def _pipes_metadata(values: Mapping[str, Any]) -> dict[str, Any]:
    """Raw values as Pipes metadata: scalars inferred, mappings/lists as JSON, tables as markdown."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
            value = value.item()
        if value is None:
            continue
        if isinstance(value, (Mapping, list, tuple)):
            out[key] = {"raw_value": json.loads(json.dumps(value, default=str)), "type": "json"}
        elif isinstance(value, str) and value.lstrip().startswith("|"):
            out[key] = {"raw_value": value, "type": "md"}
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        else:
            out[key] = str(value)
    return out


def run_stage(pipes: Any, stage: str) -> StageResult:
    """Run ``stage`` inside an open Pipes context and report its results to Dagster."""
    from dflash_assets.store.backends import open_store

    extras = pipes.extras
    if extras.get(EXTRA_STAGE) != stage:
        raise RuntimeError(f"launched as stage {stage!r} but the Pipes context is for {extras.get(EXTRA_STAGE)!r}")
    uri = extras[EXTRA_STORE_URI]
    client = _s3_client() if uri.startswith("s3://") else None
    store = open_store(uri, s3_client=client)
    partition_keys = list(extras.get(EXTRA_PARTITION_KEYS) or [])
    call = StageCall(
        stage=stage,
        store=store,
        partition_key=partition_keys[0] if len(partition_keys) == 1 else None,
        partition_keys=partition_keys,
        config=dict(extras.get(EXTRA_CONFIG) or {}),
        log=pipes.log,
        run_id=pipes.run_id,
        asset_key=pipes.asset_key if pipes.is_asset_step and len(pipes.asset_keys) == 1 else None,
    )
    pipes.log.info(f"stage {stage} started on {socket.gethostname()} (store {store.uri})")
    result = resolve_stage(stage)(call)
    for check in result.checks:
        pipes.report_asset_check(
            check_name=check.name, passed=bool(check.passed), severity=check.severity,
            metadata=_pipes_metadata(check.metadata) or None,
        )
    if pipes.is_asset_step:
        pipes.report_asset_materialization(metadata=_pipes_metadata(result.metadata), data_version=result.data_version)
    return result


def _s3_client() -> Any:
    """A boto3 S3 client from the environment (boto3 reads AWS_ENDPOINT_URL and credentials itself)."""
    from dflash_assets.store.backends import s3_client

    return s3_client()


def _read_env_from_stdin() -> None:
    line = sys.stdin.readline()
    if not line.strip():
        return
    env = json.loads(line)
    if not isinstance(env, dict):
        raise SystemExit("--env-stdin expects one JSON object on the first line of stdin")
    os.environ.update({str(k): str(v) for k, v in env.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_assets.pipes_worker", description=__doc__.split("\n")[0])
    parser.add_argument("stage", help=f"one of {sorted(STAGES)}")
    parser.add_argument("--env-stdin", action="store_true", help="read a JSON object of env vars from stdin first")
    parser.add_argument("--message-interval", type=float, default=5.0, help="seconds between message uploads (S3)")
    args = parser.parse_args(argv)
    if args.env_stdin:
        _read_env_from_stdin()

    from dagster_pipes import (
        PipesDefaultContextLoader,
        PipesDefaultMessageWriter,
        PipesEnvVarParamsLoader,
        PipesS3ContextLoader,
        PipesS3MessageWriter,
        open_dagster_pipes,
    )

    params = PipesEnvVarParamsLoader()
    if not params.is_dagster_pipes_process():
        print("pipes_worker: DAGSTER_PIPES_CONTEXT is not set; this module is started by Dagster", file=sys.stderr)
        return 2
    if "bucket" in params.load_context_params():  # S3 transport: context and messages live in the store's bucket
        client = _s3_client()
        loader, writer = PipesS3ContextLoader(client), PipesS3MessageWriter(client, interval=args.message_interval)
    else:  # file transport under a local store's _pipes/ directory
        loader, writer = PipesDefaultContextLoader(), PipesDefaultMessageWriter()
    with open_dagster_pipes(context_loader=loader, message_writer=writer, params_loader=params) as pipes:
        run_stage(pipes, args.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
