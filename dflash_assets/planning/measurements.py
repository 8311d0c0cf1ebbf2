"""How long will regenerating the corpus take? Measured, not assumed.

``ameasure_throughput`` probes the fleet, then sends each usable endpoint a
short burst (``requests`` requests, ``concurrency`` at a time, each of
``max_new_tokens`` with ``ignore_eos`` where the engine supports it) built
from a fixed long-answer prompt, all endpoints at once as in a real run, and
measures completion tokens per second of wall time per endpoint.
``estimate_generation_time`` turns that into the wall time of the whole
corpus: prompts x turns x expected output tokens / summed throughput, with
each endpoint taking a share proportional to its throughput (so all finish
together), plus the time each endpoint would need alone.
``plan_generation`` does both. The expected output length and turns per
prompt are inputs: ``measure_completions`` reads them off the completions
published so far (``completion_tokens`` and ``num_turns``, column by column,
one shard at a time: memory bounded by a shard, never the corpus; with a
sample of real requests, history included);
``measure_prompts`` gives turns per prompt from the ``raw_prompts`` shards
(``num_user_turns`` capped at ``max_turns``) and a sample of real
conversations for the burst, so its prompts have real lengths. Results are
frozen dataclasses with ``markdown()`` and ``to_metadata()``.

Before any completions exist, ``pilot`` is the honest measure: it
regenerates a sample of real prompts (``sample_prompt_rows``) through the
whole completions path into a scratch store and scales its wall time to the
corpus (``PilotMeasure.estimate_wall_s``). Tokens per tokenized sample (what
``planning.costs`` turns into cache bytes and GPU-hours) come from
the completions (``last_turn_tokens``: the last turn's prompt + completion
tokens), else from the pilot with the whole corpus's prompt text
(``PromptsMeasure.user_chars``, ``PilotMeasure.scaled_tokens_per_sample``).

Reads: HTTP endpoints (a few requests each); the store's ``completions`` and
``raw_prompts`` shards (a few columns; before any ``raw_prompts``, the committed
corpus's shards). Writes nothing (the pilot writes into a temporary directory).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Sequence

import polars as pl
import pyarrow as pa

from dflash_assets.chart_data import format_duration
from dflash_assets.generation.fleet import EngineFleet, EngineFleetConfig, FleetProbe, run_sync
from dflash_assets.generation.engines import Engine, EngineError, GenerationConfig
from dflash_assets.store import layout

__all__ = [
    "EndpointThroughput",
    "EndpointEstimate",
    "GenerationEstimate",
    "ameasure_throughput",
    "measure_throughput",
    "estimate_generation_time",
    "plan_generation",
    "mean_output_tokens",
    "CompletionsMeasure",
    "measure_completions",
    "last_turn_tokens",
    "PromptsMeasure",
    "measure_prompts",
    "sample_prompt_rows",
    "partition_rows",
    "PilotMeasure",
    "apilot",
    "pilot",
    "format_duration",
]

PROBE_PROMPT = ("Explain, step by step and in detail, how a compiler turns source code into machine code: "
                "lexing, parsing, semantic analysis, intermediate representations, optimization passes, "
                "register allocation and code generation. Give an example for each stage.")


@dataclass(frozen=True)
class EndpointThroughput:
    """One endpoint's measured burst."""

    endpoint: str
    kind: str
    served_model: str
    concurrency: int
    requests: int
    ok: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    mean_latency_s: float
    error: str | None = None


@dataclass(frozen=True)
class EndpointEstimate:
    endpoint: str
    tokens_per_s: float
    share: float  # fraction of the corpus's tokens it generates
    tokens: float
    alone_wall_s: float  # if this endpoint did everything


