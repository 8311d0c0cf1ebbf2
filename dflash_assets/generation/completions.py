"""Regenerate every assistant turn of a prompt shard with the target, journaled and resumable.

:func:`aregenerate_shard` (blocking form :func:`regenerate_shard`) takes one shard's
``raw_prompts`` rows and regenerates their assistant turns over the fleet
(:mod:`dflash_assets.generation.fleet`); source assistant turns are never used.
Plain chats are one ``Conversation`` each, agentic ones (rows with
``tools`` and ``agentic_turns``) an ``AgenticConversation`` (:mod:`dflash_assets.generation.conversations`);
a run goes in steps (``_ShardRun``: inputs, resume, tasks, dispatch, publish). Finished rows
go to a ``CompletionJournal`` (:mod:`dflash_assets.generation.journal`), so a killed run resumes where it stopped; a
shard with too many failed prompts publishes nothing (:class:`TooManyFailedPrompts`).
With a seed set, the fleet is probed first: ``config_hash`` records whether the
engines honour the seed. Given the target's fingerprint (``target_fingerprint``), ``config_hash``
holds it too, so rows of an earlier target of the same name are not resumed. A turn that does not fit the endpoint's context length
(or ``GenerationConfig.max_context_tokens``, the data's own limit) is cut or stopped before it is sent
(``generation.engines.Engine.fit_to_context``) and counted in :class:`GenerationStats`; a prompt whose first turn
is over ``max_context_tokens`` is listed as failed but not counted against ``max_failed_ratio``.

Reads: the prompt rows handed in, the engines (HTTP or in-process) and, from the
store, the shard's journal and its published ``completions/<shard>.parquet``.
Writes, through the store: ``completions/_journal/<shard>/<run>-<seq>.jsonl``,
``completions/<shard>.parquet`` (:func:`output_schema`) and
``completions/_failed/<shard>.parquet`` (:func:`failed_schema`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dflash_assets.store import layout
from dflash_assets.store.schemas import AGENTIC_MESSAGES_TYPE, COMPLETIONS_MESSAGES_TYPE
from dflash_assets.chart_data import binned_counts
from dflash_assets.quality_gates import ratio_gate
from dflash_assets.generation.fleet import EngineFleet, EngineFleetConfig, FleetProbe, NoEngineAvailable, run_sync
from dflash_assets.generation.conversations import Conversation, agentic_task
from dflash_assets.generation.engines import Engine, GenerationConfig
from dflash_assets.generation.journal import CompletionJournal, published_rows

__all__ = [
    "GenerationConfig",
    "EngineFleetConfig",
    "NoEngineAvailable",
    "ProgressUpdate",
    "GenerationStats",
    "CompletionsResult",
    "CompletionJournal",
    "TooManyFailedPrompts",
    "failed_prompts_markdown",
    "output_schema",
    "failed_schema",
    "regenerate_shard",
    "aregenerate_shard",
]


def output_schema(agentic: bool = False) -> pa.Schema:
    """Schema of ``completions/<shard>.parquet``; ``agentic``: of a shard holding an agentic conversation.

    Exactly one row per prompt that succeeded: ``messages`` (role/content/reasoning_content),
    per-turn finish reasons, token counts, endpoints and latencies, served model, timings,
    ``config_hash``. With ``agentic``, ``messages`` are of ``store.schemas.AGENTIC_MESSAGES_TYPE``
    (tool calls with arguments as JSON text, role ``tool`` results), plus ``tools`` (JSON text) and
    ``agentic_stop``; a shard of plain chats keeps ``output_schema()``.
    """
    schema = pa.schema([
        ("prompt_id", pa.string()),
        ("messages", AGENTIC_MESSAGES_TYPE if agentic else COMPLETIONS_MESSAGES_TYPE),
        ("num_turns", pa.int32()),
        ("finish_reasons", pa.list_(pa.string())),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("completion_tokens", pa.list_(pa.int32())),
        ("completion_tokens_total", pa.int64()),
        ("turn_endpoints", pa.list_(pa.string())),
        ("endpoint", pa.string()),
        ("served_model", pa.string()),
        ("turn_latency_s", pa.list_(pa.float64())),
        ("started_at", pa.timestamp("ms", tz="UTC")),
        ("finished_at", pa.timestamp("ms", tz="UTC")),
        ("generation_s", pa.float64()),
        ("attempts", pa.int32()),
        ("config_hash", pa.string()),
    ])
    if agentic:
        schema = schema.append(pa.field("tools", pa.string())).append(pa.field("agentic_stop", pa.string()))
    return schema


def failed_schema() -> pa.Schema:
    """Schema of ``completions/_failed/<shard>.parquet``: prompts that failed after retries (or could not be
    generated), with reasons; written every run, empty when nothing failed."""
    return pa.schema([
        ("prompt_id", pa.string()),
        ("reason", pa.string()),
        ("errors", pa.list_(pa.string())),
        ("turns_done", pa.int32()),
        ("attempts", pa.int32()),
        ("config_hash", pa.string()),
    ])


def _rows_to_table(rows: Sequence[dict]) -> pa.Table:
    """Column by column (rows hold epoch seconds for the timestamps, as journaled)."""
    schema = output_schema(agentic=any("agentic_stop" in r for r in rows))
    arrays = []
    for f in schema:
        values = [r.get(f.name) for r in rows]
        if pa.types.is_timestamp(f.type):
            values = [round(v * 1000) if v is not None else None for v in values]
        arrays.append(pa.array(values, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


# ----------------------------------------------------------------------------
# Progress and stats


@dataclass(frozen=True)
class ProgressUpdate:
    shard: str
    done: int  # prompts with a row (resumed ones included)
    total: int
    failed: int
    resumed: int
    completion_tokens: int  # generated in this run
    tokens_per_s: float
    elapsed_s: float
    eta_s: float | None

    def __str__(self) -> str:
        eta = f"{self.eta_s:.0f}s" if self.eta_s is not None else "?"
        return (f"[{self.shard}] {self.done}/{self.total} done, {self.failed} failed, "
                f"{self.tokens_per_s:.0f} tok/s, ETA {eta}")


@dataclass
class GenerationStats:
    shard: str
    config_hash: str
    prompts_total: int = 0
    prompts_done: int = 0
    prompts_generated: int = 0
    prompts_resumed: int = 0  # rows reused: from the journal or the published table, same config_hash
    prompts_resumed_published: int = 0  # of those, from the published table
    prompts_failed: int = 0
    duplicates_dropped: int = 0
    turns: int = 0
    requests: int = 0
    retries: int = 0
    failovers: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    dispatch_s: float = 0.0  # of wall_s, the fleet's run (first request to last answer); the rest is fixed cost
    tokens_per_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    empty_content: int = 0  # assistant turns with an empty answer
    empty_reasoning: int = 0  # assistant turns with empty reasoning (thinking on)
    journal_chunks_written: int = 0
    agentic_conversations: int = 0  # rows of agentic conversations (tools, tool calls or tool results)
    agentic_steps: int = 0  # assistant steps of those rows
    agentic_tool_calls: int = 0  # tool calls the target made in those rows
    agentic_stopped_at_divergent_call: int = 0  # stopped where the target's calls left the source's
    seed_effect: str = "no seed"  # no seed | honoured | ignored (the engines do not make a seed reproducible)
    # Context length (generated in this run): turns sent with max_new_tokens lowered to fit, conversations
    # stopped because their next turn did not fit, prompts failed because their first turn did not fit.
    turns_cut_to_context: int = 0
    conversations_stopped_at_context: int = 0
    prompts_failed_context_overflow: int = 0
    # of those, the prompts over GenerationConfig.max_context_tokens: listed as failed, not counted by the gate
    prompts_over_max_context_tokens: int = 0
    endpoints: dict[str, dict] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, Any]:
        """Flat numbers for logs and asset metadata."""
        meta: dict[str, Any] = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        for reason, n in sorted(self.finish_reasons.items()):
            meta[f"finish_{reason}"] = n
        for url, ep in self.endpoints.items():
            meta[f"tokens_per_s[{url}]"] = round(ep.get("tokens_per_s", 0.0), 1)
            decoding = ep.get("decoding") or {}
            if decoding.get("steps"):  # an in-process engine's own decoder: its steps and the prefills' share
                meta[f"decode_steps[{url}]"] = int(decoding["steps"])
                meta[f"prefill_share[{url}]"] = decoding.get("prefill_share", 0.0)
        return meta


@dataclass
class CompletionsResult:
    shard: str
    table: pa.Table
    failed: pa.Table
    stats: GenerationStats
    probe: FleetProbe | None
    output_key: str
    failed_key: str
    config_hash: str
    sha256: str  # of the published completions file: its data version


class TooManyFailedPrompts(RuntimeError):
    """More prompts of a shard failed than ``max_failed_ratio`` allows; the shard was not published.

    ``result`` holds the failed table (also written to ``completions/_failed/<shard>.parquet``) and the stats;
    its ``table`` holds the rows that succeeded (kept in the journal for the next run).
    """

    def __init__(self, message: str, result: "CompletionsResult"):
        super().__init__(message)
        self.result = result


def _input_rows(prompts: Any) -> list[dict]:
    if isinstance(prompts, pa.Table):
        return prompts.to_pylist()
    if hasattr(prompts, "to_arrow"):  # polars
        return prompts.to_arrow().to_pylist()
    return [dict(r) for r in prompts]


def _resolve_tokenizer(tokenizer: Any, fleet: EngineFleetConfig) -> Any:
    if tokenizer is not None or all(ep.kind == "openai" for ep in fleet.endpoints):
        return tokenizer
    path = Path(fleet.target_model)
    if path.is_dir():
        from dflash_assets.target_model.spec import TargetModelSpec

        return TargetModelSpec(model_path=str(path), allow_download=True).chat()
    raise ValueError("sglang/transformers endpoints need the target's tokenizer: pass tokenizer= "
                     f"(target {fleet.target_model!r} is not a local model dir)")


# only what str.strip() removes, as an RE2 class: a test, no stripped copy of every answer
_BLANK = "^[" + "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(0x110000)) if c.isspace()) + "]*$"


def _blank(messages: pa.ChunkedArray, name: str) -> pa.ChunkedArray:
    """Per message: the field null, empty or only whitespace (as ``not (text or "").strip()``)."""
    return pc.fill_null(pc.match_substring_regex(pc.struct_field(messages, name), _BLANK), True)


def turn_counts(table: pa.Table, thinking: bool) -> tuple[dict[str, int], int, int, int]:
    """Over a completions table: finish reasons (first seen first) and, over the assistant turns, those with an
    empty answer (a tool call is an answer), those with empty reasoning (counted when ``thinking``), and all.
    Arrow kernels over the flattened messages and their fields, which are views of the table's buffers: what is
    allocated is a few bits per message."""
    finish: dict[str, int] = {}
    for item in pc.value_counts(pc.list_flatten(table.column("finish_reasons"))).to_pylist():
        finish[item["values"]] = finish.get(item["values"], 0) + item["counts"]
    messages = pc.list_flatten(table.column("messages"))
    step = pc.fill_null(pc.equal(pc.struct_field(messages, "role"), "assistant"), False)
    answered = step  # an assistant turn whose answer is its text: no tool call
    if messages.type.get_field_index("tool_calls") >= 0:
        calls = pc.list_value_length(pc.struct_field(messages, "tool_calls"))
        answered = pc.and_(step, pc.fill_null(pc.equal(calls, 0), True))
    empty_content = pc.sum(pc.and_(answered, _blank(messages, "content"))).as_py() or 0
    empty_reasoning = (pc.sum(pc.and_(step, _blank(messages, "reasoning_content"))).as_py() or 0) if thinking else 0
    return finish, int(empty_content), int(empty_reasoning), int(pc.sum(step).as_py() or 0)


def _agentic_counts(table: pa.Table, stats: "GenerationStats") -> None:
    if "tools" not in table.column_names:
        return
    # every agentic prompt has tools (ingest quarantines calls without them)
    df = pl.from_arrow(table.select(["tools", "messages", "agentic_stop"])).filter(pl.col("tools").is_not_null())
    steps = df.select(pl.col("messages").explode(keep_nulls=False)).unnest("messages").filter(role="assistant")
    stats.agentic_conversations += df.height
    stats.agentic_steps += steps.height
    stats.agentic_tool_calls += int(steps.get_column("tool_calls").list.len().sum() or 0)
    stats.agentic_stopped_at_divergent_call += int((df.get_column("agentic_stop") == "divergent_call").sum() or 0)


# ----------------------------------------------------------------------------
# Entry points


async def aregenerate_shard(
    prompts: Any,
    *,
    shard: str,
    store: Any,
    fleet: EngineFleetConfig,
    generation: GenerationConfig,
    tokenizer: Any = None,
    progress: Callable[[ProgressUpdate], None] | None = None,
    on_probe: Callable[[FleetProbe], None] | None = None,
    progress_interval_s: float = 5.0,
    flush_every: int = 64,
    flush_interval_s: float = 10.0,
    keep_journal: bool = False,
    max_failed_ratio: float = 0.01,
    engines: Sequence[Engine] | None = None,
    target_fingerprint: str | None = None,
) -> CompletionsResult:
    """Regenerate the assistant turns of ``prompts`` (one shard) over the fleet; resume from the journal.

    ``prompts``: Arrow table, polars frame or dicts with ``prompt_id``,
    ``system`` (optional), ``user_turns``. ``tokenizer``: the target's chat
    object (``TargetModelSpec.chat()``) or a bare tokenizer (needed for
    sglang/transformers endpoints; the chat object of ``target_model`` when
    that is a local dir). ``progress`` gets a ``ProgressUpdate`` every
    ``progress_interval_s``; ``on_probe`` the fleet's one probe, before any
    work. The journal is flushed every ``flush_every`` rows or
    ``flush_interval_s`` seconds and kept after success with
    ``keep_journal``. ``max_failed_ratio``: the share of failed prompts
    above which nothing is published and ``TooManyFailedPrompts`` is raised,
    by the ratio checks' rule (`quality_gates`: the 95% Wilson lower bound of
    the failed share exceeds it; 1.0: always publish). ``engines``: prebuilt engines instead of the config's.
    ``target_fingerprint``: the target's ``TargetModelSpec.generation_fingerprint()`` (``stage.regenerate_partition``
    passes it), hashed into ``config_hash`` so rows of another target of the same name are never reused; None (a
    remote engine, no local target directory known) names the target by its basename alone.
    Writes the journal, ``completions/<shard>.parquet`` and
    ``completions/_failed/<shard>.parquet``. Raises ``NoEngineAvailable``
    when no endpoint serves the target, or when all die mid-run (the journal
    keeps what was done). ``regenerate_shard`` is the blocking form.

    A run reuses, besides the journal, the rows already published in
    ``completions/<shard>.parquet`` with the same ``config_hash`` (a re-run after
    success regenerates only prompts without such a row). When the failed share
    is shown to be over ``max_failed_ratio`` (default 1%; its 95% Wilson lower
    bound exceeds it: at 1%, one failed prompt fails a shard of up to 17 prompts, two of up to 55), nothing is
    published: ``_failed`` lists them, the journal keeps the finished rows, and
    ``TooManyFailedPrompts`` is raised so the partition fails; the next run
    retries only the failed prompts. The journal is deleted once the final
    Parquet is written and nothing failed (``keep_journal`` keeps it); with
    failures it stays. ``GenerationStats`` (tokens/s per endpoint, finish reason
    counts, empty answers, empty reasoning) comes back with the tables.
    """
    t_start = time.perf_counter()
    fleet_runner: EngineFleet | None = None
    seed_honoured: bool | None = None
    if generation.seed is not None:  # whether the seed holds is the engines' to say: probe before hashing
        fleet_runner = EngineFleet(fleet, _resolve_tokenizer(tokenizer, fleet), engines=engines)
        await fleet_runner.__aenter__()  # NoEngineAvailable when none serves the target
        seed_honoured = fleet_runner.seed_honoured
    try:
        return await _regenerate(prompts, shard, store, fleet, generation, tokenizer, progress, on_probe,
                                 progress_interval_s, flush_every, flush_interval_s, keep_journal, max_failed_ratio,
                                 engines, t_start, fleet_runner, seed_honoured, target_fingerprint)
    finally:
        if fleet_runner is not None:
            await fleet_runner.close()


@dataclass
class _ShardRun:
    """One ``aregenerate_shard`` run, in its steps: the inputs, what is resumed, the tasks, the dispatch over the
    fleet (journaling each finished row), then the publish (or ``TooManyFailedPrompts``)."""

    shard: str
    store: Any
    generation: GenerationConfig
    journal: CompletionJournal
    stats: GenerationStats
    t_start: float
    progress: Callable[[ProgressUpdate], None] | None = None
    progress_interval_s: float = 5.0
    order: list[str] = field(default_factory=list)  # distinct prompt ids, in input order
    inputs: dict[str, dict] = field(default_factory=dict)
    done_rows: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, dict] = field(default_factory=dict)
    over_max_context: set[str] = field(default_factory=set)  # failed prompts whose first turn is over max_context_tokens
    generated: dict[str, int] = field(default_factory=lambda: {"tokens": 0, "rows": 0, "prompt_tokens": 0})
    probe: FleetProbe | None = None
    flushes: set[asyncio.Task] = field(default_factory=set)

    @property
    def config_hash(self) -> str:
        return self.stats.config_hash

    def read_inputs(self, prompts: Any) -> None:
        """One task per distinct prompt_id, in input order; later duplicates are counted and dropped."""
        for row in _input_rows(prompts):
            pid = str(row["prompt_id"])
            if pid in self.inputs:
                self.stats.duplicates_dropped += 1
                continue
            self.inputs[pid] = row
            self.order.append(pid)
        self.stats.prompts_total = len(self.order)

    async def resume(self) -> None:
        """The rows already done with this config_hash: published ones, and the journal's (which win)."""
        published = await asyncio.to_thread(published_rows, self.store, self.shard, self.config_hash, self.inputs)
        journaled = {pid: r for pid, r in self.journal.load(self.config_hash).items() if pid in self.inputs}
        self.done_rows = {**published, **journaled}
        self.stats.prompts_resumed = len(self.done_rows)
        self.stats.prompts_resumed_published = len(set(published) - set(journaled))

    def _fail_unsent(self, pid: str, reason: str) -> None:
        self.failed[pid] = {"prompt_id": pid, "reason": reason, "errors": [], "turns_done": 0, "attempts": 0,
                            "config_hash": self.config_hash}

    def tasks(self) -> list[Conversation]:
        """A conversation for each prompt not done; a prompt that cannot be generated fails here, unsent."""
        tasks: list[Conversation] = []
        for pid in self.order:
            if pid in self.done_rows:
                continue
            row = self.inputs[pid]
            if row.get("agentic_turns"):
                task = agentic_task(pid, row, self.generation, self.config_hash)
                if isinstance(task, str):
                    self._fail_unsent(pid, task)
                else:
                    tasks.append(task)
                continue
            turns = [str(t) for t in (row.get("user_turns") or [])][: self.generation.max_turns]
            if not turns:
                self._fail_unsent(pid, "no user turns")
                continue
            tasks.append(Conversation(pid, row.get("system") or None, turns, self.generation, self.config_hash))
        return tasks

    def emit_progress(self) -> None:
        if self.progress is None:
            return
        elapsed = time.perf_counter() - self.t_start
        n_done = len(self.done_rows)
        rate = self.generated["rows"] / elapsed if elapsed > 0 else 0.0
        remaining = self.stats.prompts_total - n_done - len(self.failed)
        eta = remaining / rate if rate > 0 else (0.0 if remaining == 0 else None)
        self.progress(ProgressUpdate(self.shard, n_done, self.stats.prompts_total, len(self.failed),
                                     self.stats.prompts_resumed, self.generated["tokens"],
                                     self.generated["tokens"] / elapsed if elapsed > 0 else 0.0, elapsed, eta))

    def _schedule_flush(self) -> None:
        t = asyncio.ensure_future(self.journal.flush())
        self.flushes.add(t)
        t.add_done_callback(self.flushes.discard)

    def on_done(self, task: Conversation) -> None:
        row = task.row()
        self.done_rows[task.prompt_id] = row
        self.generated["rows"] += 1
        self.generated["tokens"] += row["completion_tokens_total"]
        self.generated["prompt_tokens"] += sum(row["prompt_tokens"])
        self.stats.turns_cut_to_context += task.turns_cut_to_context
        self.stats.conversations_stopped_at_context += task.stopped_at_context
        self.journal.add(row)
        if self.journal.due:
            self._schedule_flush()

    def on_failed(self, task: Conversation, reason: str, errors: list[str]) -> None:
        self.failed[task.prompt_id] = {"prompt_id": task.prompt_id, "reason": reason, "errors": errors[-5:],
                                       "turns_done": len(task.results), "attempts": task.attempts,
                                       "config_hash": self.config_hash}
        self.stats.turns_cut_to_context += task.turns_cut_to_context
        self.stats.prompts_failed_context_overflow += task.context_overflow
        if task.over_max_context:
            self.over_max_context.add(task.prompt_id)
        else:
            self.over_max_context.discard(task.prompt_id)

    async def _ticker(self) -> None:
        """Flushes the journal when due and reports progress every ``progress_interval_s``."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, self.progress_interval_s, self.journal.flush_interval_s))
            if self.journal.due:
                self._schedule_flush()
            if time.monotonic() - last >= self.progress_interval_s:
                last = time.monotonic()
                self.emit_progress()

    async def dispatch(self, fleet_runner: EngineFleet, tasks: list[Conversation],
                       on_probe: Callable[[FleetProbe], None] | None) -> None:
        """The tasks over the fleet; whatever finished is journaled, also when the run fails."""
        tick = asyncio.ensure_future(self._ticker())
        try:
            async with fleet_runner:
                self.probe = fleet_runner.probe
                if on_probe is not None and self.probe is not None:  # the one probe of this run, before any work
                    on_probe(self.probe)
                run = await fleet_runner.run(tasks, on_done=self.on_done,  # type: ignore[arg-type]
                                             on_failed=self.on_failed)
            self.stats.requests, self.stats.retries, self.stats.failovers = run.requests, run.retries, run.failovers
            self.stats.dispatch_s = run.wall_s
            self.stats.endpoints = {url: asdict(ep) for url, ep in run.endpoints.items()}
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            if self.flushes:
                await asyncio.gather(*list(self.flushes), return_exceptions=True)
            await self.journal.flush()

    async def publish(self, keep_journal: bool, max_failed_ratio: float) -> CompletionsResult:
        """The completions and failed tables written (the completions only when the failed share passes the gate),
        the journal cleared when nothing failed, the stats completed; ``TooManyFailedPrompts`` when it does not."""
        shard, stats = self.shard, self.stats
        stats.journal_chunks_written = self.journal.chunks_written
        rows = [self.done_rows[pid] for pid in self.order if pid in self.done_rows]
        table = _rows_to_table(rows)
        failed_rows = [self.failed[pid] for pid in self.order if pid in self.failed]
        failed_table = pa.Table.from_pylist(failed_rows, schema=failed_schema())
        # The ratio checks' rule (quality_gates): too many only when the 95% Wilson lower bound of the failed share
        # exceeds max_failed_ratio, so one engine hiccup in a small shard does not fail it; no failure never does.
        # Prompts longer than the config's max_context_tokens are the data's, not the engines': listed, not counted.
        stats.prompts_over_max_context_tokens = over = sum(pid in self.over_max_context for pid in self.failed)
        gated = len(failed_rows) - over
        failed_gate = ratio_gate(gated, max(stats.prompts_total - over, gated), max_failed_ratio)
        too_many = gated > 0 and not failed_gate.passed
        if too_many:  # not published: the finished rows stay in the journal, earlier published ones where they are
            digest = ""
        else:
            digest = await asyncio.to_thread(self.store.write_parquet, layout.completions(shard), table)
        await asyncio.to_thread(self.store.write_parquet, layout.completions_failed(shard), failed_table)
        if not failed_rows and not keep_journal:
            await asyncio.to_thread(self.journal.clear)
        self._final_stats(table, len(rows), len(failed_rows))
        result = CompletionsResult(shard, table, failed_table, stats, self.probe, layout.completions(shard),
                                   layout.completions_failed(shard), self.config_hash, digest)
        if too_many:
            reasons = "; ".join(f"{r['prompt_id']}: {r['reason'][:120]}" for r in failed_rows[:3])
            counted = (f", {over} of them over max_context_tokens (not counted): {gated} of "
                       f"{stats.prompts_total - over}" if over else "")
            raise TooManyFailedPrompts(
                f"[{shard}] {len(failed_rows)} of {stats.prompts_total} prompts failed{counted} "
                f"({failed_gate.ratio:.1%}; 95% lower bound {failed_gate.lower:.1%} > max_failed_ratio "
                f"{max_failed_ratio:.1%}); "
                f"nothing published, {len(rows)} finished rows kept for the next run, which retries only the failed. "
                f"Failed list: {layout.completions_failed(shard)}. First: {reasons}", result)
        return result

    def _final_stats(self, table: pa.Table, done: int, failed: int) -> None:
        stats = self.stats
        stats.prompts_done = done
        stats.prompts_generated = self.generated["rows"]
        stats.prompts_failed = failed
        stats.finish_reasons, stats.empty_content, stats.empty_reasoning, stats.turns = turn_counts(
            table, self.generation.enable_thinking)
        _agentic_counts(table, stats)
        stats.completion_tokens = self.generated["tokens"]
        stats.prompt_tokens = self.generated["prompt_tokens"]
        stats.wall_s = time.perf_counter() - self.t_start
        stats.tokens_per_s = stats.completion_tokens / stats.wall_s if stats.wall_s > 0 else 0.0
        self.emit_progress()


async def _regenerate(prompts: Any, shard: str, store: Any, fleet: EngineFleetConfig, generation: GenerationConfig,
                      tokenizer: Any, progress: Callable[[ProgressUpdate], None] | None,
                      on_probe: Callable[[FleetProbe], None] | None, progress_interval_s: float, flush_every: int,
                      flush_interval_s: float, keep_journal: bool, max_failed_ratio: float,
                      engines: Sequence[Engine] | None, t_start: float, fleet_runner: "EngineFleet | None",
                      seed_honoured: bool | None, target_fingerprint: str | None = None) -> CompletionsResult:
    """The body of ``aregenerate_shard``, step by step (``_ShardRun``); ``fleet_runner`` is the fleet already
    probed (a seed is set), else None."""
    config_hash = generation.config_hash(fleet.target_model, seed_honoured, target_fingerprint)
    stats = GenerationStats(shard=shard, config_hash=config_hash)
    if generation.seed is not None:
        stats.seed_effect = "honoured" if seed_honoured else "ignored"
    journal = CompletionJournal(store, shard, flush_every=flush_every, flush_interval_s=flush_interval_s)
    run = _ShardRun(shard, store, generation, journal, stats, t_start, progress, progress_interval_s)
    run.read_inputs(prompts)
    await run.resume()
    tasks = run.tasks()
    if tasks:
        fleet_runner = fleet_runner or EngineFleet(fleet, _resolve_tokenizer(tokenizer, fleet), engines=engines)
        await run.dispatch(fleet_runner, tasks, on_probe)
    return await run.publish(keep_journal, max_failed_ratio)


@functools.wraps(aregenerate_shard, assigned=("__module__", "__annotations__"))
def regenerate_shard(*args: Any, **kwargs: Any) -> CompletionsResult:
    """Blocking form of ``aregenerate_shard``: the same arguments (defined once, there), run to completion."""
    return run_sync(aregenerate_shard(*args, **kwargs))


def failed_prompts_markdown(failed: pa.Table, limit: int = 50) -> str:
    """The failed prompts of a shard as a markdown table (prompt id, turns done, attempts, reason), for metadata."""
    lines = [f"{failed.num_rows} failed prompts" + (f" (first {limit})" if failed.num_rows > limit else ""), "",
             "| prompt_id | turns done | attempts | reason |", "| --- | --- | --- | --- |"]
    for r in failed.slice(0, limit).to_pylist():
        reason = (r["reason"] or "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r['prompt_id']} | {r['turns_done']} | {r['attempts']} | {reason} |")
    return "\n".join(lines)


RESPONSE_TOKEN_BIN_EDGES = (0, 1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)


def response_length_histogram(table: pa.Table, max_new_tokens: int | None = None) -> dict[str, int]:
    """Assistant turns per bin of generated tokens; the counts sum to the turns.

    With ``max_new_tokens``: "0", then 8 equal bins below the cap, then the cap itself ("96+" for 96: turns
    cut at the cap). Without: "0", "1-15", "16-63", ..., "16384+".
    """
    column = pl.from_arrow(table.select(["completion_tokens"])).get_column("completion_tokens")
    per_turn = column.explode(keep_nulls=False)
    return binned_counts(per_turn.to_numpy(), response_length_bin_edges(max_new_tokens))


def response_length_bin_edges(max_new_tokens: int | None = None) -> tuple[int, ...]:
    if not max_new_tokens:
        return RESPONSE_TOKEN_BIN_EDGES
    width = max(1, -(-max_new_tokens // 8))  # ceil
    return tuple(sorted({0, 1, *range(width, max_new_tokens, width), max_new_tokens}))
