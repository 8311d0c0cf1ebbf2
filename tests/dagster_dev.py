"""A real ``dagster dev`` for tests and benchmarks: webserver + daemon on 127.0.0.1, a tiny GraphQL client.

``dagster_dev(home, env=...)`` starts ``dagster dev -w workspace.yaml -h
127.0.0.1 -p <free port>`` from the repository root in its own process group,
with ``DAGSTER_HOME=home`` holding a ``dagster.yaml`` (``instance_yaml()``:
SQLite, telemetry off, a 1 s run queue, the ``gpu`` pool at 1, generous code
server start-up), waits until GraphQL answers, the code location is loaded and
the daemons (backfill, sensor, run queue) report healthy, and yields a
``DagsterDev`` client. On exit it always stops the whole process group:
SIGINT to ``dagster dev`` (its own graceful shutdown), then SIGTERM and
SIGKILL to the group. Its output goes to ``home/dagster-dev.log``; a start-up
failure raises with the log's tail.

``wait_until_ready(dev, ...)`` does the same wait for a ``DagsterDev`` built
around a process started otherwise (``make ui``). ``process_tree`` and
``still_running`` follow a process and its descendants through ``/proc``
(Linux), for tests of how they stop.

``DagsterDev`` offers what the UI does over GraphQL: ``launch_run`` (the
launchpad), ``launch_partition_backfill`` (the "Materialize all partitions"
dialog: ``launchPartitionBackfill`` with an asset selection), ``backfill``
and ``wait_for_backfill``, ``start_sensor``, plus ``instance()`` for reading
the same instance directly.

Test data for these end-to-end tests: ``write_prompt_source`` (a JSONL of
distinct one-turn prompts) and ``write_completions`` (a completions partition
built from a ``raw_prompts`` partition: answers with reasoning, or stubs
with an empty think block and ``OK.``, the failure blocking checks exist for).

Reads: the repository's ``workspace.yaml``. Writes: ``home/`` (instance,
``dagster.yaml``, the log); the data helpers write where they are told.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCATION_NAME = "dflash_assets"  # workspace.yaml
REPOSITORY_NAME = "__repository__"  # the implicit repository of a Definitions object
ASSET_JOB = "__ASSET_JOB"  # the implicit job the UI's "Materialize" buttons launch
FINISHED_BACKFILL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
FINISHED_RUN = {"SUCCESS", "FAILURE", "CANCELED"}

__all__ = [
    "DagsterDev", "DagsterDevError", "CodeLocationError", "dagster_dev", "instance_yaml",
    "POSTGRES_STORAGE_YAML", "REPO_ROOT", "write_prompt_source", "write_completions", "wait_until_ready",
    "process_tree", "still_running",
]


class DagsterDevError(RuntimeError):
    """dagster dev did not start, or a GraphQL call failed."""


class CodeLocationError(DagsterDevError):
    """The code location failed to load (the definitions raised)."""


POSTGRES_STORAGE_YAML = """\
storage:
  postgres:
    postgres_db:
      hostname: {env: DAGSTER_PG_HOST}
      port: {env: DAGSTER_PG_PORT}
      username: {env: DAGSTER_PG_USER}
      password: {env: DAGSTER_PG_PASSWORD}
      db_name: {env: DAGSTER_PG_DB}
      scheme: postgresql+psycopg2