@dataclass(frozen=True)
class GenerationEstimate:
    prompts: int
    turns_per_prompt: float
    output_tokens_per_turn: float
    total_output_tokens: float
    total_tokens_per_s: float
    wall_s: float
    per_endpoint: tuple[EndpointEstimate, ...]
    measurements: tuple[EndpointThroughput, ...]
    probe: FleetProbe | None = None
    probe_max_new_tokens: int | None = None

    def markdown(self) -> str:
        lines = [
            f"**Estimated wall time: {format_duration(self.wall_s)}** for {self.prompts:,} prompts x "
            f"{self.turns_per_prompt:g} turns x {self.output_tokens_per_turn:,.0f} output tokens = "
            f"{self.total_output_tokens:,.0f} tokens at {self.total_tokens_per_s:,.0f} tok/s (measured).",
            "",
            "| endpoint | kind | concurrency | measured tok/s | req/s | mean latency | share | alone |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        est = {e.endpoint: e for e in self.per_endpoint}
        for m in self.measurements:
            e = est.get(m.endpoint)
            share = f"{e.share:.0%}" if e else "-"
            alone = format_duration(e.alone_wall_s) if e else (m.error or "-").replace("|", "\\|")[:120]
            lines.append(f"| {m.endpoint} | {m.kind} | {m.concurrency} | {m.tokens_per_s:,.1f} | "
                         f"{m.requests_per_s:,.2f} | {m.mean_latency_s:.2f} s | {share} | {alone} |")
        if self.probe_max_new_tokens:
            lines += ["", f"Burst: {self.probe_max_new_tokens} new tokens per request."]
        return "\n".join(lines)

    def to_metadata(self) -> dict[str, Any]:
        return {"estimated_wall_s": round(self.wall_s, 1), "estimated_wall": format_duration(self.wall_s),
                "total_output_tokens": int(self.total_output_tokens),
                "measured_tokens_per_s": round(self.total_tokens_per_s, 1), "prompts": self.prompts,
                **{f"tokens_per_s[{m.endpoint}]": round(m.tokens_per_s, 1) for m in self.measurements}}


def mean_output_tokens(completions: Any) -> float:
    """Mean generated tokens per assistant turn of a completions table (Arrow, or rows)."""
    if not isinstance(completions, pa.Table):
        completions = pa.Table.from_pylist([{"completion_tokens": r["completion_tokens"]} for r in completions],
                                           schema=pa.schema([("completion_tokens", pa.list_(pa.int32()))]))
    flat = pl.from_arrow(completions.select(["completion_tokens"])).get_column("completion_tokens").explode(
        keep_nulls=False)
    return float(flat.cast(pl.Int64).sum()) / len(flat) if len(flat) else 0.0


@dataclass(frozen=True)
class CompletionsMeasure:
    """Sums over the published completions: what a plan needs of the corpus generated so far."""

    shards: int
    prompts: int
    turns: int
    completion_tokens: int
    prompt_tokens: int
    turns_at_cap: int  # turns whose completion hit max_new_tokens (finish reason "length")
    sample: tuple[tuple[dict, ...], ...] = ()  # real requests (history re-sent, as the run sent them)
    sample_tokens: int = 0  # summed over rows: the last turn's prompt + completion tokens (a last_turn sample)

    @property
    def tokens_per_sample(self) -> float:
        return self.sample_tokens / self.prompts if self.prompts else 0.0

    @property
    def output_tokens_per_turn(self) -> float:
        return self.completion_tokens / self.turns if self.turns else 0.0

    @property
    def turns_per_prompt(self) -> float:
        return self.turns / self.prompts if self.prompts else 0.0

    @property
    def prompt_tokens_per_turn(self) -> float:
        return self.prompt_tokens / self.turns if self.turns else 0.0


def _last_turn_tokens(max_length: int | None) -> pl.Expr:
    """Per row: the last turn's ``prompt_tokens`` + ``completion_tokens`` (0 for none), capped at ``max_length``."""
    def last(col: str) -> pl.Expr:
        return pl.col(col).list.last().cast(pl.Int64).fill_null(0)

    per_row = last("prompt_tokens") + last("completion_tokens")
    return per_row if max_length is None else pl.min_horizontal(per_row, pl.lit(max_length, pl.Int64))


def last_turn_tokens(table: pa.Table, max_length: int | None = None) -> int:
    """Sum over rows of the last turn's ``prompt_tokens`` + ``completion_tokens``: the tokens of a ``last_turn``
    sample (history, the last question, its reasoning and answer), each capped at ``max_length``. Column-wise."""
    df = pl.from_arrow(table.select(["prompt_tokens", "completion_tokens"]))
    return int(df.select(_last_turn_tokens(max_length).sum()).item() or 0)


def _flat_sum(col: str) -> pl.Expr:
    return pl.col(col).explode(keep_nulls=False).cast(pl.Int64).sum()


def completion_sums(paths: Sequence[Any], max_length: int | None = None) -> dict[str, int]:
    """Prompts, turns, output and prompt tokens, turns at the cap and last-turn sample tokens, summed over the
    completions Parquet files at ``paths``: one lazy polars scan of four columns across the shards (streamed, so
    memory stays bounded by a batch, not by a shard)."""
    lf = pl.scan_parquet(list(paths), extra_columns="ignore")
    sums = lf.select(
        prompts=pl.len().cast(pl.Int64), turns=pl.col("num_turns").cast(pl.Int64).sum(),
        completion_tokens=_flat_sum("completion_tokens"), prompt_tokens=_flat_sum("prompt_tokens"),
        turns_at_cap=(pl.col("finish_reasons").explode(keep_nulls=False) == "length").sum().cast(pl.Int64),
        sample_tokens=_last_turn_tokens(max_length).sum(),
    ).collect(engine="streaming")
    return {k: int(v or 0) for k, v in sums.row(0, named=True).items()}


def _requests_of(messages: list[dict], turn: int) -> tuple[dict, ...]:
    """The request a run sent for assistant turn ``turn``: the history (answers without reasoning) and the user turn."""
    out: list[dict] = []
    users = 0
    for m in messages:
        if m["role"] == "user":
            if users == turn:
                return (*out, {"role": "user", "content": m["content"]})
            users += 1
        out.append({"role": m["role"], "content": m["content"] or ""})
    return tuple(out)


def measure_completions(store: Any, *, sample: int = 0, max_length: int | None = None) -> CompletionsMeasure | None:
    """Turns, output and prompt tokens of every published completions shard (None: none yet).

    Sums four columns in one lazy polars scan across the shards (``completion_sums``):
    no shard is turned into Python objects, and memory stays bounded. Tokens
    per sample: the last turn's prompt + completion tokens, capped at
    ``max_length`` (what ``tokenized_samples`` keeps in ``last_turn`` mode). With
    ``sample``, also that many real requests from the first rows (every turn
    of a conversation in turn, history included): prompts of the length the run
    really sends.
    """
    requests: list[tuple[dict, ...]] = []
    shards = layout.list_completion_shards(store)
    for shard in shards:
        if len(requests) >= sample:
            break
        head = store.read_parquet(layout.completions(shard), columns=["messages", "num_turns"]).slice(0, sample)
        for row in head.to_pylist():
            requests += [_requests_of(row["messages"], k) for k in range(row["num_turns"] or 0)]
        del requests[sample:]
    if not shards:
        return None
    s = completion_sums([store.local_path(layout.completions(shard)) for shard in shards], max_length)
    if not s["prompts"]:
        return None
    return CompletionsMeasure(len(shards), s["prompts"], s["turns"], s["completion_tokens"], s["prompt_tokens"],
                              s["turns_at_cap"], tuple(requests), s["sample_tokens"])


@dataclass(frozen=True)
class PromptsMeasure:
    """Turns per prompt of the ``raw_prompts`` shards (capped at ``max_turns``) and a sample of their chats."""

    shards: int
    prompts: int
    turns: int
    sample: tuple[tuple[dict, ...], ...]  # first-turn requests (system + first user turn) of the first prompts
    user_chars: int = 0  # characters of the system prompt and the first max_turns user turns, summed

    @property
    def user_chars_per_prompt(self) -> float:
        return self.user_chars / self.prompts if self.prompts else 0.0

    @property
    def turns_per_prompt(self) -> float:
        return self.turns / self.prompts if self.prompts else 0.0


def _user_chars(table: pa.Table, max_turns: int) -> int:
    """Characters of ``system`` and the first ``max_turns`` of ``user_turns``, summed over rows (Arrow)."""
    df = pl.from_arrow(table.select(["system", "user_turns"]))
    turns = pl.col("user_turns").list.head(max_turns).explode(keep_nulls=False).str.len_chars()
    return int(df.select(pl.col("system").str.len_chars().cast(pl.Int64).sum() + turns.cast(pl.Int64).sum()).item() or 0)


def _prompt_shards(store: Any, columns: list[str] | None = None):
    """(shard, table) of every ``raw_prompts`` shard, one at a time; before any is materialized, the committed
    corpus's shards (the same rows: what ``raw_prompts`` will copy)."""
    from dflash_assets.prompts.corpus import list_shard_keys, read_corpus_shard

    shards = layout.list_raw_prompt_shards(store)
    if shards:
        for shard in shards:
            yield shard, (lambda cols, s=shard: store.read_parquet(layout.raw_prompts(s), columns=cols))
    else:
        for shard in list_shard_keys(store):
            yield shard, (lambda cols, s=shard: read_corpus_shard(store, s, columns=cols))


def sample_prompt_rows(store: Any, n: int) -> pa.Table | None:
    """The first ``n`` rows of the ``raw_prompts`` shards, else of the committed corpus (every column; one shard
    read at a time)."""
    parts: list[pa.Table] = []
    got = 0
    for _, read in _prompt_shards(store):
        if got >= n:
            break
        part = read(None).slice(0, n - got)
        parts.append(part)
        got += part.num_rows
    return pa.concat_tables(parts, promote_options="default") if parts else None


def partition_rows(store: Any, limit: int) -> tuple[int, list[list[dict]]]:
    """(the number of partitions, the ``system`` and ``user_turns`` of every row of at most ``limit`` of them,
    evenly spaced over all, first and last included): of the ``raw_prompts`` shards, else of the committed corpus."""
    readers = [read for _, read in _prompt_shards(store)]
    n = len(readers)
    if n <= limit:
        picked = list(range(n))
    else:
        picked = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]
    return n, [readers[i](["system", "user_turns"]).to_pylist() for i in picked]


