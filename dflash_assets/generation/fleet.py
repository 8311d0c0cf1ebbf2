"""The engine fleet: probe every configured endpoint, then spread work over the healthy ones.

``EngineFleetConfig`` (pydantic, ``generation.fleet_config``) lists endpoints (url, kind
sglang|openai|transformers, max_concurrency), the target model they must
serve, timeouts and retries. ``probe_fleet`` asks each endpoint for health and
identity and returns a ``FleetProbe`` table (endpoint, kind, served model,
healthy, latency, status, context length, whether a seed holds there; also as
markdown and Arrow). A missing identity route is skipped, not "unreachable"; a
503 from ``/health`` (a starting or busy SGLang) is waited on for
``health_wait_s``. An endpoint that serves
another model than the target is refused: ids are compared after
normalization (``normalize_model_id``: basename, lower case, no revision),
against the target and the optional ``served_model_name`` alias. With no
usable endpoint, ``NoEngineAvailable`` is raised at once, its message holding
the probe table (``generation.fleet_probe``). Nothing falls back to another engine silently.

An sglang-router is one endpoint (its URL, kind ``sglang``); the probe also
reads its ``GET /workers`` (``generation.router``) and lists each worker
under the table. The router spreads requests over all its workers, so one
worker serving another model refuses the router endpoint (``wrong_model``),
and a router without a healthy worker is ``unhealthy``. Its answer that no
worker took a request (500 ``call_upstream_request_error``, 503
``no_available_workers``) counts as a connection failure of the endpoint.

``EngineFleet.run(tasks)`` drives tasks (one conversation each; a task makes
one request per ``step``) over all usable endpoints: a shared asyncio work
queue, ``max_concurrency`` workers per endpoint (a semaphore by another name),
each keeping a task on its endpoint until the task is done (prefix-cache
locality for multi-turn chats). Retries with exponential backoff and jitter
on 408/429/5xx, aborts and connection errors (``attempts_left`` per request,
as in the OpenAI cookbook's parallel processor). An endpoint with N
consecutive connection failures is marked dead: its in-flight requests are
cancelled and their tasks go back to the queue without being charged, so
other endpoints finish them; each task is resolved exactly once (done or
failed). If every endpoint dies, the run stops with ``NoEngineAvailable``
listing what is left. Failures stay on the task; the caller decides.
The run is one ``_Dispatch`` object; ``EndpointState`` is each endpoint's
state during it (in flight, consecutive failures, excluded, stats).

Broken or hostile engines (see ``generation.engines.Engine``): a reply of the
wrong shape is retried, a redirect fails the request, ``read_timeout_s`` cuts
off a hung server (then it is excluded like a dead one), bodies are capped at
``max_response_bytes``, a reply naming another model is refused. Each endpoint
may carry a bearer token (``api_key``, ``api_key_env``, ``api_key_file``, else
the fleet's ``api_key``); tokens are ``SecretStr``, never in reprs or tables.

Reads: HTTP endpoints. Writes nothing.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence, TypeVar

from dflash_assets.generation.engines import (
    ChatResult,
    Engine,
    EngineError,
    EngineProbe,
    OpenAIEngine,
    SGLangEngine,
    TransformersEngine,
    decoding_over_run,
    normalize_model_id,
)
from dflash_assets.generation.fleet_config import (
    SLOTS_IN_FLIGHT,
    EndpointConfig,
    EngineFleetConfig,
    endpoint_api_key,
)
from dflash_assets.generation.fleet_probe import (
    EndpointStatus,
    FleetProbe,
    NoEngineAvailable,
    RouterWorkerStatus,
    router_verdict,
    serves_target,
)
from dflash_assets.generation.router import RouterWorker, read_router_workers, router_has_no_worker

__all__ = [
    "SLOTS_IN_FLIGHT",
    "EndpointConfig",
    "EngineFleetConfig",
    "EndpointStatus",
    "RouterWorkerStatus",
    "FleetProbe",
    "NoEngineAvailable",
    "FleetTask",
    "EndpointRunStats",
    "EndpointState",
    "FleetRunStats",
    "EngineFleet",
    "build_engine",
    "endpoint_api_key",
    "probe_fleet",
    "aprobe_fleet",
    "serves_target",
    "run_sync",
]

T = TypeVar("T")


# ----------------------------------------------------------------------------
# Engines and the probe (the table itself is generation.fleet_probe)


def build_engine(ep: EndpointConfig, config: EngineFleetConfig, tokenizer: Any = None) -> Engine:
    common = dict(max_concurrency=ep.max_concurrency, connect_timeout_s=config.connect_timeout_s,
                  request_timeout_s=config.request_timeout_s, probe_timeout_s=config.probe_timeout_s, name=ep.name,
                  read_timeout_s=config.read_timeout_s, read_timeout_per_token_s=config.read_timeout_per_token_s,
                  max_response_bytes=config.max_response_bytes, health_wait_s=config.health_wait_s,
                  health_timeout_s=config.health_timeout_s, context_length=ep.context_length,
                  context_min_new_tokens=config.context_min_new_tokens,
                  deterministic_inference=ep.deterministic_inference)
    if ep.kind == "sglang":
        return SGLangEngine(ep.url, tokenizer, api_key=endpoint_api_key(ep, config), **common)
    if ep.kind == "openai":
        return OpenAIEngine(ep.url, api_key=endpoint_api_key(ep, config), extra_sampling_params=ep.extra_sampling_params,
                            reasoning_parser=ep.reasoning_parser, tokenizer=tokenizer, **common)
    if ep.kind == "transformers":
        return TransformersEngine(ep.model_path or config.target_model, device=ep.device, tokenizer=tokenizer,
                                  dtype=ep.dtype, max_batch_tokens=ep.max_batch_tokens, cache=ep.cache,
                                  max_batch_rows=ep.max_batch_rows, attention=ep.attention,
                                  static_cache_len=ep.static_cache_len, slot_len=ep.slot_len,
                                  slot_tiers=ep.slot_tiers, **common)
    raise ValueError(f"unknown endpoint kind {ep.kind!r}")


def _status_row(ep: EndpointConfig, engine: Engine, probe: EngineProbe, config: EngineFleetConfig) -> EndpointStatus:
    latency = probe.latency_s * 1000 if probe.latency_s is not None else None
    served = ", ".join(probe.served_models)
    facts = probe.facts
    server_said = dict(context_length=engine.context_length, seed_honoured=engine.seed_honoured,
                       reasoning_parser=facts.reasoning_parser if facts else None)
    if not probe.served_models and probe.error:
        return EndpointStatus(engine.url, ep.kind, "", False, latency, False, "unreachable", probe.error)
    match = serves_target(probe.served_models, config.target_model, ep.served_model_name or config.served_model_name)
    if match is None:
        return EndpointStatus(engine.url, ep.kind, served, probe.healthy, latency, False, "wrong_model",
                              f"serves {served or 'nothing'}, target is {config.target_model}")
    engine.served_model = match  # the name to send as `model`
    # what a reply may name: the matched name, the target, the alias (normalized)
    engine.accepted_models = {normalize_model_id(n) for n in (match, config.target_model,
                                                              ep.served_model_name or config.served_model_name) if n}
    if not probe.healthy:
        return EndpointStatus(engine.url, ep.kind, match, False, latency, True, "unhealthy", probe.error or "",
                              **server_said)
    return EndpointStatus(engine.url, ep.kind, match, True, latency, True, "ok", **server_said)


def _router_rows(ep: EndpointConfig, row: EndpointStatus, workers: tuple[RouterWorker, ...],
                 config: EngineFleetConfig) -> tuple[EndpointStatus, list[RouterWorkerStatus]]:
    """A router endpoint's row judged by its workers (``router_verdict``), and one row per worker, by URL (the
    router lists them in no fixed order; the probe's table stays the same from one probe to the next)."""
    alias = ep.served_model_name or config.served_model_name
    rows = [RouterWorkerStatus(row.endpoint, w.url, w.model_id, w.healthy, w.load,
                               serves_target(w.names, config.target_model, alias) is not None)
            for w in sorted(workers, key=lambda w: w.url)]
    return router_verdict(row, rows, config.target_model), rows


