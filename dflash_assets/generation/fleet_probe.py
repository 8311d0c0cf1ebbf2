"""The fleet's probe table: one row per endpoint, and one per worker behind an sglang-router.

``EndpointStatus`` is what the probe found at one endpoint (served model,
health, latency, status ok|wrong_model|unhealthy|unreachable, context length,
whether a seed holds); ``RouterWorkerStatus`` is one worker in a router's
``GET /workers`` list. ``FleetProbe`` holds both for logs and asset metadata
(markdown, Arrow). ``router_verdict`` decides a router endpoint's row from its
workers: a router spreads requests over every worker it has, so one worker
that serves another model refuses the whole endpoint, and a router without a
healthy worker is ``unhealthy``. ``serves_target`` compares model ids after
normalization. ``NoEngineAvailable`` carries the table in its message.

Reads and writes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from dflash_assets.generation.config import normalize_model_id

__all__ = ["EndpointStatus", "RouterWorkerStatus", "FleetProbe", "NoEngineAvailable", "serves_target",
           "router_verdict"]


@dataclass(frozen=True)
class EndpointStatus:
    """One row of the probe table."""

    endpoint: str
    kind: str
    served_model: str
    healthy: bool
    latency_ms: float | None
    serves_target: bool
    status: str  # ok | wrong_model | unhealthy | unreachable
    detail: str = ""
    context_length: int | None = None  # tokens of prompt + output the endpoint takes (None: not known)
    seed_honoured: bool = False  # a request's seed makes its output reproducible here
    reasoning_parser: str | None = None  # the server's reasoning parser ("": none; None: it did not say)

    @property
    def usable(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class RouterWorkerStatus:
    """One worker behind a router endpoint, as the router's ``GET /workers`` lists it."""

    router: str
    worker: str
    served_model: str  # the router's model_id for the worker
    healthy: bool  # the router's is_healthy (its health checks run every --health-check-interval-secs)
    load: int | None
    serves_target: bool

    @property
    def status(self) -> str:
        return "wrong_model" if not self.serves_target else "ok" if self.healthy else "unhealthy"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


@dataclass(frozen=True)
class FleetProbe:
    """The probe of every endpoint of a fleet (and of the workers behind its routers), for logs and metadata."""

    target_model: str
    rows: tuple[EndpointStatus, ...]
    workers: tuple[RouterWorkerStatus, ...] = ()

    @property
    def usable(self) -> tuple[EndpointStatus, ...]:
        return tuple(r for r in self.rows if r.usable)

    def records(self) -> list[dict]:
        return [{"endpoint": r.endpoint, "kind": r.kind, "served_model": r.served_model, "healthy": r.healthy,
                 "latency_ms": r.latency_ms, "serves_target": r.serves_target, "status": r.status,
                 "detail": r.detail, "context_length": r.context_length, "seed_honoured": r.seed_honoured,
                 "reasoning_parser": r.reasoning_parser} for r in self.rows]

    def worker_records(self) -> list[dict]:
        return [{**dataclasses.asdict(w), "status": w.status} for w in self.workers]

    @property
    def seed_honoured(self) -> bool:
        """A seed holds on every usable endpoint (a task may run on any of them)."""
        return bool(self.usable) and all(r.seed_honoured for r in self.usable)

    def to_arrow(self):
        import pyarrow as pa

        return pa.Table.from_pylist(self.records(), schema=pa.schema([
            ("endpoint", pa.string()), ("kind", pa.string()), ("served_model", pa.string()), ("healthy", pa.bool_()),
            ("latency_ms", pa.float64()), ("serves_target", pa.bool_()), ("status", pa.string()),
            ("detail", pa.string()), ("context_length", pa.int64()), ("seed_honoured", pa.bool_()),
            ("reasoning_parser", pa.string())]))

    def markdown(self) -> str:
        lines = [f"target: `{self.target_model}`", "",
                 "| endpoint | kind | served model | healthy | latency | status | context | seed holds |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in self.rows:
            lat = f"{r.latency_ms:.1f} ms" if r.latency_ms is not None else "-"
            status = _cell(r.status + (f": {r.detail}" if r.detail else ""))
            lines.append(f"| {r.endpoint} | {r.kind} | {r.served_model or '-'} | {'yes' if r.healthy else 'no'} "
                         f"| {lat} | {status} | {r.context_length or '-'} | {'yes' if r.seed_honoured else 'no'} |")
        if not self.rows:
            lines.append("| (no endpoints configured) | | | | | | | |")
        if self.workers:
            lines += ["", "workers behind routers (the router's `GET /workers`):", "",
                      "| router | worker | served model | healthy | load | status |", "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {w.router} | {w.worker} | {_cell(w.served_model) or '-'} | {'yes' if w.healthy else 'no'} "
                      f"| {'-' if w.load is None else w.load} | {w.status} |" for w in self.workers]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.markdown()


class NoEngineAvailable(RuntimeError):
    """No endpoint serves the target (or every endpoint died mid-run)."""

    def __init__(self, message: str, probe: FleetProbe | None = None):
        self.probe = probe
        super().__init__(message + (f"\n\n{probe.markdown()}" if probe is not None else ""))


def serves_target(served_models: Sequence[str], target_model: str, alias: str | None = None) -> str | None:
    """The served name that is the target (exact or normalized match to target or alias), else None."""
    wanted = {target_model.rstrip("/"), *([alias] if alias else [])}
    for name in served_models:
        if name.rstrip("/") in wanted:
            return name
    norm = {normalize_model_id(w) for w in wanted}
    for name in served_models:
        if normalize_model_id(name) in norm:
            return name
    return None


def router_verdict(row: EndpointStatus, workers: Sequence[RouterWorkerStatus], target_model: str) -> EndpointStatus:
    """A router endpoint's row, given what the endpoint itself answered (``row``) and its workers.

    Any worker serving another model refuses the router (``wrong_model``, healthy or not: it may come back, and
    the router picks among all its workers whatever the request); else with no healthy worker an ``ok`` row
    becomes ``unhealthy``; else the row stands, its detail counting the healthy workers.
    """
    wrong = [w for w in workers if not w.serves_target]
    if wrong:
        named = "; ".join(f"worker {w.worker} serves {w.served_model or 'nothing'}" for w in wrong)
        return dataclasses.replace(row, status="wrong_model", serves_target=False, detail=(
            f"{named}, target is {target_model}; the router spreads requests over all {len(workers)} of its workers"))
    healthy = sum(w.healthy for w in workers)
    count = f"router: {healthy} of {len(workers)} workers healthy"
    if row.status == "ok" and not healthy:
        return dataclasses.replace(row, status="unhealthy", healthy=False, detail=count)
    return dataclasses.replace(row, detail=f"{count}; {row.detail}" if row.detail else count)