@dataclass(frozen=True)
class PilotMeasure:
    """A sample of real prompts regenerated through the whole completions path (scratch store)."""

    prompts: int
    done: int
    failed: int
    turns: int
    completion_tokens: int
    prompt_tokens: int
    wall_s: float  # the whole regeneration, probe and writes included
    dispatch_s: float  # of it, the fleet's run (first request to last answer)
    concurrency: int  # requests in flight that keep the usable endpoints busy (their busy_concurrency, summed)
    sample_tokens: int = 0  # summed over done prompts: the last turn's prompt + completion tokens (capped)
    endpoint_tokens: tuple[tuple[str, int], ...] = ()  # completion tokens each endpoint generated
    user_chars: int = 0  # the pilot prompts' system + first max_turns user turns: characters
    user_tokens: int = 0  # ... and tokens (the target's tokenizer)
    turns_at_cap: int = 0  # turns cut at max_new_tokens (finish reason "length")
    stopped_tokens: int = 0  # completion tokens of the other turns (those that stopped on their own)
    answer_tokens: int = 0  # tokens of the answers as a later turn's history re-sends them (no reasoning)

    @property
    def tokens_per_sample(self) -> float:
        return self.sample_tokens / self.done if self.done else 0.0

    def scaled_tokens_per_sample(self, user_chars_per_prompt: float | None) -> float:
        """Tokens per sample of a corpus whose prompts average ``user_chars_per_prompt`` characters (system and
        user turns, as ``PromptsMeasure.user_chars``): the pilot's other tokens per sample (template, answers,
        reasoning) plus the corpus's prompt text at the pilot's characters per token. A few pilot prompts say
        little about the corpus's prompt lengths, which the corpus itself gives in full."""
        if not (self.done and self.user_tokens and self.user_chars) or user_chars_per_prompt is None:
            return self.tokens_per_sample
        share = self.done / self.prompts  # user text of the prompts that were done
        other = (self.sample_tokens - self.user_tokens * share) / self.done
        return max(other, 0.0) + user_chars_per_prompt * self.user_tokens / self.user_chars

    @property
    def saturated(self) -> bool:
        """Enough prompts to keep every slot busy (twice the concurrency), as a real partition does."""
        return self.prompts >= 2 * self.concurrency

    def estimate_wall_s(self, prompts: int, partitions: int = 1) -> float:
        """Wall time of ``prompts`` at the pilot's rate (prompts finished per second of dispatch), plus the
        pilot's fixed cost (probe, tokenizer, writes) once per partition."""
        if not self.done:
            return float("inf")
        return prompts * self.dispatch_s / self.done + partitions * max(self.wall_s - self.dispatch_s, 0.0)

    def to_metadata(self, prompts: int, partitions: int = 1) -> dict[str, Any]:
        wall = self.estimate_wall_s(prompts, partitions)
        return {"pilot_prompts": self.prompts, "pilot_done": self.done, "pilot_failed": self.failed,
                "pilot_wall_s": round(self.wall_s, 2), "pilot_turns_per_prompt": round(self.turns / max(self.done, 1), 3),
                "pilot_output_tokens_per_turn": round(self.completion_tokens / max(self.turns, 1), 1),
                "pilot_tokens_per_sample": round(self.tokens_per_sample, 1),
                "pilot_saturated": self.saturated,
                "pilot_estimated_wall_s": round(wall, 1), "pilot_estimated_wall": format_duration(wall)}