async def _probe_engines(config: EngineFleetConfig, engines: list[Engine]) -> FleetProbe:
    async def one(engine: Engine) -> tuple[EngineProbe, tuple[RouterWorker, ...] | None]:
        try:
            await engine.open()
            probe = await engine.probe()
        except Exception as e:  # noqa: BLE001 - goes into the table
            return EngineProbe(engine.url, engine.kind, False, error=f"{type(e).__name__}: {e}"), None
        # A server that answered (identity, or a 5xx as a router without live workers gives) may be a router:
        # its worker list decides whether every request it forwards reaches the target.
        answered = bool(probe.served_models) or "HTTP 5" in (probe.error or "")
        workers = await read_router_workers(engine) if engine.kind != "transformers" and answered else None
        return probe, workers

    found = await asyncio.gather(*(one(e) for e in engines))
    rows, worker_rows = [], []
    for ep, eng, (probe, workers) in zip(config.endpoints, engines, found):
        row = _status_row(ep, eng, probe, config)
        if workers is not None:
            row, behind = _router_rows(ep, row, workers, config)
            worker_rows += behind
        rows.append(row)
    return FleetProbe(config.target_model, tuple(rows), tuple(worker_rows))


async def aprobe_fleet(config: EngineFleetConfig, tokenizer: Any = None) -> FleetProbe:
    engines = [build_engine(ep, config, tokenizer) for ep in config.endpoints]
    try:
        return await _probe_engines(config, engines)
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)


