"""The generation client through sglang-router against direct connections to the same engines. Prints one JSON object.

Two engines (``tests.support.sglang_loopback``, each in its own
process, answering after ``--delay-s``, on the tiny target's directory so the
router loads its tokenizer locally) and the real sglang-router 0.3.2
(``--policy round_robin``) in front of them. The client is the fleet
(``EngineFleet.run``, SGLang native kind: each prompt rendered and tokenized
here) with one request per task, timed around ``engine.chat``; the CPU each
process spent per request (client, both engines, router) beside it:

- direct: two endpoints, ``--concurrency / 2`` requests in flight on each;
- router: one endpoint (the router's URL), ``--concurrency`` in flight.

Same prompts, same concurrency, in one run: ``--rounds`` rounds alternating
which path goes first, after a warm-up of each; requests/s and client-side
p50/p99 latency per round, their medians, and how many requests each engine
answered.

Usage: .venv/bin/python bench/router_overhead.py [--requests 3000] [--concurrency 64] [--rounds 4] [--delay-s 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info, print_report  # noqa: E402
from dflash_assets.generation.engines import Engine, GenerationConfig  # noqa: E402
from dflash_assets.generation.fleet import EndpointConfig, EngineFleet, EngineFleetConfig, run_sync  # noqa: E402
from dflash_assets.generation.router import RouterProcess  # noqa: E402
from tests.support.sglang_loopback import LoopbackProcess  # noqa: E402


class OneTurn:
    """A task of one request; keeps the client-side latency of its successful request."""

    def __init__(self, key: str, text: str, gen: GenerationConfig):
        self.key, self.gen = key, gen
        self.messages = [{"role": "user", "content": text}]
        self.latency_s = 0.0

    async def step(self, engine: Engine):
        t0 = time.perf_counter()
        result = await engine.chat(self.messages, self.gen)
        self.latency_s = time.perf_counter() - t0
        return True, result


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process so far: ours (None) or another's, from /proc."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/loopback/stats", timeout=10) as r:
        return json.loads(r.read())["generate_requests"]


async def one_run(cfg: EngineFleetConfig, tokenizer, n: int, gen: GenerationConfig, offset: int) -> dict:
    tasks = [OneTurn(f"t{i}", f"Question number {offset + i}: explain speculative decoding in one line.", gen)
             for i in range(n)]
    failed: list[str] = []
    async with EngineFleet(cfg, tokenizer) as fleet:
        t0 = time.perf_counter()
        stats = await fleet.run(tasks, on_failed=lambda task, reason, errors: failed.append(reason))
        wall = time.perf_counter() - t0
    assert not failed and stats.done == n, failed[:3]
    lat = sorted(t.latency_s for t in tasks)
    return {"requests": n, "wall_s": round(wall, 3), "req_per_s": round(n / wall, 1),
            "p50_ms": round(percentile(lat, 0.50) * 1000, 2), "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
            "retries": stats.retries}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per path per round")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in all, on either path")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--delay-s", type=float, default=0.02, help="each engine's time per request (stands for a GPU's)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from dflash_assets.embedded.tiny_targets import tiny_target_path

    target = tiny_target_path("dense")
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    engine_args = ("--model-path", str(target), "--delay-s", str(args.delay_s))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report: dict = {"machine": machine_info("sglang-router", "aiohttp", "uvloop"), "commit": commit,
                    "requests": args.requests, "concurrency": args.concurrency, "engines": 2,
                    "engine_delay_s": args.delay_s, "max_new_tokens": args.max_new_tokens}
    with LoopbackProcess(*engine_args) as a, LoopbackProcess(*engine_args) as b, \
            RouterProcess([a.url, b.url], policy="round_robin") as router:
        half = max(1, args.concurrency // 2)
        paths = {
            "direct": EngineFleetConfig(target_model=str(target), endpoints=[
                EndpointConfig(url=a.url, max_concurrency=half), EndpointConfig(url=b.url, max_concurrency=half)]),
            "router": EngineFleetConfig(target_model=str(target), endpoints=[
                EndpointConfig(url=router.url, max_concurrency=2 * half)]),
        }
        report["router_command"] = router.command
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for name, cfg in paths.items():  # warm-up: connections, the tokenizer's caches, the router's pools
            run_sync(one_run(cfg, tokenizer, min(500, args.requests), gen, 0))
        time.sleep(2.0)  # the router finishes its own work on the warm-up before the first counted round
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                before = (served(a.url), served(b.url))
                cpu0 = [cpu_s(), cpu_s(a.pid), cpu_s(b.pid), cpu_s(router.proc.pid)]
                res = run_sync(one_run(paths[name], tokenizer, args.requests, gen, (r + 1) * args.requests))
                cpu = [(x - y) / args.requests * 1e6 for x, y in zip(
                    [cpu_s(), cpu_s(a.pid), cpu_s(b.pid), cpu_s(router.proc.pid)], cpu0)]
                res["cpu_us_per_request"] = {"client": round(cpu[0]), "engines": round(cpu[1] + cpu[2]),
                                             "router": round(cpu[3])}
                res["per_engine"] = [served(a.url) - before[0], served(b.url) - before[1]]
                runs[name].append(res)
    report["machine"]["loadavg_1_5_15_after"] = machine_info()["loadavg_1_5_15"]
    for name, results in runs.items():
        report[name] = {"rounds": results, **{f"{k}_median": statistics.median(x[k] for x in results)
                                              for k in ("req_per_s", "p50_ms", "p99_ms")},
                        "cpu_us_per_request_median": {part: statistics.median(x["cpu_us_per_request"][part]
                                                                              for x in results)
                                                      for part in ("client", "engines", "router")}}
    report["router_over_direct"] = {
        "req_per_s": round(report["router"]["req_per_s_median"] / report["direct"]["req_per_s_median"], 3),
        "p50": round(report["router"]["p50_ms_median"] / report["direct"]["p50_ms_median"], 3),
        "p99": round(report["router"]["p99_ms_median"] / report["direct"]["p99_ms_median"], 3)}
    print_report(report, args.out)


if __name__ == "__main__":
    main()