async def apilot(config: EngineFleetConfig, rows: Any, *, generation: GenerationConfig,
                 tokenizer: Any = None, max_length: int | None = None, warmup: bool = True) -> PilotMeasure:
    """Regenerate ``rows`` (raw_prompts rows) over the fleet into a temporary local store and time it.

    ``warmup``: first send each endpoint one short request (untimed), as a backfill finds its engines warm.
    Tokens per sample: as ``measure_completions``, over the pilot's rows (capped at ``max_length``)."""
    import tempfile

    from dflash_assets.generation.completions import aregenerate_shard
    from dflash_assets.store.backends import LocalStore

    if warmup and len(rows):  # an engine's first requests pay one-time costs, which a backfill pays once
        first = (rows.slice(0, 1) if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows)[:1])).to_pylist()[0]
        chat = ([{"role": "system", "content": first["system"]}] if first.get("system") else []) + [
            {"role": "user", "content": (first.get("user_turns") or [""])[0]}]
        async with EngineFleet(config, tokenizer) as fleet:
            short = generation.model_copy(update={"max_new_tokens": 8})
            for engine in fleet.live_endpoints:
                try:
                    await engine.chat(chat, short)
                except EngineError:
                    pass  # the pilot itself reports what fails
    seen: list[FleetProbe] = []
    with tempfile.TemporaryDirectory(prefix="dflash-pilot-") as tmp:
        res = await aregenerate_shard(rows, shard="pilot", store=LocalStore(tmp), fleet=config,
                                      generation=generation, tokenizer=tokenizer, max_failed_ratio=1.0,
                                      on_probe=seen.append)
    usable = {r.endpoint for r in seen[0].usable} if seen else set()
    concurrency = sum(ep.busy_concurrency for ep in config.endpoints if ep.url.rstrip("/") in usable)
    user_chars = user_tokens = 0
    if tokenizer is not None and len(rows):
        table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows))
        user_chars = _user_chars(table, generation.max_turns)
        texts = [t for r in table.select(["system", "user_turns"]).to_pylist()
                 for t in ([r["system"]] if r["system"] else []) + list(r["user_turns"] or [])[:generation.max_turns]]
        user_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0
    st = res.stats
    per_endpoint = tuple((url, int(ep.get("completion_tokens", 0))) for url, ep in st.endpoints.items())
    at_cap = stopped = answers = 0
    if res.table.num_rows:
        turns = pl.from_arrow(res.table.select(["finish_reasons", "completion_tokens"])).explode(
            ["finish_reasons", "completion_tokens"], keep_nulls=False)
        capped = pl.col("finish_reasons") == "length"
        r = turns.select(at_cap=capped.sum(), stopped=pl.col("completion_tokens").filter(~capped).cast(pl.Int64).sum())
        at_cap, stopped = int(r.item(0, "at_cap") or 0), int(r.item(0, "stopped") or 0)
        if tokenizer is not None:
            contents = [m["content"] or "" for row in res.table.column("messages").to_pylist() for m in row
                        if m["role"] == "assistant"]
            answers = sum(len(ids) for ids in tokenizer(contents, add_special_tokens=False)["input_ids"]) \
                if contents else 0
    return PilotMeasure(st.prompts_total, st.prompts_done, st.prompts_failed, st.turns, st.completion_tokens,
                        st.prompt_tokens, st.wall_s, st.dispatch_s, concurrency,
                        last_turn_tokens(res.table, max_length) if res.table.num_rows else 0, per_endpoint,
                        user_chars, user_tokens, at_cap, stopped, answers)