def probe_fleet(config: EngineFleetConfig, tokenizer: Any = None) -> FleetProbe:
    """Probe every endpoint (health, served model, latency); never raises for a bad endpoint."""
    return run_sync(aprobe_fleet(config, tokenizer))


def _new_loop_run(coro: Awaitable[T]) -> T:
    try:  # uvloop roughly halves the client's per-request overhead
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion from sync code, also when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _new_loop_run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _new_loop_run(coro)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, name="dflash-run-sync")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# ----------------------------------------------------------------------------
# Dispatch


class FleetTask(Protocol):
    """A unit of work: one conversation. ``step`` makes one request on ``engine``.

    ``step`` returns (finished, result). It must keep its own progress: after
    a failed step the task is retried, maybe on another endpoint, from where it was.
    """

    key: str

    async def step(self, engine: Engine) -> tuple[bool, ChatResult]: ...


@dataclass
class EndpointRunStats:
    endpoint: str
    kind: str
    served_model: str
    requests: int = 0
    ok: int = 0
    errors: int = 0
    connection_failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0
    dead: bool = False
    dead_reason: str = ""
    tokens_per_s: float = 0.0  # completion tokens / run wall time
    decoding: dict[str, float] = field(default_factory=dict)  # its engine's own decoder (decoding_over_run)


@dataclass
class FleetRunStats:
    tasks: int = 0
    done: int = 0
    failed: int = 0
    unfinished: int = 0
    requests: int = 0
    retries: int = 0
    failovers: int = 0
    wall_s: float = 0.0
    endpoints: dict[str, EndpointRunStats] = field(default_factory=dict)


@dataclass(eq=False)
class _Job:
    """One task in a run: its retry budget, its errors, whether it is resolved, its backoff timer."""

    task: FleetTask
    attempts_left: int
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    resolved: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class EndpointState:
    """One endpoint during a run: requests in flight, consecutive connection failures, excluded or not, stats."""

    engine: Engine
    stats: EndpointRunStats
    consecutive_failures: int = 0
    inflight: set[asyncio.Task] = field(default_factory=set)

    @property
    def dead(self) -> bool:
        """Excluded from the run (too many consecutive connection failures)."""
        return self.stats.dead

    def exclude(self, reason: str) -> None:
        """Mark dead and cancel its requests in flight: hung requests move on now, not at their timeout."""
        self.stats.dead, self.stats.dead_reason = True, reason
        for t in list(self.inflight):
            t.cancel()