"""


def instance_yaml(*, max_concurrent_runs: int = 2, gpu_slots: int = 1, dequeue_interval_s: int = 1,
                  storage_yaml: str = "") -> str:
    """``dagster.yaml`` for a test instance: SQLite under DAGSTER_HOME (Dagster's default) unless
    ``storage_yaml`` says otherwise (``POSTGRES_STORAGE_YAML`` with the ``DAGSTER_PG_*`` variables).

    ``concurrency.pools.default_limit`` caps every pool that has no explicit
    limit: the ``gpu`` pool of the GPU stages runs ``gpu_slots`` steps at a
    time on this instance (``dagster instance concurrency set gpu N`` overrides it).
    """
    return storage_yaml + f"""\
telemetry:
  enabled: false
run_queue:
  dequeue_interval_seconds: {dequeue_interval_s}
concurrency:
  runs:
    max_concurrent_runs: {max_concurrent_runs}
  pools:
    default_limit: {gpu_slots}
    granularity: op
code_servers:
  local_startup_timeout: 300
"""


@dataclass
class DagsterDev:
    """A running ``dagster dev``: its URL, home and a small GraphQL client."""

    url: str
    home: Path
    log_path: Path
    proc: subprocess.Popen = field(repr=False)
    timeout_s: float = 60.0

    # --- GraphQL ------------------------------------------------------------------

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """POST one query; returns ``data``; raises on transport or GraphQL errors."""
        body = json.dumps({"query": query, "variables": dict(variables or {})}).encode()
        req = urllib.request.Request(self.url + "/graphql", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise DagsterDevError(f"GraphQL HTTP {e.code}: {e.read()[:2000]!r}") from e
        if payload.get("errors"):
            raise DagsterDevError(f"GraphQL errors: {json.dumps(payload['errors'])[:4000]}")
        return payload["data"]

    def repository_selector(self) -> dict[str, str]:
        return {"repositoryLocationName": LOCATION_NAME, "repositoryName": REPOSITORY_NAME}

    # --- what the UI launches ----------------------------------------------------

    def launch_run(self, asset_keys: Sequence[str], run_config: Mapping[str, Any] | None = None,
                   job_name: str = ASSET_JOB, tags: Mapping[str, str] | None = None) -> str:
        """Launch a run of ``asset_keys`` (the launchpad's "Materialize"); returns the run id."""
        data = self.graphql(
            """
            mutation($params: ExecutionParams!) {
              launchRun(executionParams: $params) {
                __typename
                ... on LaunchRunSuccess { run { runId } }
                ... on PythonError { message stack }
                ... on RunConfigValidationInvalid { errors { message } }
                ... on Error { message }
              }
            }""",
            {"params": {
                "selector": {**self.repository_selector(), "pipelineName": job_name,
                             "assetSelection": [{"path": k.split("/")} for k in asset_keys]},
                "runConfigData": dict(run_config or {}),
                "mode": "default",
                "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
            }},
        )["launchRun"]
        if data["__typename"] != "LaunchRunSuccess":
            raise DagsterDevError(f"launchRun: {json.dumps(data)[:4000]}")
        return data["run"]["runId"]

    def run_status(self, run_id: str) -> str:
        data = self.graphql(
            "query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }", {"id": run_id}
        )["runOrError"]
        return data.get("status", data["__typename"])

    def wait_for_run(self, run_id: str, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (status := self.run_status(run_id)) not in FINISHED_RUN:
            if time.monotonic() > deadline:
                raise DagsterDevError(f"run {run_id} still {status} after {timeout_s:.0f} s; log {self.log_path}")
            time.sleep(0.5)
        return status

    def launch_partition_backfill(self, asset_keys: Sequence[str], partition_names: Sequence[str] | None = None,
                                  *, title: str | None = None, tags: Mapping[str, str] | None = None) -> str:
        """``launchPartitionBackfill`` with an asset selection, as the UI's partition dialog sends it.

        ``partition_names=None`` backfills every partition (``allPartitions``).
        Returns the backfill id; the backfill daemon then launches its runs.
        """
        params: dict[str, Any] = {
            "assetSelection": [{"path": k.split("/")} for k in asset_keys],
            "fromFailure": False,
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        if partition_names is None:
            params["allPartitions"] = True
        else:
            params["partitionNames"] = list(partition_names)
        if title:
            params["title"] = title
        data = self.graphql(
            """
            mutation($params: LaunchBackfillParams!) {
              launchPartitionBackfill(backfillParams: $params) {
                __typename
                ... on LaunchBackfillSuccess { backfillId }
                ... on PythonError { message stack }
                ... on Error { message }
              }
            }""",
            {"params": params},
        )["launchPartitionBackfill"]
        if data["__typename"] != "LaunchBackfillSuccess":
            raise DagsterDevError(f"launchPartitionBackfill: {json.dumps(data)[:4000]}")
        return data["backfillId"]

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        """Status, partition count and error of a backfill."""
        data = self.graphql(
            """
            query($id: String!) {
              partitionBackfillOrError(backfillId: $id) {
                __typename
                ... on PartitionBackfill {
                  id status numPartitions
                  error { message }
                  assetBackfillData { assetBackfillStatuses { __typename
                    ... on AssetPartitionsStatusCounts { assetKey { path } numPartitionsTargeted
                        numPartitionsInProgress numPartitionsMaterialized numPartitionsFailed } } }
                }
                ... on Error { message }
              }
            }""",
            {"id": backfill_id},
        )["partitionBackfillOrError"]
        if data["__typename"] != "PartitionBackfill":
            raise DagsterDevError(f"partitionBackfillOrError: {json.dumps(data)[:2000]}")
        return data

    def wait_for_backfill(self, backfill_id: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> dict[str, Any]:
        """Poll until the backfill is finished (the daemon ticks every 30 s); returns its last state."""
        deadline = time.monotonic() + timeout_s
        while (state := self.backfill(backfill_id))["status"] not in FINISHED_BACKFILL:
            if time.monotonic() > deadline:
                raise DagsterDevError(f"backfill {backfill_id} still {state['status']} after {timeout_s:.0f} s: "
                                      f"{json.dumps(state)[:2000]}; log {self.log_path}")
            time.sleep(poll_s)
        return state

    def start_sensor(self, sensor_name: str) -> str:
        data = self.graphql(
            """
            mutation($selector: SensorSelector!) {
              startSensor(sensorSelector: $selector) {
                __typename
                ... on Sensor { sensorState { status } }
                ... on Error { message }
              }
            }""",
            {"selector": {**self.repository_selector(), "sensorName": sensor_name}},
        )["startSensor"]
        if data["__typename"] != "Sensor":
            raise DagsterDevError(f"startSensor: {json.dumps(data)[:2000]}")
        return data["sensorState"]["status"]

    # --- health ------------------------------------------------------------------------

    def location_status(self) -> tuple[str, str | None]:
        """(load status, error message or None) of the code location."""
        data = self.graphql(
            """
            { workspaceOrError { __typename ... on Workspace { locationEntries {
                name loadStatus
                locationOrLoadError { __typename ... on PythonError { message stack } }
            } } } }"""
        )["workspaceOrError"]
        for entry in data.get("locationEntries", []):
            if entry["name"] == LOCATION_NAME:
                err = entry["locationOrLoadError"] or {}
                msg = err.get("message", "") + "".join(err.get("stack") or []) if err.get("__typename") == "PythonError" else None
                return entry["loadStatus"], msg
        return "MISSING", None

    def unhealthy_daemons(self, required: Sequence[str]) -> list[str]:
        data = self.graphql("{ instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }")
        statuses = {d["daemonType"]: d["healthy"] for d in data["instance"]["daemonHealth"]["allDaemonStatuses"]}
        return [name for name in required if not statuses.get(name)]

    def instance(self):
        """A ``DagsterInstance`` on the same home (SQLite: fine for reads alongside the server)."""
        from dagster import DagsterInstance
        from dagster._core.instance.ref import InstanceRef

        return DagsterInstance.from_ref(InstanceRef.from_dir(str(self.home)))

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# Exec the command with SIGINT and SIGTERM at their defaults and unblocked: a non-interactive shell's background job
# (`.ci/run &`) ignores SIGINT, the ignore is inherited, and a Python started so keeps ignoring it.
_DEFAULT_SIGNALS_THEN_EXEC = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n")


def with_default_signals(argv: Sequence[str]) -> list[str]:
    """`argv` (argv[0] a path) run with the default SIGINT and SIGTERM, in the same process (exec)."""
    return [sys.executable, "-c", _DEFAULT_SIGNALS_THEN_EXEC, *argv]


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether a process of dagster dev's group is left. Reaps dagster dev itself first: its zombie would count."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)  # start_new_session=True: the group id is dagster dev's pid
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: the group is still there
        pass
    return True


def _stop_group(proc: subprocess.Popen, log_path: Path | None = None, grace_s: float = 10.0) -> None:
    """SIGINT to dagster dev (it shuts its services down), then SIGTERM and SIGKILL to its process group.

    A dagster dev that outlives `grace_s` after SIGINT is reported as a warning (pytest's warnings summary, which
    its output capture does not hide), so a slow teardown in a CI log names its cause."""
    pgid = proc.pid  # start_new_session=True: the group id is our child's pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            tail = log_path.read_text(errors="replace")[-1500:] if log_path and log_path.exists() else ""
            warnings.warn(f"dagster dev (pid {pgid}) still running {grace_s:.0f} s after SIGINT; SIGTERM to its "
                          f"group. The end of its log:\n{tail}", RuntimeWarning, stacklevel=2)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)  # leftovers: webserver, daemon, code server, run workers
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc):  # not a fixed sleep: most groups go at once
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def dagster_dev(
    home: str | os.PathLike,
    *,
    env: Mapping[str, str] | None = None,
    dagster_yaml: str | None = None,
    workspace: str | os.PathLike = REPO_ROOT / "workspace.yaml",
    startup_timeout_s: float = 300.0,
    required_daemons: Sequence[str] = ("BACKFILL", "SENSOR", "QUEUED_RUN_COORDINATOR"),
) -> Iterator[DagsterDev]:
    """Start ``dagster dev`` with ``DAGSTER_HOME=home`` and ``env`` on a free 127.0.0.1 port; always stop it."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(dagster_yaml if dagster_yaml is not None else instance_yaml())
    port = free_port()
    run_env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
    bin_dir = str(Path(sys.executable).parent)  # the venv's dagster, for runs and code servers too
    run_env["PATH"] = bin_dir + os.pathsep + run_env.get("PATH", "")
    log_path = home / "dagster-dev.log"
    argv = [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(with_default_signals(argv), cwd=REPO_ROOT, env=run_env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    dev = DagsterDev(url=f"http://127.0.0.1:{port}", home=home, log_path=log_path, proc=proc)
    try:
        wait_until_ready(dev, startup_timeout_s, required_daemons)
        yield dev
    finally:
        _stop_group(proc, log_path)


def wait_until_ready(dev: DagsterDev, timeout_s: float = 300.0,
                     required_daemons: Sequence[str] = ("BACKFILL", "SENSOR", "QUEUED_RUN_COORDINATOR")) -> None:
    """Until GraphQL answers, the code location is loaded and ``required_daemons`` are healthy."""
    deadline = time.monotonic() + timeout_s
    stage, detail = "webserver", ""
    while time.monotonic() < deadline:
        if dev.proc.poll() is not None:
            raise DagsterDevError(f"dagster dev exited with {dev.proc.returncode}:\n{dev.log_tail()}")
        try:
            if stage == "webserver":
                dev.graphql("{ version }")
                stage = "code location"
            if stage == "code location":
                status, error = dev.location_status()
                if error:
                    raise CodeLocationError(f"code location failed to load:\n{error}")
                if status != "LOADED":
                    detail = status
                    raise _NotYet
                stage = "daemons"
            if stage == "daemons":
                if missing := dev.unhealthy_daemons(required_daemons):
                    detail = ", ".join(missing)
                    raise _NotYet
                return
        except CodeLocationError:
            raise
        except (_NotYet, DagsterDevError, OSError) as e:  # URLError, refused, timeouts: not up yet
            if not isinstance(e, _NotYet):
                detail = f"({type(e).__name__}: {str(e)[:200]})"
            time.sleep(0.5)
    raise DagsterDevError(f"dagster dev not ready after {timeout_s:.0f} s (waiting for {stage} {detail}):\n"
                          f"{dev.log_tail()}")


class _NotYet(Exception):
    pass


# --- processes (Linux /proc) ---------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of ``pid``, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def process_tree(root_pid: int) -> dict[tuple[int, int], str]:
    """``root_pid`` and its live descendants: (pid, start time) -> command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(int(entry.name))
    out: dict[tuple[int, int], str] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[(pid, stat[2])] = cmdline
        todo.extend(children.get(pid, []))
    return out


def still_running(processes: Mapping[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """The entries of a ``process_tree`` that are still running (same pid and start time, not a zombie)."""
    out = {}
    for (pid, started), cmdline in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == started:
            out[(pid, started)] = cmdline
    return out


# --- test data ---------------------------------------------------------------------------


def write_prompt_source(path: str | os.PathLike, n: int, start: int = 0, word: str = "question") -> Path:
    """Append ``n`` distinct one-turn prompts (JSONL, ``messages`` format) to ``path``."""
    path = Path(path)
    with open(path, "a") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{word} {i}: how do tides work?"}]}) + "\n")
    return path


def write_completions(store: Any, shard: str, *, stub: bool = False) -> int:
    """Write ``completions/<shard>.parquet`` for the prompts of ``raw_prompts/<shard>.parquet``; returns rows.

    Each conversation gets one assistant turn after its user turns: reasoning
    plus a multi-sentence answer, or with ``stub=True`` no reasoning and
    ``OK.`` (a supervised span of a handful of tokens: an empty response).
    """
    import pyarrow as pa

    from dflash_assets.store import layout
    from dflash_assets.tokenization.samples import COMPLETIONS_MESSAGES_TYPE

    prompts = store.read_parquet(f"raw_prompts/{shard}.parquet", columns=["prompt_id", "system", "user_turns"])
    conversations = []
    for system, turns in zip(prompts.column("system").to_pylist(), prompts.column("user_turns").to_pylist()):
        messages = [{"role": "system", "content": system, "reasoning_content": None}] if system else []
        for turn in turns:
            messages.append({"role": "user", "content": turn, "reasoning_content": None})
        if stub:
            messages.append({"role": "assistant", "content": "OK.", "reasoning_content": ""})
        else:
            messages.append({
                "role": "assistant",
                "reasoning_content": "The user asks about tides. The Moon's gravity pulls the oceans; "
                                     "the Sun adds a smaller pull, and Earth rotates beneath both bulges.",
                "content": "Tides come from the Moon's gravity pulling on the oceans, with a smaller pull "
                           "from the Sun. Two bulges form, and as the Earth turns each coast passes through "
                           "them, so most places see two high tides and two low tides a day.",
            })
        conversations.append(messages)
    table = pa.table({"prompt_id": prompts.column("prompt_id"),
                      "messages": pa.array(conversations, COMPLETIONS_MESSAGES_TYPE)})
    store.write_parquet(layout.completions(shard), table)
    return table.num_rows


@contextlib.contextmanager
def ui_page(width: int = 1600, height: int = 1250, timeout_ms: int = 60_000) -> Iterator[Any]:
    """A Playwright page in Debian's chromium, headless, with the Dagster UI's first-run tour dismissed (the
    screenshot benches)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            ctx = browser.new_context(viewport={"width": width, "height": height})
            ctx.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
            page = ctx.new_page()
            page.set_default_timeout(timeout_ms)
            yield page
        finally:
            browser.close()
