"""The real sglang-router (0.3.2, from the `router` extra) in front of two loopback engines on 127.0.0.1: a
completions partition through it, a worker killed mid-partition, every worker gone, a worker of another model.
Also the router's command line, its worker list and its "no worker" answers, read as the fleet reads them."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from dflash_assets.generation.completions import aregenerate_shard, regenerate_shard
from dflash_assets.generation.engines import EngineError, GenerationConfig
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, NoEngineAvailable, probe_fleet
from dflash_assets.generation.router import (
    RouterProcess,
    parse_router_workers,
    router_command,
    router_has_no_worker,
)
from dflash_assets.store.backends import LocalStore
from tests.support.sglang_loopback import LoopbackProcess, LoopbackServer


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


def prompts(n: int, turns: int = 2) -> list[dict]:
    return [{"prompt_id": f"p{i:04d}", "system": "Be brief." if i % 3 == 0 else None,
             "user_turns": [f"question {i} part {t}" for t in range(turns)]} for i in range(n)]


def worker(model_dir, delay_s: float = 0.05) -> LoopbackProcess:
    """One engine answering as SGLang does, on a local model directory (the router loads its tokenizer)."""
    return LoopbackProcess("--model-path", str(model_dir), "--delay-s", str(delay_s))


def fleet_config(target, url: str, concurrency: int = 8) -> EngineFleetConfig:
    return EngineFleetConfig(target_model=str(target), backoff_initial_s=0.05, backoff_max_s=0.2,
                             endpoints=[EndpointConfig(url=url, kind="sglang", max_concurrency=concurrency)])


def expected_rows(tok, target, rows, gen, tmp_path) -> dict[str, list]:
    """The same shard on one undisturbed engine, no router: the deterministic reference."""
    with LoopbackServer(model_path=str(target)) as ref:
        res = regenerate_shard(rows, shard="ref", store=LocalStore(tmp_path / "ref"),
                               fleet=fleet_config(target, ref.url), generation=gen, tokenizer=tok)
    return {r["prompt_id"]: r["messages"] for r in res.table.to_pylist()}


async def generate_requests(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/loopback/stats") as r:
        return (await r.json())["generate_requests"]


def test_a_partition_runs_through_the_router_over_both_workers(tok, tiny_dense_target, local_store, tmp_path):
    rows, gen = prompts(24), GenerationConfig(max_new_tokens=64, stop_after_truncated_turn=False)
    with worker(tiny_dense_target) as a, worker(tiny_dense_target) as b, RouterProcess([a.url, b.url]) as router:
        cfg = fleet_config(tiny_dense_target, router.url)
        probe = probe_fleet(cfg, tok)
        res = regenerate_shard(rows, shard="r", store=local_store, fleet=cfg, generation=gen, tokenizer=tok)
        served = [asyncio.run(generate_requests(w.url)) for w in (a, b)]
    (row,) = probe.rows
    assert row.status == "ok" and row.detail == "router: 2 of 2 workers healthy"
    assert [(w.worker, w.status) for w in probe.workers] == sorted([(a.url, "ok"), (b.url, "ok")])  # by URL
    assert "workers behind routers" in probe.markdown() and f"| {router.url} | {b.url} |" in probe.markdown()
    got = res.table.to_pylist()
    assert len(got) == 24 and res.failed.num_rows == 0
    assert all(r["turn_endpoints"] == [router.url] * 2 for r in got)  # one endpoint to the fleet ...
    assert sum(served) == res.stats.requests == 48 and min(served) >= 20  # ... round robin over both workers
    assert {r["prompt_id"]: r["messages"] for r in got} == expected_rows(tok, tiny_dense_target, rows, gen, tmp_path)


def test_worker_killed_mid_partition_loses_and_duplicates_nothing(tok, tiny_dense_target, local_store, tmp_path):
    rows, gen = prompts(48), GenerationConfig(max_new_tokens=64, stop_after_truncated_turn=False)
    with worker(tiny_dense_target) as a, worker(tiny_dense_target) as b, RouterProcess([a.url, b.url]) as router:
        cfg = fleet_config(tiny_dense_target, router.url)

        async def scenario():
            run = asyncio.ensure_future(aregenerate_shard(rows, shard="k", store=local_store, fleet=cfg,
                                                          generation=gen, tokenizer=tok, flush_every=8))
            while await generate_requests(b.url) < 12:  # b has answered some and holds more in flight
                await asyncio.sleep(0.02)
            b.kill()
            return await run

        res = asyncio.run(scenario())
        after = asyncio.run(generate_requests(a.url))
    got = res.table.to_pylist()
    assert len(got) == 48 and len({r["prompt_id"] for r in got}) == 48 and res.failed.num_rows == 0
    assert not res.stats.endpoints[router.url]["dead"]
    assert after >= 96 - res.stats.requests // 2  # the survivor took over b's share
    # the conversations are exactly those of an undisturbed run: no turn lost, none answered twice
    assert {r["prompt_id"]: r["messages"] for r in got} == expected_rows(tok, tiny_dense_target, rows, gen, tmp_path)
    assert all(r["num_turns"] == 2 for r in got)


def test_every_worker_gone_fails_fast_with_the_probe_table(tok, tiny_dense_target, local_store):
    rows, gen = prompts(40, turns=1), GenerationConfig(max_new_tokens=64)
    with worker(tiny_dense_target) as a, worker(tiny_dense_target) as b, RouterProcess([a.url, b.url]) as router:
        cfg = fleet_config(tiny_dense_target, router.url, concurrency=4)

        async def scenario():
            run = asyncio.ensure_future(aregenerate_shard(rows, shard="d", store=local_store, fleet=cfg,
                                                          generation=gen, tokenizer=tok, flush_every=2))
            while len(local_store.list("completions/_journal/d")) < 2:
                await asyncio.sleep(0.02)
            a.kill()
            b.kill()
            t0 = time.perf_counter()
            try:
                await run
            finally:
                scenario.took = time.perf_counter() - t0

        with pytest.raises(NoEngineAvailable, match="every endpoint died mid-run") as mid_run:
            asyncio.run(scenario())
        assert scenario.took < 10  # three "no worker" answers exclude the router; no request waits out its retries
        t0 = time.perf_counter()
        with pytest.raises(NoEngineAvailable, match="no endpoint serves the target") as at_start:
            regenerate_shard(rows, shard="d", store=local_store, fleet=cfg, generation=gen, tokenizer=tok)
        assert time.perf_counter() - t0 < 10
    for err in (mid_run, at_start):
        msg = str(err.value)
        assert "| endpoint | kind | served model |" in msg and router.url in msg
        assert f"| {router.url} | {a.url} |" in msg and f"| {router.url} | {b.url} |" in msg
    assert "call_upstream_request_error" in str(mid_run.value) or "no_available_workers" in str(mid_run.value)
    assert at_start.value.probe.rows[0].status in ("unreachable", "unhealthy")
    assert len(local_store.list("completions/_journal/d")) >= 2  # what was done is kept for the next run


def test_a_worker_of_another_model_refuses_the_router(tok, tiny_dense_target, tiny_hybrid_target, local_store):
    with worker(tiny_dense_target) as a, worker(tiny_hybrid_target) as other, \
            RouterProcess([a.url, other.url]) as router:
        cfg = fleet_config(tiny_dense_target, router.url)
        t0 = time.perf_counter()
        with pytest.raises(NoEngineAvailable) as info:
            regenerate_shard(prompts(4), shard="w", store=local_store, fleet=cfg, generation=GenerationConfig(),
                             tokenizer=tok)
        assert time.perf_counter() - t0 < 10
        assert asyncio.run(generate_requests(a.url)) == asyncio.run(generate_requests(other.url)) == 0
    probe = info.value.probe
    (row,) = probe.rows
    assert row.status == "wrong_model" and f"worker {other.url} serves {tiny_hybrid_target}" in row.detail
    assert {w.worker: w.status for w in probe.workers} == {a.url: "ok", other.url: "wrong_model"}
    assert not local_store.exists("completions/w.parquet")


def test_router_command_binds_the_loopback_with_its_metrics():
    argv = router_command(["http://127.0.0.1:1/", "http://127.0.0.1:2"], port=30000, health_check_interval_s=5)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    assert argv[argv.index("--worker-urls") + 1: argv.index("--policy")] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--prometheus-host") + 1] == argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--health-check-interval-secs") + 1] == "5"
    with pytest.raises(ValueError, match="at least one worker"):
        router_command([])


@pytest.mark.parametrize("reply,expected", [
    ({"workers": [{"url": "http://w:1", "model_id": "/m/A", "is_healthy": True, "load": 3,
                   "metadata": {"served_model_name": "a", "model_path": "/m/A"}}]}, [("http://w:1", ("/m/A", "a"), True, 3)]),
    ({"workers": [{"url": "http://w:1", "model_id": "", "is_healthy": "yes"}]}, [("http://w:1", (), False, None)]),
    ({"workers": []}, []),
    ({"detail": "Not Found"}, None),
    ({"workers": [{"model_id": "x"}]}, None),
    ([1, 2], None),
])
def test_worker_list_is_read_or_recognized_as_not_a_router(reply, expected):
    got = parse_router_workers(reply)
    assert (None if got is None else [(w.url, w.names, w.healthy, w.load) for w in got]) == expected


@pytest.mark.parametrize("status,body,expected", [
    (500, '{"error":{"type":"Internal Server Error","code":"call_upstream_request_error","message":"x"}}', True),
    (503, '{"error":{"type":"Service Unavailable","code":"no_available_workers","message":"x"}}', True),
    (500, '{"error":{"message":"CUDA out of memory"}}', False),
    (400, '{"error":{"code":"call_upstream_request_error"}}', False),
])
def test_router_no_worker_answers_are_recognized(status, body, expected):
    err = EngineError(f"POST http://r/generate: HTTP {status}: {body}", status=status, retryable=True)
    assert router_has_no_worker(err) is expected