def pilot(config: EngineFleetConfig, rows: Any, **kwargs: Any) -> PilotMeasure:
    """Blocking form of ``apilot``."""
    return run_sync(apilot(config, rows, **kwargs))


def measure_prompts(store: Any, *, max_turns: int, sample: int = 64) -> PromptsMeasure | None:
    """Turns per prompt over every ``raw_prompts`` shard (else the committed corpus's; one column, one shard at a
    time) and ``sample`` real first-turn requests for the throughput burst. None when there are no prompts yet."""
    shards = prompts = turns = chars = 0
    chats: list[tuple[dict, ...]] = []
    for _, read in _prompt_shards(store):
        t = read(["num_user_turns", "system", "user_turns"])
        shards += 1
        prompts += t.num_rows
        turns += int(pl.from_arrow(t.select(["num_user_turns"])).select(
            pl.col("num_user_turns").clip(upper_bound=max_turns).cast(pl.Int64).sum()).item() or 0)
        chars += _user_chars(t, max_turns)
        del t
        if len(chats) < sample:
            head = read(["system", "user_turns"]).slice(0, sample - len(chats))
            for row in head.to_pylist():
                first = (row["user_turns"] or [""])[0]
                system = ({"role": "system", "content": row["system"]},) if row["system"] else ()
                chats.append((*system, {"role": "user", "content": first}))
    if not prompts:
        return None
    return PromptsMeasure(shards, prompts, turns, tuple(chats), chars)


