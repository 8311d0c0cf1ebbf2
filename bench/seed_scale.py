#!/usr/bin/env python
"""Seed scale: a synthetic ShareGPT-shaped corpus through ingest -> raw_prompts -> completions -> tokenized_samples.

Prints one JSON object (also written to ``--out``): wall time, CPU time and
peak RSS of every stage at every corpus size, on the local store and on S3
(moto's server on 127.0.0.1, in its own process), plus flags for a stage over
2 GiB peak RSS and for time per conversation that is not flat (more than 20%
above the smallest size's).

The corpus is generated on the fly, streamed to a zstd-compressed JSON array
(never held in memory): each conversation copies the shape of a random record
of the embedded ShareGPT file (its roles in order and each turn's length in
characters), so turn counts, lengths and their joint distribution are the
file's; the text is a slice of the file's own text at a random offset, after a
prefix that makes every conversation unique. Records the ingest quarantines
(empty conversations, oversize turns, ...) keep their real share.

Every stage runs in its own process (``--stage``): wall and CPU time from the
parent (``os.wait4``), peak RSS from the child's own ``VmHWM`` (its peak since
exec; ``ru_maxrss`` would include the parent's RSS at fork). Results go to
``--out`` after every stage, so a run cut short keeps what it measured:

  synth              write the source (not a pipeline stage; once per size)
  ingest             ingest_prompt_source (the source read from the store's side: a file, or s3://)
  raw_prompts        materialize_prompt_shard for every shard, one process for all (a backfill batch)
  completions        regenerate_shard for every shard against the SGLang-shaped loopback server
                     (its own process, answering at once; reasoning/content lengths drawn from
                     --reasoning-tokens/--content-tokens), with the Qwen3.6 tokenizer
  tokenized_samples  tokenize_completions + publish_samples (quality gate) for every shard

The loopback server's own CPU and memory are not in the completions figures;
on a 2-core machine it competes with the client for the cores.

  .venv/bin/python bench/seed_scale.py --sizes 1000                     # a smoke run, ~1 min
  .venv/bin/python bench/seed_scale.py --sizes 10000 100000 --out seed_scale.json
  .venv/bin/python bench/seed_scale.py --sizes 914000 --backends local  # the seed's size (hours on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_assets.atomic_write import write_atomic  # noqa: E402

TARGET = "/models/Qwen3.6-27B"  # the name the loopback serves; nothing is loaded from it
STAGES = ("ingest", "raw_prompts", "completions", "tokenized_samples")
RSS_LIMIT_MIB = 2048
FLAT_TOLERANCE = 0.20


# --- the synthetic corpus ----------------------------------------------------------------------


def sharegpt_shapes() -> tuple[list[list[tuple[str, int]]], str]:
    """(role, chars) of every turn of every record of the embedded file, and a pool of its text."""
    from dflash_assets.prompts.sources import sharegpt_records

    shapes, pool, pool_chars = [], [], 0
    for r in sharegpt_records():
        turns = r.get("conversations") or []
        shapes.append([(str(t.get("from", "")), len(t.get("value") or "")) for t in turns if isinstance(t, dict)])
        if pool_chars < 16_000_000:
            for t in turns:
                if isinstance(t, dict) and isinstance(t.get("value"), str):
                    pool.append(t["value"])
                    pool_chars += len(t["value"])
    return shapes, "\n".join(pool)


def shape_summary(shapes: list[list[tuple[str, int]]]) -> dict:
    import statistics

    users = [sum(1 for role, _ in s if role in ("human", "user")) for s in shapes]
    user_chars = [n for s in shapes for role, n in s if role in ("human", "user")]
    other_chars = [n for s in shapes for role, n in s if role not in ("human", "user")]
    return {"records": len(shapes), "user_turns_mean": round(statistics.mean(users), 3),
            "user_turns_median": statistics.median(users), "user_turns_max": max(users),
            "user_turn_chars_mean": round(statistics.mean(user_chars), 1),
            "user_turn_chars_median": statistics.median(user_chars),
            "assistant_turn_chars_mean": round(statistics.mean(other_chars), 1)}


def write_source(path: Path, n: int, seed: int = 0) -> dict:
    """Stream ``n`` synthetic records as a zstd-compressed JSON array to ``path``."""
    import zstandard

    shapes, pool = sharegpt_shapes()
    rng = random.Random(seed)
    span = len(pool)
    dumps = json.JSONEncoder(ensure_ascii=False).encode
    raw_bytes = 0
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
        out.write(b"[\n")
        for i in range(n):
            turns = []
            for j, (role, chars) in enumerate(shapes[rng.randrange(len(shapes))]):
                head = f"[{i}.{j}] "
                body = max(chars - len(head), 0)
                start = rng.randrange(span - body) if body < span else 0
                turns.append({"from": role, "value": head + pool[start:start + body] if chars else ""})
            data = dumps({"id": f"synth-{i}", "conversations": turns}).encode()
            if i:
                out.write(b",\n")
            out.write(data)
            raw_bytes += len(data) + 2
        out.write(b"\n]\n")
    return {"records": n, "raw_bytes": raw_bytes, "file_bytes": path.stat().st_size}


# --- stages (each runs in its own process) -------------------------------------------------------


def _open(store_uri: str, endpoint: str | None):
    from dflash_assets.store.backends import open_store

    return open_store(store_uri, endpoint_url=endpoint or None)


def stage_ingest(args) -> dict:
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source

    store = _open(args.store, args.s3_endpoint)
    r = ingest_prompt_source(args.source, store, IngestConfig(source_name="synth"))
    return {"records_read": r.records_read, "valid": r.valid, "duplicates": r.duplicates,
            "quarantined": r.quarantined, "shards": len(r.shard_keys)}


def stage_raw_prompts(args) -> dict:
    from dflash_assets.prompts.corpus import list_shard_keys
    from dflash_assets.prompts.shards import materialize_prompt_shard

    store = _open(args.store, args.s3_endpoint)
    prompts = turns = 0
    for shard in list_shard_keys(store):
        _, stats = materialize_prompt_shard(store, shard)
        prompts += stats.num_prompts
        turns += stats.num_user_turns
    return {"prompts": prompts, "user_turns": turns}


def stage_completions(args) -> dict:
    from dflash_assets.generation.completions import GenerationConfig, regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.prompts.corpus import list_shard_keys
    from dflash_assets.store import layout
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer
    from tests.support.sglang_loopback import LoopbackProcess

    store = _open(args.store, args.s3_endpoint)
    tok = build_qwen3_6_tokenizer()
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns)
    out = {"conversations": 0, "requests": 0, "completion_tokens": 0, "failed": 0}
    flags = ["--model-path", TARGET, "--reasoning-tokens", *map(str, args.reasoning_tokens),
             "--content-tokens", *map(str, args.content_tokens)]
    with LoopbackProcess(*flags) as srv:
        fleet = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=srv.url,
                                                                                 max_concurrency=args.concurrency)])
        for shard in list_shard_keys(store):
            prompts = store.read_parquet(layout.raw_prompts(shard))
            res = regenerate_shard(prompts, shard=shard, store=store, fleet=fleet, generation=gen, tokenizer=tok,
                                   progress_interval_s=60.0, flush_every=256, max_failed_ratio=1.0)
            out["conversations"] += res.stats.prompts_done
            out["requests"] += res.stats.requests
            out["completion_tokens"] += res.stats.completion_tokens
            out["failed"] += res.failed.num_rows
            del prompts, res
    return out


def stage_tokenized_samples(args) -> dict:
    from dflash_assets.prompts.corpus import list_shard_keys
    from dflash_assets.store import layout
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer
    from dflash_assets.tokenization.encoder import qwen3_6_encoder
    from dflash_assets.tokenization.quality import publish_samples
    from dflash_assets.tokenization.samples import TokenizeConfig, tokenize_completions

    store = _open(args.store, args.s3_endpoint)
    enc = qwen3_6_encoder(build_qwen3_6_tokenizer(), strict=True)
    out = {"samples": 0, "tokens": 0, "loss_tokens": 0, "gates_passed": 0, "shards": 0}
    for shard in list_shard_keys(store):
        table, stats = tokenize_completions(store.read_parquet(layout.completions(shard)), enc, TokenizeConfig())
        published = publish_samples(store, shard, table)
        out["samples"] += stats.samples
        out["tokens"] += stats.tokens
        out["loss_tokens"] += stats.loss_tokens
        out["shards"] += 1
        out["gates_passed"] += all(o.passed for o in published.outcomes.values())
        del table
    return out


def stage_synth(args) -> dict:
    return write_source(Path(args.source), args.size)


STAGE_FUNCS = {"synth": stage_synth, "ingest": stage_ingest, "raw_prompts": stage_raw_prompts,
               "completions": stage_completions, "tokenized_samples": stage_tokenized_samples}


# --- the parent: one process per stage, measured ---------------------------------------------------


def _peak_rss_kib() -> int:
    """This process's peak RSS since its exec (VmHWM; ru_maxrss would include the parent's RSS at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_stage(stage: str, size: int, store: str, source: str, s3_endpoint: str | None, args) -> dict:
    """Run ``stage`` in a child process; wall time, CPU time and peak RSS from ``os.wait4``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--size", str(size),
            "--store", store, "--source", source, "--max-new-tokens", str(args.max_new_tokens),
            "--max-turns", str(args.max_turns), "--concurrency", str(args.concurrency),
            "--reasoning-tokens", *map(str, args.reasoning_tokens), "--content-tokens", *map(str, args.content_tokens)]
    if s3_endpoint:
        argv += ["--s3-endpoint", s3_endpoint]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = proc.stdout.read().strip().splitlines() if proc.stdout else []
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    peak_kib = result.pop("_peak_rss_kib", None) or usage.ru_maxrss
    out = {"wall_s": round(wall, 2), "stage_s": result.pop("_stage_s", None),
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_mib": round(peak_kib / 1024, 1),
           "ms_per_conversation": round(wall / size * 1000, 4), "exit_code": proc.returncode, **result}
    print(f"  {stage:18s} {size:>8d}  {out['wall_s']:8.1f} s  {out['peak_rss_mib']:8.1f} MiB  "
          f"rc={proc.returncode}", file=sys.stderr, flush=True)
    return out


class MotoProcess:
    """moto's S3 server on 127.0.0.1 in its own process (its memory is not in any stage's figures)."""

    def __enter__(self) -> "MotoProcess":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def flags(results: dict) -> list[str]:
    out = []
    for backend, by_size in results.items():
        sizes = sorted(by_size, key=int)
        for size in sizes:
            for stage, r in by_size[size].items():
                if r["peak_rss_mib"] > RSS_LIMIT_MIB:
                    out.append(f"{backend} {stage} at {size}: peak RSS {r['peak_rss_mib']} MiB > {RSS_LIMIT_MIB} MiB")
                if r.get("exit_code"):
                    out.append(f"{backend} {stage} at {size}: exit code {r['exit_code']}")
        base = sizes[0]
        for size in sizes[1:]:
            for stage, r in by_size[size].items():
                b = by_size[base].get(stage)
                if b and b["ms_per_conversation"] and r["ms_per_conversation"] > b["ms_per_conversation"] * (
                        1 + FLAT_TOLERANCE):
                    out.append(f"{backend} {stage}: {r['ms_per_conversation']} ms/conversation at {size} vs "
                               f"{b['ms_per_conversation']} at {base} (+{r['ms_per_conversation'] / b['ms_per_conversation'] - 1:.0%})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--reasoning-tokens", type=int, nargs=2, default=[100, 600],
                    help="loopback reasoning length range per turn (tokens)")
    ap.add_argument("--content-tokens", type=int, nargs=2, default=[50, 400],
                    help="loopback answer length range per turn (tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed after)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    # child mode
    ap.add_argument("--stage", default=None, choices=list(STAGE_FUNCS), help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--source", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--s3-endpoint", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.stage:
        t0 = time.perf_counter()
        result = STAGE_FUNCS[args.stage](args)
        result["_stage_s"] = round(time.perf_counter() - t0, 2)
        result["_peak_rss_kib"] = _peak_rss_kib()
        print(json.dumps(result), flush=True)
        return

    from bench.machine import machine_info

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dflash-seed-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes, _ = sharegpt_shapes()
    report: dict = {"machine": machine_info("pyarrow", "boto3", "moto", "tokenizers"),
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "config": {k: getattr(args, k) for k in ("sizes", "backends", "stages", "reasoning_tokens",
                                                               "content_tokens", "max_new_tokens", "max_turns",
                                                               "concurrency")},
                    "sharegpt_shapes": shape_summary(shapes), "synth": {}, "results": {}}
    del shapes
    try:
        for size in args.sizes:
            source = work / f"synth-{size}.json.zst"
            print(f"synth {size}", file=sys.stderr, flush=True)
            report["synth"][str(size)] = run_stage("synth", size, "", str(source), None, args)
            for backend in args.backends:
                print(f"{backend} {size}", file=sys.stderr, flush=True)
                by_stage = report["results"].setdefault(backend, {}).setdefault(str(size), {})
                if backend == "local":
                    store = work / f"store-local-{size}"
                    shutil.rmtree(store, ignore_errors=True)
                    for stage in args.stages:
                        by_stage[stage] = run_stage(stage, size, str(store), str(source), None, args)
                        _save(report, args.out)
                    shutil.rmtree(store, ignore_errors=True)
                else:
                    with MotoProcess() as moto:
                        moto.client.create_bucket(Bucket="sources")
                        moto.client.create_bucket(Bucket="store")
                        moto.client.upload_file(str(source), "sources", source.name)
                        for stage in args.stages:
                            by_stage[stage] = run_stage(stage, size, f"s3://store/seed-{size}",
                                                        f"s3://sources/{source.name}", moto.url, args)
                            _save(report, args.out)
            source.unlink(missing_ok=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    _save(report, args.out)
    print(json.dumps(report, indent=2))


def _save(report: dict, out: str | None) -> None:
    report["flags"] = flags(report["results"])
    if out:
        write_atomic(out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
