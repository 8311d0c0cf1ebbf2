"""Serving a target on this host: the launch command (SGLang or ``transformers serve``) and a managed process.

``engine_server_command`` gives the argv that serves a model directory;
``EngineServer`` starts it, waits until it is healthy and serves the target
(probing it like the fleet does), and stops it. ``local_engine_server`` puts
the two together with a free port and sensible CPU threading; the ``dflash
engine`` CLI, the demo and the embedded engine use it.

Reads: the model directory (by the server process). Writes: the server's
output to an optional log file.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, Sequence

from dflash_assets.generation.engines import (
    Engine,
    EngineKind,
    EngineProbe,
    OpenAIEngine,
    SGLangEngine,
    normalize_model_id,
)
from dflash_assets.generation.fleet import EndpointConfig, run_sync

__all__ = ["engine_server_command", "EngineServer", "local_engine_server", "default_server_port"]


def engine_server_command(kind: Literal["sglang", "transformers"], model_path: str | os.PathLike, *, port: int,
                          host: str = "127.0.0.1", tp: int = 1, served_model_name: str | None = None,
                          reasoning_parser: str | None = "qwen3", extra_args: Sequence[str] = (),
                          python: str | None = None, tool_call_parser: str | None = None,
                          deterministic_inference: bool = False) -> list[str]:
    """argv that serves ``model_path`` on ``host:port``.

    - ``sglang``: ``python -m sglang.launch_server --model-path P --port N
      --tp T --host H --reasoning-parser qwen3`` (speak to it with kind
      ``sglang`` at ``/generate`` or kind ``openai``); ``reasoning_parser=None``
      for a target without a thinking mode (SmolLM2) omits the parser.
      ``tool_call_parser`` (``qwen3_coder`` for Qwen3.5/3.6) adds
      ``--tool-call-parser``; ``deterministic_inference`` adds
      ``--enable-deterministic-inference`` (only then does a request's seed
      make its output reproducible; SGLang ignores seeds otherwise).
    - ``transformers``: ``transformers serve P --host H --port N`` (pinned to P,
      which it loads at start; OpenAI-compatible, kind ``openai``).
    """
    python = python or sys.executable
    model_path = str(model_path)
    if kind == "sglang":
        argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port),
                "--tp", str(tp), "--host", host] + (["--reasoning-parser", reasoning_parser] if reasoning_parser else [])
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        if tool_call_parser:
            argv += ["--tool-call-parser", tool_call_parser]
        if deterministic_inference:
            argv += ["--enable-deterministic-inference"]
    elif kind == "transformers":
        exe = Path(python).with_name("transformers")
        head = [str(exe)] if exe.exists() else [python, "-m", "transformers.cli.transformers"]
        argv = head + ["serve", model_path, "--host", host, "--port", str(port)]
    else:
        raise ValueError(f"unknown server kind {kind!r}; expected sglang or transformers")
    return argv + list(extra_args)


class EngineServer:
    """A server process started on this host; ``start()`` returns once it is healthy and serves the model.

    Use as a context manager (stops the process on exit) or call
    ``start``/``stop``. ``endpoint_kind`` is the fleet kind to reach it with.
    """

    def __init__(self, argv: Sequence[str], *, url: str, endpoint_kind: EngineKind, expect_model: str,
                 log_path: str | os.PathLike | None = None, env: dict | None = None):
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.endpoint_kind = endpoint_kind
        self.expect_model = expect_model
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def endpoint_config(self, max_concurrency: int | None = None):
        """The fleet's ``EndpointConfig`` for this server."""
        if max_concurrency is None:
            max_concurrency = 64 if self.endpoint_kind == "sglang" else 4
        return EndpointConfig(url=self.url, kind=self.endpoint_kind, max_concurrency=max_concurrency)

    def start(self, wait_s: float = 600.0, detach: bool = False) -> "EngineServer":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(self.env or {})}, start_new_session=detach)
        finally:
            if self.log_path:
                log.close()
        try:
            self.wait_ready(wait_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, wait_s: float) -> EngineProbe:
        """Poll until the server answers its probe and serves ``expect_model``."""
        deadline = time.monotonic() + wait_s
        last = "not started"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine server exited with code {self.proc.returncode}: {self.command}"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            probe = run_sync(_probe_once(self.endpoint_kind, self.url))
            if probe.healthy and probe.served_models:
                want = normalize_model_id(self.expect_model)
                if any(normalize_model_id(m) == want for m in probe.served_models):
                    return probe
                last = f"serves {probe.served_models}, expected {self.expect_model}"
            else:
                last = probe.error or "unhealthy"
            time.sleep(0.5)
        raise TimeoutError(f"engine at {self.url} not ready after {wait_s:.0f}s ({last}): {self.command}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)

    def __enter__(self) -> "EngineServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def _probe_once(kind: EngineKind, url: str) -> EngineProbe:
    engine: Engine
    # one look per call (health_wait_s=0): `wait_ready` polls until its own deadline
    if kind == "sglang":
        engine = _IdentityOnlySGLang(url, probe_timeout_s=5.0, health_wait_s=0.0)
    else:
        engine = OpenAIEngine(url, probe_timeout_s=5.0, health_wait_s=0.0)
    async with engine:
        return await engine.probe()


class _IdentityOnlySGLang(SGLangEngine):
    """SGLang probe without a tokenizer (for readiness checks only; cannot chat)."""

    def __init__(self, url: str, **kwargs):
        Engine.__init__(self, url, **kwargs)


def default_server_port(kind: str) -> int:
    return 30000 if kind == "sglang" else 8000


def local_engine_server(kind: Literal["sglang", "transformers"], target: str | os.PathLike, *,
                        port: int | None = None, host: str = "127.0.0.1", tp: int = 1,
                        served_model_name: str | None = None, log_path: str | os.PathLike | None = None,
                        extra_args: Sequence[str] = (), dtype: str | None = None,
                        reasoning_parser: str | None = "qwen3") -> EngineServer:
    """An ``EngineServer`` (not started) for ``target`` on this host.

    ``kind='transformers'`` runs ``transformers serve`` (reach it with
    endpoint kind ``openai``); ``kind='sglang'`` runs SGLang (endpoint kind
    ``sglang``). ``port=0`` picks a free port. ``dtype`` (transformers only)
    overrides the checkpoint's dtype, e.g. float32 for bf16 weights on a CPU.
    """
    model = str(target)
    if kind == "transformers" and dtype is not None and "--dtype" not in extra_args:
        extra_args = [*extra_args, "--dtype", dtype]
    if port is None:
        port = default_server_port(kind)
    if port == 0:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    argv = engine_server_command(kind, model, port=port, host=host, tp=tp, served_model_name=served_model_name,
                                 extra_args=extra_args, reasoning_parser=reasoning_parser)
    env = None
    if kind == "transformers" and "OMP_NUM_THREADS" not in os.environ:
        # torch's default (one OpenMP thread per core) spin-waits when the host is shared: on a
        # busy 2-core machine 32 tokens of the tiny target took 10.8 s with 2 threads, 0.9 s with 1.
        env = {"OMP_NUM_THREADS": str(max(1, min(4, (os.cpu_count() or 2) // 2)))}
    return EngineServer(argv, url=f"http://{host}:{port}", endpoint_kind="sglang" if kind == "sglang" else "openai",
                        expect_model=served_model_name or model, log_path=log_path, env=env)
