"""Quality checks of a tokenized-samples partition, and the gate file the GPU stages obey.

Reads a samples table (`SAMPLES_SCHEMA`): the check functions
(`empty_response_check`, `thinking_ratio_check`, `truncation_ratio_check`,
`schema_check`) are pure functions over it returning `CheckOutcome`, and
`evaluate_quality` runs them all; Dagster check bodies only wrap them.
The three ratio checks decide by one rule (`dflash_assets.quality_gates`):
a ceiling fails when the 95% Wilson lower bound of the share exceeds it, a
floor when the upper bound is below it, so one empty answer in a small shard
does not fail it while 87% stubs fail from 2 samples up; 0 samples fail.

The gate: `publish_samples` writes ``tokenized_samples/<shard>.quality.json``
as pending, then ``<shard>.parquet``, then the gate naming the sha256 of
exactly those Parquet bytes with the outcomes. The GPU stages read samples
only through `read_verified_samples` / `verified_samples_path`, which refuse
(`QualityGateFailed`) a missing, pending, failed or stale gate: samples that
are not the bytes the gate checked never reach a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_assets.chart_data import binned_counts
from dflash_assets.quality_gates import CEILING, FLOOR, RatioGate, ratio_gate
from dflash_assets.stage_io import CheckOutcome
from dflash_assets.store import layout
from dflash_assets.tokenization.samples import SAMPLES_SCHEMA

__all__ = [
    "check_descriptions",
    "BLOCKING_CHECKS",
    "LOSS_TOKEN_BIN_EDGES",
    "CheckOutcome",
    "PublishedSamples",
    "QualityGateFailed",
    "QualityThresholds",
    "empty_response_check",
    "evaluate_quality",
    "loss_token_histogram",
    "mark_quality_gate_pending",
    "publish_samples",
    "read_verified_samples",
    "require_quality_gate",
    "schema_check",
    "thinking_ratio_check",
    "truncation_ratio_check",
    "verified_samples_path",
    "write_quality_gate",
]


# -- checks ----------------------------------------------------------------------------


LOSS_TOKEN_BIN_EDGES = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def loss_token_histogram(num_loss_tokens: np.ndarray) -> dict[str, int]:
    """Counts of samples per bin of loss-mask sum ("0", "1-7", "8-15", ..., "4096+"); they sum to the samples."""
    return binned_counts(num_loss_tokens, LOSS_TOKEN_BIN_EDGES)


def _frame(table: pa.Table, columns: list[str]) -> pl.DataFrame:
    """`columns` of the samples table as a polars frame over the same Arrow buffers (no copy)."""
    return pl.from_arrow(table.select(columns))


def _examples(frame: pl.DataFrame, selected: pl.Expr, limit: int = 10) -> list[str]:
    """Up to `limit` prompt_ids of the rows `selected` picks, in row order."""
    return [str(x) for x in frame.filter(selected).get_column("prompt_id").head(limit).to_list()]


def empty_response_check(table: pa.Table, min_loss_tokens: int = 16, max_empty_ratio: float = 0.02) -> CheckOutcome:
    """Share of samples whose response is empty: fewer than `min_loss_tokens`
    supervised tokens, or an empty visible answer once the think block is removed.

    Fails when the data show that share is over `max_empty_ratio`: the lower
    bound of its 95% Wilson score interval exceeds it (`quality_gates`). An
    empty table fails. Metadata: n, count, ratio, the lower bound, the
    threshold and the rule in words; the short and answer-empty counts, up to
    10 example prompt_ids and the most common loss-mask sum (the 87%-stub
    failure shows as one value, e.g. 6, holding most samples). The histogram
    of loss-mask sums is ``loss_token_histogram`` (the asset draws it once, on
    its materialization).
    """
    n = table.num_rows
    df = _frame(table, ["prompt_id", "num_loss_tokens", "answer_empty"])
    loss = pl.col("num_loss_tokens")
    short, empty = loss < min_loss_tokens, (loss < min_loss_tokens) | pl.col("answer_empty")
    counts = df.select(short=short.sum(), answer_empty=pl.col("answer_empty").sum(), empty=empty.sum(),
                       median=loss.median()).row(0, named=True)
    # the most common loss-mask sum (the smallest of equally common ones) and how many samples hold it
    mode, freq = (df.group_by("num_loss_tokens").len().sort(["len", "num_loss_tokens"], descending=[True, False])
                  .row(0) if n else (0, 0))
    gate = ratio_gate(int(counts["empty"]), n, max_empty_ratio, CEILING)
    metadata = {
        **gate.metadata(),
        "min_loss_tokens": min_loss_tokens,
        "num_short": int(counts["short"]),
        "num_answer_empty": int(counts["answer_empty"]),
        "examples": _examples(df, empty),
        "most_common_loss_tokens": int(mode),
        "most_common_loss_tokens_share": round(float(freq) / n, 6) if n else 0.0,
        "median_loss_tokens": float(counts["median"]) if n else 0.0,
    }
    return CheckOutcome("empty_response_ratio", gate.passed, metadata=metadata, blocking=True,
                        description=_described(gate, f"have < {min_loss_tokens} supervised tokens or an empty answer"))


def thinking_ratio_check(table: pa.Table, floor: float = 0.9, thinking_requested: bool = True) -> CheckOutcome:
    """Share of samples whose supervised turn has non-empty reasoning, at least `floor`.

    Fails when the data show the share is under `floor`: the upper bound of
    its 95% Wilson score interval is below it (`quality_gates`); an empty
    table fails. Only meaningful when the completions were generated with
    thinking on; with ``thinking_requested=False`` it passes and reports the
    ratio.
    """
    n = table.num_rows
    df = _frame(table, ["prompt_id", "has_reasoning"])
    gate = ratio_gate(int(df.get_column("has_reasoning").sum()), n, floor, FLOOR)
    metadata = {
        **gate.metadata(),
        "thinking_requested": thinking_requested,
        "applicable": thinking_requested,
        "examples_without_reasoning": _examples(df, ~pl.col("has_reasoning")),
    }
    if not thinking_requested:  # thinking off, or a target without a thinking mode (SmolLM2): nothing to check
        share = f"{gate.ratio:.2%}" if n else "none (0 samples)"
        return CheckOutcome("thinking_ratio", True, metadata=metadata, description="not applicable: thinking is off "
                            f"or the target has no thinking mode; {share} of samples have reasoning")
    return CheckOutcome("thinking_ratio", gate.passed, metadata=metadata,
                        description=_described(gate, "have non-empty reasoning"))


def truncation_ratio_check(table: pa.Table, ceiling: float = 0.05) -> CheckOutcome:
    """Share of samples cut at max_length, at most `ceiling`: fails when the data show it is over (the 95%
    Wilson lower bound exceeds `ceiling`, `quality_gates`); an empty table fails."""
    n = table.num_rows
    df = _frame(table, ["prompt_id", "truncated", "num_tokens"])
    counts = df.select(truncated=pl.col("truncated").sum(), max=pl.col("num_tokens").max(),
                       mean=pl.col("num_tokens").mean()).row(0, named=True)
    gate = ratio_gate(int(counts["truncated"]), n, ceiling, CEILING)
    metadata = {
        **gate.metadata(),
        "max_num_tokens": int(counts["max"]) if n else 0,
        "mean_num_tokens": round(float(counts["mean"]), 1) if n else 0.0,
        "examples": _examples(df, pl.col("truncated")),
    }
    return CheckOutcome("truncation_ratio", gate.passed, severity="WARN", metadata=metadata,
                        description=_described(gate, "were cut at max_length"))


def _described(gate: RatioGate, what: str) -> str:
    """``"1/23 samples (4.35%) <what>; not shown to be over the 2.00% threshold (95% lower bound 0.77%)"``."""
    if gate.n == 0:
        return gate.verdict()
    return f"{gate.count}/{gate.n} samples ({gate.ratio:.2%}) {what}; {gate.verdict()}"


def schema_check(table: pa.Table, max_length: int | None = None) -> CheckOutcome:
    """Columns and types equal `SAMPLES_SCHEMA`, and the rows are self-consistent:
    list lengths equal ``num_tokens``, mask sums equal ``num_loss_tokens``, the
    mask holds only 0/1, every sample has a supervised token, (prompt_id,
    turn_index) is unique, and ``num_tokens <= max_length`` when given.
    """
    problems: list[str] = []
    have = {f.name: f.type for f in table.schema}
    for f in SAMPLES_SCHEMA:
        if f.name not in have:
            problems.append(f"missing column {f.name}")
        elif have[f.name] != f.type:
            problems.append(f"column {f.name} is {have[f.name]}, expected {f.type}")
    extra = sorted(set(have) - set(SAMPLES_SCHEMA.names))
    if not problems:
        nulls = [f.name for f in SAMPLES_SCHEMA if table.column(f.name).null_count]
        if nulls:
            problems.append(f"null values in {nulls}")
    if not problems and table.num_rows:
        problems += _row_problems(_frame(table, SAMPLES_SCHEMA.names), max_length)
    metadata = {
        "num_samples": table.num_rows,
        "problems": problems,
        "extra_columns": extra,
        "schema": str(table.schema),
    }
    passed = not problems
    description = "schema and row invariants hold" if passed else f"{len(problems)} problem(s): {problems[0]}"
    return CheckOutcome("schema", passed, metadata=metadata, description=description, blocking=True)


def _row_problems(df: pl.DataFrame, max_length: int | None) -> list[str]:
    """The row invariants of `schema_check`, one polars pass over the samples (each a count of offending rows)."""
    n_tok, n_loss, mask = pl.col("num_tokens"), pl.col("num_loss_tokens"), pl.col("loss_mask")
    r = df.select(
        input_ids=(pl.col("input_ids").list.len() != n_tok).sum(),
        loss_mask=(mask.list.len() != n_tok).sum(),
        mask_max=mask.list.max().max(),
        sums=(mask.list.sum() != n_loss).sum(),
        no_loss=(n_loss <= 0).sum(),
        pairs=pl.struct("prompt_id", "turn_index").n_unique(),
        too_long=(n_tok > max_length).sum() if max_length is not None else pl.lit(0),
    ).row(0, named=True)
    problems = [f"{name} lengths differ from num_tokens in {r[name]} rows"
                for name in ("input_ids", "loss_mask") if r[name]]
    if r["mask_max"] is not None and r["mask_max"] > 1:
        problems.append("loss_mask holds values other than 0/1")
    if r["sums"]:
        problems.append(f"loss_mask sums differ from num_loss_tokens in {r['sums']} rows")
    if r["no_loss"]:
        problems.append(f"{r['no_loss']} samples have no supervised token")
    if r["pairs"] != df.height:
        problems.append("(prompt_id, turn_index) is not unique")
    if r["too_long"]:
        problems.append(f"{r['too_long']} samples longer than max_length {max_length}")
    return problems


# -- the partition as a whole: store layout, quality evaluation, the gate ---------------------


BLOCKING_CHECKS = ("empty_response_ratio", "schema")


@dataclass(frozen=True)
class QualityThresholds:
    """Thresholds of the sample checks (defaults: the DFlash recipe's expectations).

    The ratios are compared by `quality_gates.ratio_gate`: `max_empty_ratio` and `truncation_ceiling` are
    ceilings (fail when the 95% Wilson lower bound exceeds them), `thinking_floor` a floor (fail when the
    upper bound is below it).
    """

    min_loss_tokens: int = 16
    max_empty_ratio: float = 0.02
    thinking_requested: bool = True
    thinking_floor: float = 0.9
    truncation_ceiling: float = 0.05
    max_length: int | None = None


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def check_descriptions(thresholds: QualityThresholds = QualityThresholds(), n: int = 23) -> dict[str, str]:
    """Each check's description, its examples computed by the ratio rule (``quality_gates.ratio_gate``) at these
    thresholds on a partition of ``n`` samples, so the words always say what the thresholds do."""
    def ceiling_example(threshold: float) -> tuple[int, int]:  # the most that pass, the fewest that fail
        passing = max(k for k in range(n + 1) if ratio_gate(k, n, threshold, CEILING).passed)
        return passing, passing + 1

    empty_ok, empty_bad = ceiling_example(thresholds.max_empty_ratio)
    stub_share = 0.87  # the share of stub answers found in a real corpus (the failure these checks prevent)
    stubs_fail_from = next(m for m in range(1, 10_000)
                           if not ratio_gate(int(stub_share * m), m, thresholds.max_empty_ratio, CEILING).passed)
    thinking_ok = min(k for k in range(n + 1) if ratio_gate(k, n, thresholds.thinking_floor, FLOOR).passed)
    cut_ok, cut_bad = ceiling_example(thresholds.truncation_ceiling)
    return {
        "empty_response_ratio": "Share of samples whose supervised span is a stub (< min_loss_tokens) or whose "
        "visible answer is empty. Fails only when the data show the share is over max_empty_ratio: the lower bound "
        f"of its 95% Wilson score interval is above it (at {_pct(thresholds.max_empty_ratio)}: {empty_ok} empty in "
        f"{n} {'passes' if empty_ok == 1 else 'pass'}, {empty_bad} in {n} fail; {_pct(stub_share)} stubs fail from {stubs_fail_from} samples up). A "
        "partition with no samples fails. Blocking: a failing partition never reaches the GPU stages.",
        "thinking_ratio": "Share of samples with non-empty reasoning, when thinking was requested. Fails only when "
        "the data show the share is under thinking_floor: the upper bound of its 95% Wilson score interval is below "
        f"it (at {_pct(thresholds.thinking_floor)}: {thinking_ok} of {n} with reasoning passes, {thinking_ok - 1} of "
        f"{n} fails). A partition with no samples fails.",
        "truncation_ratio": "Share of samples cut at max_length. Fails (a warning) only when the data show the share "
        "is over truncation_ceiling: the lower bound of its 95% Wilson score interval is above it (at "
        f"{_pct(thresholds.truncation_ceiling)}: {cut_ok} cut in {n} pass, {cut_bad} in {n} fail). A partition "
        "with no samples fails.",
        "schema": "Column types, list lengths equal num_tokens, mask sums equal num_loss_tokens. Blocking.",
    }


def evaluate_quality(table: pa.Table, thresholds: QualityThresholds = QualityThresholds()) -> dict[str, CheckOutcome]:
    """Every check of a samples partition, by check name."""
    return {
        "empty_response_ratio": empty_response_check(table, thresholds.min_loss_tokens, thresholds.max_empty_ratio),
        "thinking_ratio": thinking_ratio_check(table, thresholds.thinking_floor, thresholds.thinking_requested),
        "truncation_ratio": truncation_ratio_check(table, thresholds.truncation_ceiling),
        "schema": schema_check(table, thresholds.max_length),
    }


class QualityGateFailed(RuntimeError):
    """The samples may not go to a GPU: a blocking check failed, the gate is missing or pending, or the
    samples are not the bytes the gate checked."""


GATE_PENDING = "pending"
GATE_CHECKED = "checked"


class _CheckRecord(BaseModel):
    model_config = ConfigDict(strict=True)

    passed: bool
    description: str = ""


class QualityGateRecord(BaseModel):
    """A checked ``<shard>.quality.json`` as the GPU stages trust it: the samples' hash, each check's outcome and
    the blocking checks (more fields are allowed: a newer writer may add some)."""

    model_config = ConfigDict(extra="allow", strict=True)

    status: Literal["checked"]
    samples_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    checks: dict[str, _CheckRecord]
    blocking: list[str]


@dataclass(frozen=True)
class PublishedSamples:
    """What `publish_samples` wrote: the samples' sha256 (their data version) and the check outcomes."""

    sha256: str
    outcomes: dict[str, CheckOutcome]

    @property
    def data_version(self) -> str:
        return self.sha256[:16]


def mark_quality_gate_pending(store: Any, shard: str) -> None:
    """Replace the shard's gate by a pending one, which blocks: done before the samples are rewritten, so
    a run killed between the samples and the gate leaves a gate that refuses them."""
    store.write_json(layout.quality_gate(shard), {"status": GATE_PENDING, "checks": {},
                                                  "blocking": list(BLOCKING_CHECKS)})


def write_quality_gate(store: Any, shard: str, outcomes: Mapping[str, CheckOutcome],
                       samples_sha256: str) -> dict[str, Any]:
    """Record the check outcomes of the samples whose Parquet bytes hash to `samples_sha256` (hex sha256,
    what `store.write_parquet` returns), so later stages on any host can refuse bad or other data."""
    if not (isinstance(samples_sha256, str) and len(samples_sha256) == 64):
        raise ValueError(f"samples_sha256 must be the 64-hex sha256 of the samples file, got {samples_sha256!r}")
    record = {
        "status": GATE_CHECKED,
        "samples_sha256": samples_sha256,
        "data_version": samples_sha256[:16],
        "checks": {name: {"passed": o.passed, "description": o.description} for name, o in outcomes.items()},
        "blocking": list(BLOCKING_CHECKS),
    }
    store.write_json(layout.quality_gate(shard), record)
    return record


def publish_samples(store: Any, shard: str, table: pa.Table,
                    thresholds: QualityThresholds = QualityThresholds()) -> PublishedSamples:
    """Check `table`, then publish it with its gate: gate pending, samples, gate naming the samples' sha256.

    Whatever point a kill stops this at, the samples a reader finds are either the ones the gate names
    (and passed) or refused.
    """
    outcomes = evaluate_quality(table, thresholds)
    mark_quality_gate_pending(store, shard)
    sha256 = store.write_parquet(layout.tokenized_samples(shard), table)
    write_quality_gate(store, shard, outcomes, sha256)
    return PublishedSamples(sha256, outcomes)


def require_quality_gate(store: Any, shard: str, samples_sha256: str | None = None) -> dict[str, Any]:
    """Raise `QualityGateFailed` unless the shard's gate is complete and its blocking checks passed, and
    (when `samples_sha256` is given) it checked exactly those samples; return the gate record."""
    key = layout.quality_gate(shard)
    if not store.exists(key):
        raise QualityGateFailed(f"{shard}: no quality record at {key}; materialize tokenized_samples first")
    gate = store.read_json(key)
    if gate.get("status") == GATE_PENDING:
        raise QualityGateFailed(f"{shard}: the quality gate is pending (a tokenized_samples run stopped between "
                                "writing the samples and checking them); materialize tokenized_samples again")
    if gate.get("status") != GATE_CHECKED or not isinstance(gate.get("samples_sha256"), str):
        raise QualityGateFailed(f"{shard}: the quality record at {key} names no samples hash (written before "
                                "gates named their data); materialize tokenized_samples again")
    try:
        QualityGateRecord.model_validate(gate)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise QualityGateFailed(f"{shard}: the quality record at {key} is malformed: {field}: {err['msg'].lower()}, "
                                f"got {err.get('input')!r}; materialize tokenized_samples again") from None
    failed = [n for n in gate["blocking"] if not gate["checks"].get(n, {}).get("passed", False)]
    if failed:
        details = "; ".join(f"{n}: {gate['checks'][n]['description']}" for n in failed if n in gate["checks"])
        raise QualityGateFailed(f"{shard}: blocking checks failed ({', '.join(failed)}): {details}")
    if samples_sha256 is not None:
        _same_samples(shard, gate, samples_sha256)
    return gate


def read_verified_samples(store: Any, shard: str, gate: Mapping[str, Any] | None = None,
                          columns: list[str] | None = None) -> pa.Table:
    """The shard's samples, read once and hashed: refused (`QualityGateFailed`) unless the gate passed
    exactly these bytes. `gate`: a record `require_quality_gate` already returned (else it is read)."""
    gate = gate if gate is not None else require_quality_gate(store, shard)
    data = store.read_bytes(layout.tokenized_samples(shard))
    _same_samples(shard, gate, hashlib.sha256(data).hexdigest())
    return pq.read_table(pa.BufferReader(data), columns=columns)


def verified_samples_path(store: Any, shard: str) -> Path:
    """A local path of the shard's samples (the store's file, or its download), refused unless the gate
    passed exactly that file's bytes."""
    gate = require_quality_gate(store, shard)
    path = Path(store.local_path(layout.tokenized_samples(shard)))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    _same_samples(shard, gate, digest.hexdigest())
    return path


def _same_samples(shard: str, gate: Mapping[str, Any], sha256: str) -> None:
    if sha256 != gate.get("samples_sha256"):
        raise QualityGateFailed(
            f"{shard}: the samples (sha256 {sha256[:16]}) are not the ones the quality gate checked "
            f"(sha256 {str(gate.get('samples_sha256'))[:16]}): they changed after the check; "
            "materialize tokenized_samples again"
        )
