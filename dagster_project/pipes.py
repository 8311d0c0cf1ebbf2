"""Running a GPU stage on another host through Dagster Pipes.

``GpuHostLauncher`` is the resource the GPU assets (``hidden_state_cache``,
``drafter_checkpoint``, ``drafter_eval``) call. It opens a Pipes session whose
context and messages travel through the store itself, starts
``python -m dflash_assets.pipes_worker STAGE`` on a host, waits for it, and
hands back the results; the remote's log lines, materialization metadata and
check results land in the Dagster event log as if the stage ran locally.

Transport, chosen by the store URI:
- ``s3://bucket/prefix``: dagster-aws's ``PipesS3ContextInjector`` and
  ``PipesS3MessageReader``, both under ``<prefix>/_pipes/<run_id>/...`` and
  deleted at the end. The host needs the package and S3 access, nothing else.
- a local directory: a context file and a message file under
  ``<root>/_pipes/<run_id>/...`` (a local subprocess, or hosts that mount
  the same directory).

Launch, chosen by configuration:
- ``command_prefix=[]`` (default): a local subprocess with the orchestrator's
  environment plus the stage's variables.
- ``command_prefix=["ssh", "-o", "BatchMode=yes", "{host}"]`` with
  ``hosts=[...]``: the remote command is one shell-quoted string
  ``cd WORKDIR && exec python3 -m dflash_assets.pipes_worker STAGE
  --env-stdin``. Every variable for the stage goes as one JSON line on stdin
  except the few in ``COMMAND_LINE_ENV`` (PATH, PYTHONPATH, ... which must be
  set before Python starts), so no value reaches a command line (``ps``) or
  the event log, whatever its name; the log lists the names only. ssh gets
  keepalives (``ServerAliveInterval``) and every stage a timeout, so a host
  that hangs or vanishes frees its ``gpu`` pool slot.
- ``remote_shell=False`` appends the remote argv as separate arguments
  (``kubectl exec -i POD --``, ``docker exec -i CONTAINER``, ``srun``).

The launcher is a deployment setting (``deployment.py`` builds it from the
environment): run config cannot change its command, hosts or environment.

Reads: the store (through ``StoreResource``), the orchestrator's environment
(only the names in ``forward_env``). Writes: the ``_pipes/`` session objects
in the store (removed afterwards); the stage itself writes its outputs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import dagster as dg
from dagster_aws.pipes import PipesS3ContextInjector, PipesS3MessageReader
from pydantic import Field

from dagster_project.profile import DEFAULT_STAGE_TIMEOUT_S
from dagster_project.resources import DeploymentResource
from dflash_assets.pipes_worker import (
    EXTRA_CONFIG,
    EXTRA_PARTITION_KEYS,
    EXTRA_STAGE,
    EXTRA_STORE_URI,
    STAGE_CHECKS,
)
from dflash_assets.store.backends import LocalStore, S3Store

__all__ = [
    "GpuHostLauncher",
    "LaunchSpec",
    "build_launch",
    "check_specs_for",
    "is_secret_name",
    "select_host",
    "HOST_TAG",
    "WORKER_MODULE",
    "DEFAULT_FORWARD_ENV",
    "COMMAND_LINE_ENV",
    "DEFAULT_STAGE_TIMEOUT_S",
    "with_ssh_keepalive",
]

WORKER_MODULE = "dflash_assets.pipes_worker"
HOST_TAG = "dflash/gpu_host"  # a run tag that pins the run's GPU stages to one host
PIPES_PREFIX = "_pipes"
DEFAULT_FORWARD_ENV = (
    "DFLASH_STORE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)  # not AWS_CA_BUNDLE or AWS_PROFILE: they name files on the orchestrator; set them in `env` if the host has them
# The only variables set on the remote command line (they must exist before Python starts, and hold no secret);
# every other variable, whatever its name, goes over stdin.
COMMAND_LINE_ENV = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED")
SSH_KEEPALIVE = ("-o", "ServerAliveInterval=30", "-o", "ServerAliveCountMax=4")  # a vanished host fails in ~2 min
_SECRET_WORDS = {"SECRET", "TOKEN", "PASSWORD", "PASSWD", "PWD", "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS",
                 "PRIVATE", "AUTH", "PAT", "DSN", "COOKIE", "SIGNATURE"}
_BOOTSTRAP_RE = re.compile(r"(DAGSTER_PIPES_(?:CONTEXT|MESSAGES))=[A-Za-z0-9+/=_-]+")


def is_secret_name(name: str) -> bool:
    """Names that look like credentials (``OPENAI_API_KEY``, ``DB_PASSWD``, ``GITHUB_PAT``, ``PG_DSN``).

    Informational: no value of any variable is logged or put on a remote command line, whatever its name.
    """
    return any(word in _SECRET_WORDS for word in re.split(r"[^A-Z0-9]+", name.upper()))


def with_ssh_keepalive(prefix: Sequence[str]) -> list[str]:
    """``prefix`` with ssh keepalive options added when it runs ssh and sets none itself."""
    prefix = list(prefix)
    if prefix and os.path.basename(prefix[0]) == "ssh" and not any("ServerAlive" in part for part in prefix):
        return [prefix[0], *SSH_KEEPALIVE, *prefix[1:]]
    return prefix


def check_specs_for(stage: str, asset: Any, *, blocking: bool = False) -> list[dg.AssetCheckSpec]:
    """Check specs for the checks ``stage`` reports from the host (declare them on the asset)."""
    return [dg.AssetCheckSpec(name, asset=asset, blocking=blocking) for name in STAGE_CHECKS.get(stage, ())]


def select_host(
    hosts: Sequence[str], partition_keys: Sequence[str], pinned: str | None, fallback: str, busy: Collection[str] = ()
) -> str | None:
    """The host for a run: the pinned one (run tag), else a stable hash of the first partition key.

    Stable so that a retried partition returns to the host whose caches hold its
    inputs; a host busy with another run is skipped while a free one exists.
    """
    if not hosts:
        return None
    if pinned:
        if pinned not in hosts:
            raise ValueError(f"run tag {HOST_TAG}={pinned!r} names no configured host; hosts: {list(hosts)}")
        return pinned
    key = partition_keys[0] if partition_keys else fallback
    start = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(hosts)
    order = [hosts[(start + i) % len(hosts)] for i in range(len(hosts))]
    return next((h for h in order if h not in busy), order[0])


def _busy_hosts(context: dg.AssetExecutionContext, hosts: Sequence[str]) -> set[str]:
    """Hosts that other in-progress runs were given (their ``dflash/gpu_host`` tag)."""
    runs = context.instance.get_runs(
        filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED], tags={HOST_TAG: list(hosts)})
    )
    return {r.tags[HOST_TAG] for r in runs if r.run_id != context.run.run_id}


@dataclass(frozen=True)
class LaunchSpec:
    """How to start the worker: argv, local env (None: inherit), stdin bytes, cwd, and a loggable line."""

    argv: list[str]
    env: dict[str, str] | None
    stdin: bytes | None
    cwd: str | None
    display: str
    env_names: tuple[str, ...] = ()  # what the stage gets beyond the host's own environment (names, for the log)


def build_launch(
    *,
    stage: str,
    remote_env: Mapping[str, str],
    command_prefix: Sequence[str] = (),
    remote_shell: bool = True,
    python: str | None = None,
    workdir: str | None = None,
    host: str | None = None,
    message_interval: float = 5.0,
) -> LaunchSpec:
    """The command that runs ``python -m dflash_assets.pipes_worker STAGE`` locally or through a prefix."""
    worker = ["-m", WORKER_MODULE, stage, "--message-interval", f"{message_interval:g}"]
    if not command_prefix:
        argv = [python or sys.executable, *worker]
        return LaunchSpec(argv, {**os.environ, **remote_env}, None, workdir, _display(argv), tuple(sorted(remote_env)))

    prefix = _fill_host(with_ssh_keepalive(command_prefix), host)
    public = {k: v for k, v in remote_env.items() if k in COMMAND_LINE_ENV}
    private = {k: v for k, v in remote_env.items() if k not in COMMAND_LINE_ENV}
    remote = [*(["env", *[f"{k}={v}" for k, v in public.items()]] if public else []), python or "python3", *worker,
              "--env-stdin"]
    if remote_shell:
        cmd = shlex.join(remote)
        if workdir:
            cmd = f"cd {shlex.quote(workdir)} && exec {cmd}"
        argv = [*prefix, cmd]
    else:
        argv = [*prefix, *(["env", "-C", workdir] if workdir else []), *remote]
    stdin = (json.dumps(private) + "\n").encode()
    return LaunchSpec(argv, None, stdin, None, _display(argv), tuple(sorted(remote_env)))


def _fill_host(prefix: Sequence[str], host: str | None) -> list[str]:
    if any("{host}" in part for part in prefix):
        if host is None:
            raise ValueError(f"command_prefix {list(prefix)} has a {{host}} placeholder but no hosts are configured")
        return [part.replace("{host}", host) for part in prefix]
    return list(prefix)


def _display(argv: Sequence[str]) -> str:
    """argv for the log, Pipes bootstrap blobs shortened (on a remote launch no value but COMMAND_LINE_ENV's is in it)."""
    return _BOOTSTRAP_RE.sub(r"\1=…", shlex.join(argv))


class _StoreS3MessageReader(PipesS3MessageReader):
    """``PipesS3MessageReader`` whose chunks live under the store's prefix instead of the bucket root."""

    def __init__(self, *, key_prefix: str, **kwargs: Any):
        super().__init__(**kwargs)
        self._key_prefix = key_prefix

    @contextlib.contextmanager
    def get_params(self) -> Iterator[Mapping[str, Any]]:
        yield {"bucket": self.bucket, "key_prefix": self._key_prefix,
               "include_stdio_in_messages": self.include_stdio_in_messages}


class GpuHostLauncher(DeploymentResource):
    """Starts a stage's work on a GPU host through Dagster Pipes, with context and messages in the store."""

    command_prefix: list[str] = Field(
        default_factory=list,
        description='Prefix of the launch command, e.g. ["ssh", "-o", "BatchMode=yes", "{host}"]; [] = local subprocess.',
    )
    hosts: list[str] = Field(default_factory=list, description="Hosts substituted for {host}; one is chosen per run.")
    remote_shell: bool = Field(
        default=True,
        description="Pass the remote command as one shell-quoted string (ssh, sh -c); False: as separate arguments.",
    )
    python: Optional[str] = Field(default=None, description="Python on the host; default this interpreter (local) or python3.")
    workdir: Optional[str] = Field(default=None, description="Working directory on the host.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra env vars for the host (CUDA_VISIBLE_DEVICES, HF_HOME).")
    forward_env: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FORWARD_ENV),
        description="Orchestrator env vars passed to the host when set (secret-named ones via stdin, never logged).",
    )
    poll_interval_s: float = Field(default=5.0, description="Seconds between message uploads and polls (S3 transport).")
    timeout_s: Optional[float] = Field(default=DEFAULT_STAGE_TIMEOUT_S, gt=0,
                                       description="Stop the stage after this many seconds (None: never).")
    scratch_dir: Optional[str] = Field(default=None, description="Fast local disk on the GPU hosts for staging.")
    work_dir: Optional[str] = Field(default=None, description="Persistent dir on the GPU hosts for training states.")
    stdio_in_messages: bool = Field(default=False, description="Also ship the host's stdout/stderr through the store.")

    def run(
        self,
        context: dg.AssetExecutionContext,
        stage: str,
        payload: Mapping[str, Any] | dg.Config | None = None,
        store: Any = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``stage`` with ``payload`` (JSON-able config) against ``store`` and return the Pipes results.

        ``store`` is the ``StoreResource`` (or an opened store). In an asset:
        ``return launcher.run(context, "hidden_state_cache", config, store).get_materialize_result()``.
        """
        opened = store.open() if hasattr(store, "open") else store
        if not isinstance(opened, (LocalStore, S3Store)):
            raise TypeError(f"store must be a StoreResource or an opened store, got {type(store).__name__}")
        if isinstance(payload, dg.Config):
            payload = payload.model_dump()
        keys = list(context.partition_keys) if context.has_partition_key_range or context.has_partition_key else []
        pinned = context.run.tags.get(HOST_TAG)
        busy = _busy_hosts(context, self.hosts) if len(self.hosts) > 1 and not pinned else set()
        host = select_host(self.hosts, keys, pinned, context.run.run_id, busy)
        if host and not pinned:  # the run now holds this host: other runs avoid it, later steps reuse it
            context.instance.add_run_tags(context.run.run_id, {HOST_TAG: host})
        where = host or "localhost"
        extras = {EXTRA_STAGE: stage, EXTRA_STORE_URI: opened.uri, EXTRA_CONFIG: dict(payload or {}),
                  EXTRA_PARTITION_KEYS: keys}
        session_key = f"{PIPES_PREFIX}/{context.run.run_id}/{stage}-{uuid.uuid4().hex[:8]}"

        with _transport(opened, session_key, self.poll_interval_s, self.stdio_in_messages) as (injector, reader):
            with dg.open_pipes_session(
                context=context, context_injector=injector, message_reader=reader, extras=extras
            ) as session:
                spec = build_launch(
                    stage=stage,
                    remote_env={**self._remote_env(opened), **session.get_bootstrap_env_vars()},
                    command_prefix=self.command_prefix,
                    remote_shell=self.remote_shell,
                    python=self.python,
                    workdir=self.workdir,
                    host=host,
                    message_interval=self.poll_interval_s,
                )
                context.log.info(f"[dflash] stage {stage} on {where}: {spec.display}")
                context.log.info(f"[dflash] environment for the stage (names only): {', '.join(spec.env_names)}")
                _run_process(context, spec, f"stage {stage} on {where}", self.timeout_s)
        return dg.PipesClientCompletedInvocation(session, metadata={"gpu_host": where})

    def _remote_env(self, store: LocalStore | S3Store) -> dict[str, str]:
        """Forwarded orchestrator variables, then the store's own address, then ``env`` (host-specific) on top."""
        env = {name: os.environ[name] for name in self.forward_env if name in os.environ}
        env["DFLASH_STORE"] = store.uri
        if isinstance(store, S3Store):
            endpoint = store.client.meta.endpoint_url
            if endpoint and "amazonaws.com" not in endpoint:
                env["AWS_ENDPOINT_URL"] = endpoint
            if store.client.meta.region_name:
                env.setdefault("AWS_DEFAULT_REGION", store.client.meta.region_name)
        env.update(self.env)
        return env


@contextlib.contextmanager
def _transport(store: LocalStore | S3Store, session_key: str, interval: float, stdio: bool) -> Iterator[tuple[Any, Any]]:
    """Context injector and message reader living under ``session_key`` in the store; removed afterwards."""
    if isinstance(store, S3Store):
        prefix = f"{store.prefix}/{session_key}" if store.prefix else session_key
        injector = PipesS3ContextInjector(bucket=store.bucket, client=store.client, key_prefix=prefix + "/")
        reader = _StoreS3MessageReader(
            key_prefix=prefix + "/messages", bucket=store.bucket, client=store.client,
            interval=interval, include_stdio_in_messages=stdio,
        )
        try:
            yield injector, reader
        finally:
            for key in store.list(session_key):
                store.delete(key)
    else:
        session_dir = store.root / session_key
        session_dir.mkdir(parents=True)
        injector = dg.PipesFileContextInjector(str(session_dir / "context.json"))
        reader = dg.PipesFileMessageReader(str(session_dir / "messages.jsonl"), include_stdio_in_messages=stdio)
        try:
            yield injector, reader
        finally:
            shutil.rmtree(session_dir, ignore_errors=True)
            for parent in (session_dir.parent, session_dir.parent.parent):  # _pipes/<run_id>, _pipes
                with contextlib.suppress(OSError):
                    parent.rmdir()


def _run_process(context: dg.AssetExecutionContext, spec: LaunchSpec, what: str, timeout_s: float | None) -> None:
    """Start the worker, feed stdin, tee stderr (keeping its tail for the error), wait; raise on failure."""
    proc = subprocess.Popen(
        spec.argv, env=spec.env, cwd=spec.cwd,
        stdin=subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    tee = threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True)
    tee.start()
    if spec.stdin is not None:
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.write(spec.stdin)
            proc.stdin.close()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        tee.join(timeout=5)
        raise dg.Failure(f"{what} timed out after {timeout_s:g}s", metadata=_tail_metadata(tail))
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
        context.log.info(f"[dflash] interrupted: stopping {what}")
        _stop(proc)
        raise
    tee.join(timeout=5)
    if rc != 0:
        last = next((line for line in reversed(tail) if line.strip()), "")
        raise dg.Failure(f"{what} exited with code {rc}: {last.strip()}", metadata=_tail_metadata(tail))


def _tee(stream: Any, tail: collections.deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        sys.stderr.write(line)
    stream.close()


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail_metadata(tail: Sequence[str]) -> dict[str, dg.MetadataValue]:
    return {"stderr_tail": dg.MetadataValue.md("```\n" + "".join(tail)[-4000:] + "\n```")}


GpuLauncherParam = dg.ResourceParam[GpuHostLauncher]  # what a GPU asset's parameter is annotated with