async def _burst(engine: Engine, gen: GenerationConfig, requests: int, concurrency: int,
                 conversations: Sequence[Sequence[dict]]) -> EndpointThroughput:
    sem = asyncio.Semaphore(concurrency)
    tokens, latencies, errors = [], [], []

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                kwargs = {"ignore_eos": True} if engine.kind in ("sglang", "openai") else {}
                res = await engine.chat(list(conversations[i % len(conversations)]), gen, **kwargs)
            except EngineError as e:
                errors.append(str(e))
                return
            tokens.append(res.completion_tokens)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    n_tok = sum(tokens)
    return EndpointThroughput(
        engine.url, engine.kind, engine.served_model, concurrency, requests, len(tokens), n_tok, wall,
        n_tok / wall if wall > 0 else 0.0, len(tokens) / wall if wall > 0 else 0.0,
        sum(latencies) / len(latencies) if latencies else 0.0,
        f"{len(errors)} of {requests} failed: {errors[0][:200]}" if errors else None)


async def ameasure_throughput(config: EngineFleetConfig, *, tokenizer: Any = None, max_new_tokens: int = 256,
                              requests: int | None = None, concurrency: int | None = None,
                              generation: GenerationConfig | None = None,
                              prompt: str = PROBE_PROMPT,
                              conversations: Sequence[Sequence[dict]] | None = None,
                              ) -> tuple[FleetProbe, list[EndpointThroughput]]:
    """Probe the fleet and measure each usable endpoint's throughput with one burst (all endpoints at once).

    ``concurrency`` defaults to each endpoint's ``busy_concurrency`` (the load
    that keeps it busy: its ``max_concurrency``, a slot engine's twice its rows),
    ``requests`` to twice that. Request i sends
    ``conversations[i % n]`` (real prompts: ``measure_prompts(...).sample``),
    else the one fixed ``prompt``; sampling is ``generation``'s (the
    completions' settings) with ``max_new_tokens`` and end-of-turn ignored.
    """
    gen = (generation or GenerationConfig()).model_copy(update={"max_new_tokens": max_new_tokens})
    chats = [list(c) for c in conversations or () if c] or [[{"role": "user", "content": prompt}]]
    async with EngineFleet(config, tokenizer) as fleet:
        engines = fleet.live_endpoints
        bursts = [
            _burst(e, gen, requests or 2 * (concurrency or e.busy_concurrency), concurrency or e.busy_concurrency,
                   chats)
            for e in engines
        ]
        results = await asyncio.gather(*bursts)
        assert fleet.probe is not None
        return fleet.probe, list(results)


