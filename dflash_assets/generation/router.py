"""sglang-router in front of many engines: its command line, a router process on this host, its worker list.

``router_command`` is the argv that starts sglang-router 0.3.2 (``pip install
'dflash-assets[router]'``: a Rust binary in a wheel, no CUDA) in front of
engine URLs; ``RouterProcess`` starts it, waits until every worker is
registered and healthy, and stops it. The fleet takes the router's URL as one
endpoint of kind ``sglang``.

``read_router_workers`` reads a router's ``GET /workers`` (url, model_id,
is_healthy, load per worker); an endpoint that is not a router gives None.
``router_has_no_worker`` recognizes the router's answer when no worker could
take a request: HTTP 500 ``call_upstream_request_error`` (the workers it
tried are gone) or 503 ``no_available_workers`` (every circuit open). The
fleet counts it as a connection failure of the endpoint, so a router whose
workers are all gone is excluded after a few requests, not after every
request has used up its retries: its ``/health`` is 200 and its
``/readiness`` keeps saying ready until its next health check (every 60 s by
default, ``--health-check-interval-secs``).

The router reads each worker's ``/model_info`` and loads the tokenizer from
its ``model_path``: start the workers on a local model directory, else it
tries to download the tokenizer from the model hub.

Reads: the router's ``/workers``. Writes: the router's output to an optional log file.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_assets.generation.engines import EngineError, HttpEngine

__all__ = ["RouterWorker", "read_router_workers", "parse_router_workers", "router_has_no_worker", "router_command",
           "RouterProcess"]

# The router's error codes when no worker took the request (sgl-model-gateway 0.3.2).
NO_WORKER_CODES = ("call_upstream_request_error", "no_available_workers")


@dataclass(frozen=True)
class RouterWorker:
    """One worker in a router's ``GET /workers`` list."""

    url: str
    model_id: str
    names: tuple[str, ...]  # every name the router knows the worker's model by (model_id, served name, path)
    healthy: bool
    load: int | None


def parse_router_workers(reply: Any) -> tuple[RouterWorker, ...] | None:
    """The workers of a ``GET /workers`` reply, or None when the reply is not a router's worker list."""
    if not isinstance(reply, dict) or not isinstance(reply.get("workers"), list):
        return None
    out = []
    for w in reply["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("url"), str):
            return None
        meta = w.get("metadata") if isinstance(w.get("metadata"), dict) else {}
        names = [w.get("model_id"), meta.get("served_model_name"), meta.get("model_path")]
        names = tuple(dict.fromkeys(str(n) for n in names if n))
        load = w.get("load")
        out.append(RouterWorker(w["url"], str(w.get("model_id") or ""), names, w.get("is_healthy") is True,
                                load if isinstance(load, int) else None))
    return tuple(out)


async def read_router_workers(engine: HttpEngine) -> tuple[RouterWorker, ...] | None:
    """The workers behind ``engine``'s URL when it is an sglang-router; None for any other server (no route,
    another shape, or an error: a router that cannot list its workers is judged by its other routes)."""
    try:
        reply = await engine._optional_json(("/workers",), [])
    except EngineError:
        return None
    return parse_router_workers(reply)


def router_has_no_worker(err: EngineError) -> bool:
    """The router answered that no worker could take the request (see the module docstring)."""
    return err.status in (500, 503) and any(code in str(err) for code in NO_WORKER_CODES)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(worker_urls: Sequence[str], *, port: int = 30000, host: str = "127.0.0.1",
                   policy: str = "round_robin", health_check_interval_s: int | None = None,
                   prometheus_port: int | None = None, extra_args: Sequence[str] = (),
                   python: str | None = None) -> list[str]:
    """argv of ``python -m sglang_router.launch_router`` in front of ``worker_urls`` on ``host:port``.

    ``round_robin`` spreads requests evenly (the router's default, ``cache_aware``, keeps prompts that share a
    prefix on one worker). The metrics server binds ``host`` too (the router's default is 0.0.0.0:29000).
    """
    if not worker_urls:
        raise ValueError("sglang-router needs at least one worker URL")
    argv = [python or sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *[u.rstrip("/") for u in worker_urls], "--policy", policy,
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port or port + 1)]
    if health_check_interval_s is not None:
        argv += ["--health-check-interval-secs", str(health_check_interval_s)]
    return argv + list(extra_args)


class RouterProcess:
    """sglang-router on this host in front of ``worker_urls``; ``start()`` returns once every worker is listed
    healthy. ``port=0`` picks free ports. Use as a context manager (stops the router on exit)."""

    def __init__(self, worker_urls: Sequence[str], *, port: int = 0, host: str = "127.0.0.1",
                 policy: str = "round_robin", health_check_interval_s: int | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None):
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host = host
        self.port = port or _free_port(host)
        self.argv = router_command(self.worker_urls, port=self.port, host=host, policy=policy,
                                   health_check_interval_s=health_check_interval_s,
                                   prometheus_port=_free_port(host), extra_args=["--log-level", "warn", *extra_args])
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def start(self, wait_s: float = 60.0) -> "RouterProcess":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            if self.log_path:
                log.close()
        try:
            self._wait_ready(wait_s)
        except BaseException:
            self.stop()
            raise
        return self

    def workers(self, timeout_s: float = 5.0) -> tuple[RouterWorker, ...] | None:
        """The router's worker list now (None while it does not answer)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        try:
            with opener.open(self.url + "/workers", timeout=timeout_s) as resp:
                return parse_router_workers(json.loads(resp.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _wait_ready(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        listed: tuple[RouterWorker, ...] | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}: {self.command}"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            listed = self.workers()
            if listed is not None and {w.url for w in listed if w.healthy} >= set(self.worker_urls):
                return
            time.sleep(0.2)
        raise TimeoutError(f"sglang-router at {self.url} not ready after {wait_s:.0f} s (workers: {listed}): "
                           f"{self.command}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # the router drains requests in flight for up to its grace period
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)

    def __enter__(self) -> "RouterProcess":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