class _Dispatch:
    """One ``EngineFleet.run``: a shared queue of jobs, ``max_concurrency`` workers per endpoint (at most one per job).

    A worker takes a job and drives it on its endpoint until the task is done
    (``_drive``); each request's outcome is one of: a step done, an
    ``EngineError`` (``_on_error``: failover, retry with backoff, or fail), a
    bug in the task (fail), or a cancel because the endpoint was excluded
    (requeue, not charged). Every job is resolved once (``_finish`` / ``_fail``);
    the run ends when none is pending, or aborts when every endpoint is dead.
    """

    def __init__(self, config: EngineFleetConfig, endpoints: list[EndpointState], tasks: Iterable[FleetTask],
                 on_done: Callable[[FleetTask], None] | None,
                 on_failed: Callable[[FleetTask, str, list[str]], None] | None, probe: FleetProbe | None = None):
        self.config = config
        self.probe = probe
        self.endpoints = endpoints
        self.on_done, self.on_failed = on_done, on_failed
        self.max_attempts = config.max_retries + 1
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[_Job | None] = asyncio.Queue()
        self.pending: set[_Job] = set()
        self.stats = FleetRunStats(endpoints={ep.engine.url: ep.stats for ep in endpoints})
        self.aborted = False
        self.all_stopped = asyncio.Event()
        for task in tasks:
            job = _Job(task, self.max_attempts)
            self.pending.add(job)
            self.queue.put_nowait(job)
        self.stats.tasks = len(self.pending)
        # no more workers on an endpoint than jobs (a slot engine's default in flight is a whole shard)
        self.workers = {id(ep): min(ep.engine.max_concurrency, max(1, len(self.pending))) for ep in endpoints}
        self.workers_total = sum(self.workers.values())

    # -- the run -----------------------------------------------------------------

    async def run(self) -> FleetRunStats:
        """Every job to done or failed; ``NoEngineAvailable`` if every endpoint dies first."""
        t_start, before = time.perf_counter(), {id(ep): ep.engine.decoder_totals() for ep in self.endpoints}
        if not self.pending:
            return self.stats
        workers = [asyncio.ensure_future(self._worker(ep)) for ep in self.endpoints
                   for _ in range(self.workers[id(ep)])]
        try:
            await self.all_stopped.wait()
            if self.aborted:
                for w in workers:
                    w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            for w in workers:
                w.cancel()
        self.stats.wall_s = time.perf_counter() - t_start
        for ep in self.endpoints:
            ep.stats.tokens_per_s = ep.stats.completion_tokens / self.stats.wall_s if self.stats.wall_s > 0 else 0.0
            ep.stats.decoding = decoding_over_run(before[id(ep)], ep.engine.decoder_totals())
        if self.aborted:
            self.stats.unfinished = len(self.pending)
            raise self._all_dead_error()
        return self.stats

    async def _worker(self, ep: EndpointState) -> None:
        while True:
            job = await self.queue.get()
            if job is None:
                return
            if job.resolved or self.aborted:
                continue
            if ep.dead:
                self.queue.put_nowait(job)
                return
            await self._drive(ep, job)

    async def _drive(self, ep: EndpointState, job: _Job) -> None:
        """Step ``job`` on ``ep`` until the task is done or a request fails (keeps a chat on one endpoint)."""
        while True:
            if ep.dead:
                self._failover(job)
                return
            t0 = time.perf_counter()
            ep.stats.requests += 1
            self.stats.requests += 1
            job.requests += 1
            me = asyncio.current_task()
            ep.inflight.add(me)  # EndpointState.exclude cancels the worker mid-request (hung endpoints)
            try:
                finished, result = await job.task.step(ep.engine)
            except asyncio.CancelledError:
                if not ep.dead or self.aborted:  # the run is being torn down
                    raise
                if me is not None:
                    me.uncancel()
                ep.stats.busy_s += time.perf_counter() - t0
                self._failover(job)
                return
            except EngineError as e:
                ep.stats.busy_s += time.perf_counter() - t0
                self._on_error(ep, job, e)
                return
            except Exception as e:  # noqa: BLE001 - a bug in the task: fail it, keep the run going
                job.errors.append(f"{type(e).__name__}: {e}")
                self._fail(job, f"task error: {type(e).__name__}: {e}")
                return
            finally:
                ep.inflight.discard(me)
            ep.stats.busy_s += time.perf_counter() - t0
            ep.stats.ok += 1
            ep.stats.prompt_tokens += result.prompt_tokens
            ep.stats.completion_tokens += result.completion_tokens
            ep.consecutive_failures = 0
            job.attempts_left = self.max_attempts  # retries are counted per request
            if finished:
                self._finish(job)
                return

    # -- outcomes ----------------------------------------------------------------

    def _on_error(self, ep: EndpointState, job: _Job, err: EngineError) -> None:
        """A failed request: exclude the endpoint after N connection failures (a router's "no worker took it"
        counts as one), then failover, retry or fail."""
        ep.stats.errors += 1
        job.errors.append(str(err)[:500])
        if self.aborted:
            return
        if err.connection or router_has_no_worker(err):
            ep.consecutive_failures += 1
            ep.stats.connection_failures += 1
            if ep.consecutive_failures >= self.config.dead_after_failures:
                self._exclude(ep, str(err)[:300])
            if ep.dead:  # the endpoint's fault, not the task's
                self._failover(job)
                return
        if not err.retryable:
            self._fail(job, str(err)[:500])
            return
        job.attempts_left -= 1
        if job.attempts_left <= 0:
            self._fail(job, f"gave up after {self.max_attempts} attempts: {str(err)[:400]}")
            return
        self.stats.retries += 1
        n = self.max_attempts - job.attempts_left
        cfg = self.config
        delay = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (n - 1)) * random.uniform(0.5, 1.0)
        self._requeue(job, delay)

    def _failover(self, job: _Job) -> None:
        """Back to the queue at once, not charged: another endpoint takes it."""
        self.stats.failovers += 1
        if not self.aborted:
            self._requeue(job, 0)

    def _finish(self, job: _Job) -> None:
        self._resolve(job)
        self.stats.done += 1
        if self.on_done is not None:
            self.on_done(job.task)

    def _fail(self, job: _Job, reason: str) -> None:
        self._resolve(job)
        self.stats.failed += 1
        if self.on_failed is not None:
            self.on_failed(job.task, reason, list(job.errors))

    def _resolve(self, job: _Job) -> None:
        job.resolved = True
        self.pending.discard(job)
        if not self.pending:
            self._stop_all()

    def _requeue(self, job: _Job, delay: float) -> None:
        if delay <= 0:
            self._enqueue(job)
        else:
            job.timer = self.loop.call_later(delay, self._enqueue, job)

    def _enqueue(self, job: _Job) -> None:
        job.timer = None
        if not job.resolved and not self.aborted:
            self.queue.put_nowait(job)

    def _exclude(self, ep: EndpointState, reason: str) -> None:
        if ep.dead:
            return
        ep.exclude(reason)
        if all(e.dead for e in self.endpoints):  # nothing left to run on: abort
            self.aborted = True
            for job in self.pending:
                if job.timer is not None:
                    job.timer.cancel()
            self._stop_all()

    def _stop_all(self) -> None:
        for _ in range(self.workers_total):
            self.queue.put_nowait(None)
        self.all_stopped.set()

    def _all_dead_error(self) -> NoEngineAvailable:
        s = self.stats
        deaths = "; ".join(f"{ep.engine.url}: {ep.stats.dead_reason}" for ep in self.endpoints)
        return NoEngineAvailable(
            f"every endpoint died mid-run; {len(self.pending)} of {s.tasks} tasks unfinished "
            f"({s.done} done, {s.failed} failed). Deaths: {deaths}", self.probe)