def measure_throughput(config: EngineFleetConfig, **kwargs) -> tuple[FleetProbe, list[EndpointThroughput]]:
    return run_sync(ameasure_throughput(config, **kwargs))


def estimate_generation_time(measurements: Sequence[EndpointThroughput], *, prompts: int,
                             output_tokens_per_turn: float, turns_per_prompt: float = 1.0,
                             probe: FleetProbe | None = None, probe_max_new_tokens: int | None = None
                             ) -> GenerationEstimate:
    """Wall time of ``prompts`` x ``turns_per_prompt`` x ``output_tokens_per_turn`` over the measured endpoints."""
    total_tokens = prompts * turns_per_prompt * output_tokens_per_turn
    usable = [m for m in measurements if m.tokens_per_s > 0]
    total_tps = sum(m.tokens_per_s for m in usable)
    wall = total_tokens / total_tps if total_tps > 0 else float("inf")
    per = tuple(EndpointEstimate(m.endpoint, m.tokens_per_s, m.tokens_per_s / total_tps,
                                 total_tokens * m.tokens_per_s / total_tps, total_tokens / m.tokens_per_s)
                for m in usable)
    return GenerationEstimate(prompts, turns_per_prompt, output_tokens_per_turn, total_tokens, total_tps, wall, per,
                              tuple(measurements), probe, probe_max_new_tokens)


def plan_generation(config: EngineFleetConfig, *, prompts: int, output_tokens_per_turn: float,
                    turns_per_prompt: float = 1.0, tokenizer: Any = None, max_new_tokens: int = 256,
                    requests: int | None = None, concurrency: int | None = None,
                    generation: GenerationConfig | None = None,
                    conversations: Sequence[Sequence[dict]] | None = None) -> GenerationEstimate:
    """Measure the fleet (``measure_throughput``) and estimate the corpus's wall time."""
    probe, measured = measure_throughput(config, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                                         requests=requests, concurrency=concurrency, generation=generation,
                                         conversations=conversations)
    return estimate_generation_time(measured, prompts=prompts, output_tokens_per_turn=output_tokens_per_turn,
                                    turns_per_prompt=turns_per_prompt, probe=probe, probe_max_new_tokens=max_new_tokens)
