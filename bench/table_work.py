#!/usr/bin/env python
"""Benchmark the table work on polars against the pyarrow/numpy/Python-loop code it replaced; prints JSON.

Builds 100,000 synthetic rows with the project's real schemas (``SAMPLES_SCHEMA`` for tokenized samples,
``output_schema()`` for completions: two assistant turns each) and writes them as Parquet under a temporary
directory (10 completions shards for the cross-partition scan). Each computation then runs in its own child
process, once per implementation, interleaved (before, after, before, after ...) ``--repeats`` times:

  quality_checks     the four sample checks (empty answers, thinking, truncation, schema row invariants)
  turn_counts        the completions' finish reasons, empty answers/reasoning and turns (after: Arrow kernels);
                     before: the loop over the rows as Python dicts (what the stage held; building the dicts
                     is not timed)
  response_lengths   the response-length histogram (before: ``to_pylist`` and a list comprehension)
  measure_completions the plan's sums over every completions shard (before: one shard at a time in Arrow;
                     after: one lazy polars scan)

"before" is the replaced implementation, kept only here as the peer; "after" is the library's. A child loads
its input (not timed) and warms polars' runtime and pyarrow.compute's kernels (in both arms: the code location
runs both anyway), then
times the computation (best of ``--inner`` runs); its memory is the rise of its peak RSS (VmHWM, reset through
/proc/self/clear_refs once the input is loaded) over its RSS then. ``speedup`` = before_s / after_s (best of the
repeats).

  .venv/bin/python bench/table_work.py                 # ~2 min on 2 cores
  .venv/bin/python bench/table_work.py --rows 20000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_info  # noqa: E402

COMPUTATIONS = ("quality_checks", "turn_counts", "response_lengths", "measure_completions")
SHARDS = 10


# -- the data ---------------------------------------------------------------------------------------------


def build(out: Path, rows: int, seed: int = 0) -> None:
    """samples.parquet and completions-NN.parquet (SHARDS of them) with the project's schemas."""
    from dflash_assets.generation.completions import output_schema
    from dflash_assets.tokenization.samples import SAMPLES_SCHEMA

    rng = np.random.default_rng(seed)
    n_tok = rng.integers(32, 400, rows).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int32)
    ids = rng.integers(0, 150_000, int(offsets[-1])).astype(np.int32)
    prompt_len = (n_tok * rng.uniform(0.3, 0.7, rows)).astype(np.int32)
    pos = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], n_tok)
    mask = (pos >= np.repeat(prompt_len, n_tok)).astype(np.uint8)
    samples = pa.table({
        "prompt_id": pa.array([f"p{i:07d}" for i in range(rows)]),
        "turn_index": pa.array(np.zeros(rows, np.int32)),
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        "num_tokens": pa.array(n_tok),
        "num_loss_tokens": pa.array(n_tok - prompt_len),
        "truncated": pa.array(rng.random(rows) < 0.02),
        "has_reasoning": pa.array(rng.random(rows) < 0.95),
        "answer_empty": pa.array(rng.random(rows) < 0.01),
        "reasoning_chars": pa.array(rng.integers(0, 4000, rows).astype(np.int32)),
        "answer_chars": pa.array(rng.integers(0, 2000, rows).astype(np.int32)),
    }, schema=SAMPLES_SCHEMA)
    pq.write_table(samples, out / "samples.parquet")
    words = ["", " ", "Sure.", "The answer is 4.", "Let me think about this step by step. " * 8]
    finish = ["stop", "stop", "stop", "length"]
    per_shard = -(-rows // SHARDS)
    for s in range(SHARDS):
        recs = []
        for i in range(s * per_shard, min(rows, (s + 1) * per_shard)):
            msgs = []
            for t in range(2):
                msgs.append({"role": "user", "content": f"question {i} turn {t}", "reasoning_content": None})
                msgs.append({"role": "assistant", "content": words[(i + t) % len(words)],
                             "reasoning_content": words[(i * 7 + t) % len(words)]})
            ct = [int(x) for x in rng.integers(0, 2048, 2)]
            recs.append({"prompt_id": f"p{i:07d}", "messages": msgs, "num_turns": 2,
                         "finish_reasons": [finish[(i + t) % 4] for t in range(2)],
                         "prompt_tokens": [int(x) for x in rng.integers(10, 500, 2)], "completion_tokens": ct,
                         "completion_tokens_total": sum(ct), "turn_endpoints": ["e0", "e0"], "endpoint": "e0",
                         "served_model": "m", "turn_latency_s": [0.1, 0.2], "started_at": 0, "finished_at": 0,
                         "generation_s": 0.3, "attempts": 1, "config_hash": "c"})
        pq.write_table(pa.Table.from_pylist(recs, schema=output_schema()), out / f"completions-{s:02d}.parquet")


# -- the replaced implementations (the peer) --------------------------------------------------------------


def before_quality(table: pa.Table) -> list:
    """The four sample checks as they were: numpy over to_numpy() columns, pyarrow.compute for the keys."""
    from dflash_assets.quality_gates import CEILING, FLOOR, ratio_gate

    def examples(selected, limit=10):
        idx = np.flatnonzero(selected)[:limit]
        return [str(x) for x in table.column("prompt_id").take(pa.array(idx)).to_pylist()] if len(idx) else []

    n = table.num_rows
    loss = table.column("num_loss_tokens").to_numpy()
    answer_empty = table.column("answer_empty").to_numpy(zero_copy_only=False)
    short = loss < 16
    empty = short | answer_empty
    values, freq = np.unique(loss, return_counts=True)
    out = [ratio_gate(int(empty.sum()), n, 0.02, CEILING), int(short.sum()), int(answer_empty.sum()), examples(empty),
           int(values[np.argmax(freq)]), round(float(freq.max()) / n, 6), float(np.median(loss))]
    has = table.column("has_reasoning").to_numpy(zero_copy_only=False)
    out += [ratio_gate(int(has.sum()), n, 0.9, FLOOR), examples(~has)]
    truncated = table.column("truncated").to_numpy(zero_copy_only=False)
    tokens = table.column("num_tokens").to_numpy()
    out += [ratio_gate(int(truncated.sum()), n, 0.05, CEILING), int(tokens.max()), round(float(tokens.mean()), 1),
            examples(truncated)]
    problems = []
    t = table.combine_chunks()
    n_tok = t.column("num_tokens").to_numpy()
    for name in ("input_ids", "loss_mask"):
        lengths = pc.list_value_length(t.column(name)).to_numpy()
        if not np.array_equal(lengths, n_tok):
            problems.append(name)
    mask_col = t.column("loss_mask").chunk(0)
    flat = mask_col.flatten().to_numpy()
    if flat.size and flat.max() > 1:
        problems.append("mask values")
    offsets = mask_col.offsets.to_numpy()
    offsets = offsets - offsets[0]
    cumsum = np.concatenate([[0], np.cumsum(flat, dtype=np.int64)])
    sums = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
    n_loss = t.column("num_loss_tokens").to_numpy()
    if not np.array_equal(sums, n_loss):
        problems.append("sums")
    if (n_loss <= 0).any():
        problems.append("no loss")
    keys = pc.binary_join_element_wise(t.column("prompt_id"), pc.cast(t.column("turn_index"), pa.string()), "\x00")
    if pc.count_distinct(keys).as_py() != t.num_rows:
        problems.append("unique")
    return out + [problems]


def before_turn_counts(rows: list[dict], thinking: bool = True) -> tuple:
    finish: dict[str, int] = {}
    empty_content = empty_reasoning = turns = 0
    for row in rows:
        for reason in row["finish_reasons"]:
            finish[reason] = finish.get(reason, 0) + 1
        for m in row["messages"]:
            if m["role"] != "assistant":
                continue
            turns += 1
            empty_content += not (m["content"] or "").strip() and not m.get("tool_calls")
            empty_reasoning += thinking and not (m["reasoning_content"] or "").strip()
    return finish, empty_content, empty_reasoning, turns


def before_response_lengths(table: pa.Table) -> dict:
    from dflash_assets.chart_data import binned_counts
    from dflash_assets.generation.completions import response_length_bin_edges

    per_turn = [n for turns in table.column("completion_tokens").to_pylist() for n in (turns or [])]
    return binned_counts(per_turn, response_length_bin_edges(2048))


def before_measure(paths: list[Path]) -> tuple:
    shards = prompts = turns = out_tokens = in_tokens = at_cap = sample_tokens = 0
    for path in paths:
        t = pq.read_table(path, columns=["num_turns", "completion_tokens", "prompt_tokens", "finish_reasons"])
        shards += 1
        prompts += t.num_rows
        turns += int(pc.sum(t.column("num_turns")).as_py() or 0)
        out_tokens += int(pc.sum(pc.list_flatten(t.column("completion_tokens"))).as_py() or 0)
        in_tokens += int(pc.sum(pc.list_flatten(t.column("prompt_tokens"))).as_py() or 0)
        at_cap += int(pc.sum(pc.equal(pc.list_flatten(t.column("finish_reasons")), "length")).as_py() or 0)
        per_row = np.zeros(t.num_rows, np.int64)
        for name in ("prompt_tokens", "completion_tokens"):
            for chunk in [t.column(name).combine_chunks()]:
                lengths = pc.fill_null(pc.list_value_length(chunk), 0).to_numpy(zero_copy_only=False)
                values = pc.list_flatten(chunk).to_numpy(zero_copy_only=False)
                ends = np.cumsum(lengths) - 1
                per_row += np.where(lengths > 0, values[np.maximum(ends, 0)] if len(values) else 0, 0)
        sample_tokens += int(per_row.sum())
        del t
    return shards, prompts, turns, out_tokens, in_tokens, at_cap, sample_tokens


# -- the library's (after) --------------------------------------------------------------------------------


def after_quality(table: pa.Table) -> list:
    from dflash_assets.tokenization.quality import QualityThresholds, evaluate_quality

    return [o.passed for o in evaluate_quality(table, QualityThresholds()).values()]


def after_measure(paths: list[Path]) -> dict:
    from dflash_assets.planning.measurements import completion_sums

    return completion_sums(paths)


# -- one child: load, run, measure ------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(data: Path, computation: str, impl: str, inner: int) -> dict:
    import polars as pl  # imported before the baseline in both arms: the library imports it anyway

    from dflash_assets.generation import completions as C

    paths = sorted(data.glob("completions-*.parquet"))
    if computation == "quality_checks":
        arg = pq.read_table(data / "samples.parquet")
        run = (lambda: before_quality(arg)) if impl == "before" else (lambda: after_quality(arg))
    elif computation == "turn_counts":
        table = pa.concat_tables(pq.read_table(p) for p in paths)
        arg = table.to_pylist() if impl == "before" else table
        run = (lambda: before_turn_counts(arg)) if impl == "before" else (lambda: C.turn_counts(arg, True))
    elif computation == "response_lengths":
        arg = pa.concat_tables(pq.read_table(p, columns=["completion_tokens"]) for p in paths)
        run = (lambda: before_response_lengths(arg)) if impl == "before" else (
            lambda: C.response_length_histogram(arg, 2048))
    else:
        run = (lambda: before_measure(paths)) if impl == "before" else (lambda: after_measure(paths))
    # polars' runtime (thread pool, allocator arenas) and pyarrow.compute's kernels are warmed in both arms: the
    # code location runs both anyway
    pl.DataFrame({"a": [[1, 2]], "s": ["x"]}).lazy().select(pl.col("a").explode().sum(), pl.col("s").str.contains("^x$")
                                                            ).collect(engine="streaming")
    warm = pc.list_flatten(pa.array([[{"role": "a", "content": " "}]]))
    pc.sum(pc.and_(pc.fill_null(pc.equal(pc.struct_field(warm, "role"), "a"), False),
                   pc.match_substring_regex(pc.struct_field(warm, "content"), "^ *$")))
    pc.value_counts(pa.array(["x"])).to_pylist()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here: loading is not counted
    base = _rss_kib("VmRSS")
    best, result = float("inf"), None
    for _ in range(inner):
        t0 = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t0)
    return {"s": best, "rss_rise_mib": round((_rss_kib("VmHWM") - base) / 1024, 1), "result": repr(result)[:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inner", type=int, default=3, help="runs per child (its best is kept)")
    ap.add_argument("--child", nargs=3, metavar=("DATA", "COMPUTATION", "IMPL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.child[2], args.inner)))
        return
    import polars as pl

    report: dict = {"machine": {**machine_info("polars", "pyarrow", "numpy"), "polars_threads": pl.thread_pool_size()},
                    "rows": args.rows, "repeats": args.repeats, "inner": args.inner, "results": {}}
    with tempfile.TemporaryDirectory(prefix="table-work-") as tmp:
        data = Path(tmp)
        t0 = time.perf_counter()
        build(data, args.rows)
        report["build_s"] = round(time.perf_counter() - t0, 1)
        runs: dict = {c: {"before": [], "after": []} for c in COMPUTATIONS}
        for _ in range(args.repeats):
            for c in COMPUTATIONS:
                for impl in ("before", "after"):
                    out = subprocess.run([sys.executable, __file__, "--inner", str(args.inner), "--child", str(data), c,
                                          impl], capture_output=True, text=True, check=True)
                    runs[c][impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for c, r in runs.items():
        b, a = min(x["s"] for x in r["before"]), min(x["s"] for x in r["after"])
        report["results"][c] = {
            "before_s": round(b, 4), "after_s": round(a, 4), "speedup": round(b / a, 2),
            "before_rss_rise_mib": max(x["rss_rise_mib"] for x in r["before"]),
            "after_rss_rise_mib": max(x["rss_rise_mib"] for x in r["after"]),
            "before_result": r["before"][0]["result"], "after_result": r["after"][0]["result"]}
    report["machine"]["loadavg_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
