"""The embedded engine on demand: ``transformers serve`` on the tiny target, for as long as one caller needs it.

The embedded default (local profile, tiny target, no ``DFLASH_ENGINE_URLS``)
has no engine running anywhere. ``EmbeddedEngine`` starts one the first time
``endpoint()`` is called, on a free 127.0.0.1 port, waits until it answers and
serves the tiny target, and stops it in ``stop()`` (or on leaving a ``with``
block). Each caller owns its own server: two runs that generate at the same
time each start one on their own port, so there is no shared state, no
reference count and no port to agree on, and a crashed run cannot take
another run's engine down with it. The price is the start-up (~12 s on a
2-core machine) once per step that generates.

The server is a child of this process in its process group, so a Ctrl-C
delivered to the group (``make ui``) reaches it as well.

Reads: the tiny target directory (built on first use). Writes: the server's
output to a temporary log file, removed when the server stops; kept and
named in the error when it fails to start.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from dflash_assets.embedded.defaults import embedded_default_target, embedded_engine_server
from dflash_assets.generation.server import EngineServer

__all__ = ["EmbeddedEngine", "EMBEDDED_ENGINE_CONCURRENCY", "is_embedded_target"]

# Requests in flight to the embedded engine: transformers serve on 2 cores gains nothing from more.
EMBEDDED_ENGINE_CONCURRENCY = 4
_LOG_TAIL_CHARS = 3000


def is_embedded_target(target_model: str | os.PathLike) -> bool:
    """Whether ``target_model`` is the tiny target the embedded engine serves."""
    return Path(target_model).resolve() == embedded_default_target().resolve()


class EmbeddedEngine:
    """``transformers serve`` on the tiny target, started on first use and stopped by ``stop()``.

    ``endpoint()`` returns the fleet's ``EndpointConfig`` for it (kind
    ``openai``). A server that exits while starting (e.g. another process
    took the port picked for it) is retried on a new port, ``attempts``
    times in all. Thread-safe; ``stop()`` is idempotent.
    """

    def __init__(self, *, start_timeout_s: float = 300.0, attempts: int = 3,
                 max_concurrency: int = EMBEDDED_ENGINE_CONCURRENCY, log: Callable[[str], None] | None = None):
        self.start_timeout_s = start_timeout_s
        self.attempts = attempts
        self.max_concurrency = max_concurrency
        self.log = log or (lambda message: None)
        self.server: EngineServer | None = None
        self.startup_s: float | None = None
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        return str(embedded_default_target())

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.proc is not None and self.server.proc.poll() is None

    def endpoint(self):
        """The running server's ``EndpointConfig``; starts the server first if needed."""
        with self._lock:
            if not self.running:
                self._start()
            assert self.server is not None
            return self.server.endpoint_config(self.max_concurrency)

    def _start(self) -> None:
        self._discard()
        errors: list[str] = []
        for attempt in range(1, self.attempts + 1):
            fd, log_path = tempfile.mkstemp(prefix="dflash-embedded-engine-", suffix=".log")
            os.close(fd)
            server = embedded_engine_server("transformers", port=0, log_path=log_path)
            self.log(f"starting the embedded engine (attempt {attempt}/{self.attempts}): {server.command}")
            t0 = time.monotonic()
            try:
                server.start(wait_s=self.start_timeout_s)
            except (RuntimeError, TimeoutError) as e:  # exited early (port taken, crash) or never became ready
                errors.append(f"{e}\n--- last lines of {log_path} ---\n{_tail(log_path)}")
                continue
            self.server, self.startup_s = server, time.monotonic() - t0
            self.log(f"embedded engine ready at {server.url} in {self.startup_s:.1f} s (pid {server.proc.pid})")
            return
        raise RuntimeError(f"the embedded engine did not start after {self.attempts} attempts:\n\n"
                           + "\n\n".join(errors))

    def stop(self) -> None:
        with self._lock:
            if self.server is not None and self.server.proc is not None:
                pid = self.server.proc.pid
                self.server.stop()
                self.log(f"embedded engine stopped (pid {pid}, exit code {self.server.proc.returncode})")
            self._discard()

    def _discard(self) -> None:
        if self.server is not None and self.server.log_path is not None:
            self.server.log_path.unlink(missing_ok=True)
        self.server = None

    def __enter__(self) -> "EmbeddedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError as e:
        return f"(unreadable: {e})"