class EngineFleet:
    """Probed engines and the dispatcher over them. ``async with EngineFleet(cfg, tokenizer) as fleet``.

    Entering probes every endpoint (``fleet.probe``) and raises
    ``NoEngineAvailable`` when none is usable; entering again reuses that probe.
    """

    def __init__(self, config: EngineFleetConfig, tokenizer: Any = None, *, engines: Sequence[Engine] | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self._engines = list(engines) if engines is not None else None
        self.probe: FleetProbe | None = None
        self._endpoints: list[EndpointState] = []

    async def __aenter__(self) -> "EngineFleet":
        if self._endpoints:  # entered already (probed once; a second ``async with`` does not probe again)
            return self
        if not self.config.endpoints:
            raise NoEngineAvailable("no generation endpoint configured", FleetProbe(self.config.target_model, ()))
        if self._engines is None:
            self._engines = [build_engine(ep, self.config, self.tokenizer) for ep in self.config.endpoints]
        self.probe = await _probe_engines(self.config, self._engines)
        self._endpoints = [
            EndpointState(eng, EndpointRunStats(eng.url, eng.kind, row.served_model))
            for eng, row in zip(self._engines, self.probe.rows) if row.usable
        ]
        if not self._endpoints:
            await self.close()
            raise NoEngineAvailable(f"no endpoint serves the target {self.config.target_model!r}", self.probe)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._engines:
            await asyncio.gather(*(e.close() for e in self._engines), return_exceptions=True)

    @property
    def seed_honoured(self) -> bool:
        """A seed holds on every usable endpoint (False before the probe)."""
        return self.probe is not None and self.probe.seed_honoured

    @property
    def live_endpoints(self) -> list[Engine]:
        return [ep.engine for ep in self._endpoints if not ep.dead]

    async def run(self, tasks: Iterable[FleetTask], *,
                  on_done: Callable[[FleetTask], None] | None = None,
                  on_failed: Callable[[FleetTask, str, list[str]], None] | None = None) -> FleetRunStats:
        """Run every task to done or failed over the live endpoints.

        ``on_done(task)`` / ``on_failed(task, reason, errors)`` are called
        exactly once per task, on the event loop. Raises ``NoEngineAvailable``
        if every endpoint dies with tasks left (those get neither callback).
        """
        return await _Dispatch(self.config, self._endpoints, tasks, on_done, on_failed, self.probe).run()
