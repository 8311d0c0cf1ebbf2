"""The fleet: probe table, refusal of wrong models, NoEngineAvailable, retries, failover when an
endpoint is SIGKILLed mid-partition, and the measured wall-time estimate. Real HTTP servers only."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from dflash_assets.generation.completions import TooManyFailedPrompts, aregenerate_shard, regenerate_shard
from dflash_assets.generation.engines import decoding_over_run
from dflash_assets.generation.fleet import (
    EndpointConfig,
    EngineFleetConfig,
    NoEngineAvailable,
    probe_fleet,
    serves_target,
)
from dflash_assets.generation.engines import GenerationConfig
from dflash_assets.planning.measurements import estimate_generation_time, format_duration, plan_generation
from tests.support.sglang_loopback import LoopbackProcess, LoopbackServer
from dflash_assets.store.backends import LocalStore
from tests.ports import free_port

TARGET = "/models/Qwen3.6-27B"


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


def dead_port() -> int:
    return free_port()  # nobody listens on it


def prompts(n: int, turns: int = 2) -> list[dict]:
    return [{"prompt_id": f"p{i:04d}", "system": "Be brief." if i % 3 == 0 else None,
             "user_turns": [f"question {i} part {t}" for t in range(turns)]} for i in range(n)]


@pytest.mark.parametrize("served,alias,expected", [
    (["/models/Qwen3.6-27B"], None, "/models/Qwen3.6-27B"),
    (["Qwen/Qwen3.6-27B"], None, "Qwen/Qwen3.6-27B"),
    (["qwen3.6-27b"], None, "qwen3.6-27b"),
    (["/models/Qwen3-8B"], None, None),
    (["prod-drafter-target"], None, None),
    (["prod-drafter-target"], "prod-drafter-target", "prod-drafter-target"),
    (["other", "/m/Qwen3.6-27B"], None, "/m/Qwen3.6-27B"),
])
def test_serves_target(served, alias, expected):
    assert serves_target(served, TARGET, alias) == expected


def test_probe_table_refuses_wrong_model_and_reports_unreachable(tok):
    with LoopbackServer(model_path=TARGET) as good, LoopbackServer(model_path="/models/Llama-3-8B") as wrong, \
            LoopbackServer(model_path="/x/y", served_model_name="prod-target") as aliased:
        down = f"http://127.0.0.1:{dead_port()}"
        cfg = EngineFleetConfig(target_model=TARGET, probe_timeout_s=3, endpoints=[
            EndpointConfig(url=good.url, kind="sglang"), EndpointConfig(url=wrong.url, kind="sglang"),
            EndpointConfig(url=down, kind="openai"),
            EndpointConfig(url=aliased.url, kind="openai", served_model_name="prod-target")])
        probe = probe_fleet(cfg, tok)
    by_url = {r.endpoint: r for r in probe.rows}
    assert by_url[good.url].status == "ok" and by_url[good.url].latency_ms > 0
    assert by_url[wrong.url].status == "wrong_model" and by_url[wrong.url].healthy
    assert "Llama-3-8B" in by_url[wrong.url].detail
    assert by_url[down].status == "unreachable" and not by_url[down].healthy
    assert by_url[aliased.url].status == "ok" and by_url[aliased.url].served_model == "prod-target"
    assert [r.endpoint for r in probe.usable] == [good.url, aliased.url]
    md = probe.markdown()
    assert "| endpoint | kind | served model | healthy | latency | status | context | seed holds |" in md
    assert md.count("\n| http://") == 4 and "wrong_model" in md
    table = probe.to_arrow()
    assert table.num_rows == 4 and table.column_names[:5] == ["endpoint", "kind", "served_model", "healthy", "latency_ms"]


def test_no_engine_raises_at_once_with_probe_table(tok, local_store):
    with LoopbackServer(model_path="/models/Llama-3-8B") as wrong:
        down = f"http://127.0.0.1:{dead_port()}"
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=wrong.url), EndpointConfig(url=down)])
        t0 = time.perf_counter()
        with pytest.raises(NoEngineAvailable) as info:
            regenerate_shard(prompts(3), shard="s", store=local_store, fleet=cfg, generation=GenerationConfig(),
                             tokenizer=tok)
        assert time.perf_counter() - t0 < 5
    msg = str(info.value)
    assert wrong.url in msg and down in msg and "wrong_model" in msg and "unreachable" in msg
    assert info.value.probe is not None and not info.value.probe.usable
    assert not local_store.exists("completions/s.parquet")  # nothing written
    with pytest.raises(NoEngineAvailable, match="no generation endpoint configured"):
        regenerate_shard(prompts(1), shard="s", store=local_store, fleet=EngineFleetConfig(target_model=TARGET),
                         generation=GenerationConfig(), tokenizer=tok)


def test_retries_on_503_then_succeed(tok, local_store):
    with LoopbackServer(model_path=TARGET, fail_every=3, fail_status=503) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, backoff_max_s=0.05,
                                endpoints=[EndpointConfig(url=srv.url, max_concurrency=4)])
        res = regenerate_shard(prompts(12, turns=1), shard="r", store=local_store, fleet=cfg,
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        assert srv.stats.failed > 0
    assert res.table.num_rows == 12 and res.failed.num_rows == 0
    assert res.stats.retries == srv.stats.failed and res.stats.requests == 12 + srv.stats.failed
    assert sorted(res.table["attempts"].to_pylist()) != [1] * 12


@pytest.mark.parametrize("status,reason", [(400, "HTTP 400"), (503, "gave up after 3 attempts")])
def test_failures_are_reported_not_dropped(tok, local_store, status, reason):
    with LoopbackServer(model_path=TARGET, fail_every=1, fail_status=status) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.02,
                                endpoints=[EndpointConfig(url=srv.url, max_concurrency=2)])
        with pytest.raises(TooManyFailedPrompts, match="4 of 4 prompts failed") as info:
            regenerate_shard(prompts(4, turns=1), shard="f", store=local_store, fleet=cfg,
                             generation=GenerationConfig(), tokenizer=tok)
    res = info.value.result
    assert res.table.num_rows == 0 and res.failed.num_rows == 4
    assert not local_store.exists("completions/f.parquet")  # nothing published: the partition fails
    assert all(reason in r for r in res.failed["reason"].to_pylist())
    assert local_store.read_parquet("completions/_failed/f.parquet").num_rows == 4
    assert local_store.list("completions/_journal/f") == []  # nothing finished, nothing journaled


def _expected_rows(tok, rows, gen, tmp_path) -> dict[str, list]:
    """The same shard on an undisturbed loopback: the deterministic reference."""
    with LoopbackServer(model_path=TARGET) as ref:
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=ref.url, max_concurrency=8)])
        res = regenerate_shard(rows, shard="ref", store=LocalStore(tmp_path / "ref"), fleet=cfg, generation=gen,
                               tokenizer=tok)
    return {r["prompt_id"]: r["messages"] for r in res.table.to_pylist()}


def test_endpoint_killed_mid_partition_loses_and_duplicates_nothing(tok, local_store, tmp_path):
    rows = prompts(48, turns=2)
    gen = GenerationConfig(max_new_tokens=64, stop_after_truncated_turn=False)
    with LoopbackProcess("--model-path", TARGET, "--delay-s", "0.05") as a, \
            LoopbackProcess("--model-path", TARGET, "--delay-s", "0.05") as b:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.05, backoff_max_s=0.2,
                                endpoints=[EndpointConfig(url=a.url, max_concurrency=4),
                                           EndpointConfig(url=b.url, max_concurrency=4)])

        async def scenario():
            import aiohttp

            gen_task = asyncio.ensure_future(aregenerate_shard(rows, shard="k", store=local_store, fleet=cfg,
                                                               generation=gen, tokenizer=tok, flush_every=8))
            async with aiohttp.ClientSession() as s:
                while True:  # kill b once it has answered some requests and holds more in flight
                    async with s.get(b.url + "/loopback/stats") as r:
                        if (await r.json())["generate_requests"] >= 12:
                            break
                    await asyncio.sleep(0.02)
            os.kill(b.pid, signal.SIGKILL)
            return await gen_task

        res = asyncio.run(scenario())
    got = res.table.to_pylist()
    assert len(got) == 48 and len({r["prompt_id"] for r in got}) == 48 and res.failed.num_rows == 0
    eps = res.stats.endpoints
    assert eps[b.url]["dead"] and not eps[a.url]["dead"] and res.stats.failovers > 0
    assert eps[b.url]["ok"] >= 8  # b did real work before dying (12 received, at most 4 in flight) ...
    assert any(b.url in r["turn_endpoints"] for r in got)
    assert all(r["turn_endpoints"][-1] == a.url or b.url in r["turn_endpoints"] for r in got)
    # ... and the conversations are exactly what an undisturbed run produces
    assert {r["prompt_id"]: r["messages"] for r in got} == _expected_rows(tok, rows, gen, tmp_path)
    assert all(r["num_turns"] == 2 for r in got)


def test_all_endpoints_dead_mid_run_raises_and_keeps_journal(tok, local_store):
    rows = prompts(40, turns=1)
    gen = GenerationConfig(max_new_tokens=64)
    with LoopbackProcess("--model-path", TARGET, "--delay-s", "0.05") as a:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.05,
                                endpoints=[EndpointConfig(url=a.url, max_concurrency=2)])

        async def scenario():
            task = asyncio.ensure_future(aregenerate_shard(rows, shard="d", store=local_store, fleet=cfg,
                                                           generation=gen, tokenizer=tok, flush_every=2))
            while len(local_store.list("completions/_journal/d")) < 2:
                await asyncio.sleep(0.02)
            a.kill()
            return await task

        with pytest.raises(NoEngineAvailable, match="every endpoint died mid-run"):
            asyncio.run(scenario())
    assert len(local_store.list("completions/_journal/d")) >= 2
    with LoopbackServer(model_path=TARGET) as fresh:
        cfg2 = cfg.model_copy(update={"endpoints": [EndpointConfig(url=fresh.url, max_concurrency=4)]})
        res = regenerate_shard(rows, shard="d", store=local_store, fleet=cfg2, generation=gen, tokenizer=tok)
        assert fresh.stats.generate_requests == 40 - res.stats.prompts_resumed
    assert res.stats.prompts_resumed >= 4 and res.table.num_rows == 40


def test_generation_plan_measures_each_endpoint(tok):
    with LoopbackServer(model_path=TARGET, per_token_s=0.0005) as fast, \
            LoopbackServer(model_path=TARGET, per_token_s=0.003) as slow:
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=fast.url, max_concurrency=4),
                                                                EndpointConfig(url=slow.url, max_concurrency=4)])
        est = plan_generation(cfg, prompts=914_000, output_tokens_per_turn=3000, turns_per_prompt=1.5,
                              tokenizer=tok, max_new_tokens=32, requests=8)
    m = {x.endpoint: x for x in est.measurements}
    assert m[fast.url].completion_tokens == 8 * 32 == m[slow.url].completion_tokens  # ignore_eos honoured
    assert m[fast.url].tokens_per_s > 2 * m[slow.url].tokens_per_s
    total = m[fast.url].tokens_per_s + m[slow.url].tokens_per_s
    assert est.total_tokens_per_s == pytest.approx(total)
    assert est.wall_s == pytest.approx(914_000 * 1.5 * 3000 / total)
    shares = {e.endpoint: e.share for e in est.per_endpoint}
    assert shares[fast.url] > 0.66 and sum(shares.values()) == pytest.approx(1.0)
    md = est.markdown()
    assert "Estimated wall time" in md and fast.url in md and format_duration(est.wall_s) in md
    assert est.to_metadata()["estimated_wall_s"] == round(est.wall_s, 1)


def test_estimate_without_throughput_is_infinite():
    est = estimate_generation_time([], prompts=10, output_tokens_per_turn=100)
    assert est.wall_s == float("inf") and "never" in est.markdown()


def test_in_process_transformers_endpoint_is_explicit_and_works(tiny_dense_target, local_store):
    """kind=transformers only when configured; here it is the only endpoint and does the work."""
    cfg = EngineFleetConfig(target_model=str(tiny_dense_target),
                            endpoints=[EndpointConfig(url="inprocess://tiny", kind="transformers")])
    res = regenerate_shard(prompts(2, turns=1), shard="ip", store=local_store, fleet=cfg,
                           generation=GenerationConfig(max_new_tokens=4, temperature=0.0))
    assert res.table.num_rows == 2 and res.probe.rows[0].kind == "transformers" and res.probe.rows[0].usable
    assert all(1 <= n <= 4 for r in res.table.to_pylist() for n in r["completion_tokens"])
    assert set(res.table["endpoint"].to_pylist()) == {f"inprocess://{tiny_dense_target}"}


def test_an_in_process_slot_engine_reports_its_decoder_over_the_run(tiny_dense_target, local_store):
    """The slot decoders' steps, prefills and their seconds over a shard's run, per endpoint, in the stats and,
    as the decode steps and the prefills' share of the decoder's seconds, in the asset metadata."""
    cfg = EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[EndpointConfig(
        url="inprocess://tiny", kind="transformers", cache="slots", slot_len=256, max_batch_rows=4)])
    res = regenerate_shard(prompts(5, turns=2), shard="sl", store=local_store, fleet=cfg,
                           generation=GenerationConfig(max_new_tokens=6, temperature=0.0, max_turns=2))
    ((url, ep),) = res.stats.endpoints.items()
    decoding = ep["decoding"]
    assert decoding["prefills"] >= 2 and decoding["steps"] >= 5  # second turns joined the running slots
    assert decoding["new_tokens"] >= res.stats.completion_tokens > 0 and 0 < decoding["prefill_share"] < 1
    meta = res.stats.to_metadata()
    assert meta[f"decode_steps[{url}]"] == decoding["steps"]
    assert meta[f"prefill_share[{url}]"] == decoding["prefill_share"]


def test_decoding_over_a_run_is_the_change_of_the_totals():
    before = {"steps": 10, "step_seconds": 1.0, "prefills": 2, "prefill_seconds": 1.0, "new_tokens": 100}
    after = {"steps": 30, "step_seconds": 4.0, "prefills": 3, "prefill_seconds": 2.0, "new_tokens": 300}
    assert decoding_over_run(before, after) == {"steps": 20, "step_seconds": 3.0, "prefills": 1,
                                                "prefill_seconds": 1.0, "new_tokens": 200, "prefill_share": 0.25}
    assert decoding_over_run(after, before)["steps"] == 10  # totals that went down: decoders rebuilt
    assert decoding_over_run({}, {}) == {}  # an engine that keeps none


# -- broken or hostile engines in a run ---------------------------------------------------


def test_replies_of_the_wrong_shape_are_retried_not_failed(tok, local_store):
    with LoopbackServer(model_path=TARGET, bad_shape_every=3) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, backoff_max_s=0.05,
                                endpoints=[EndpointConfig(url=srv.url, max_concurrency=4)])
        res = regenerate_shard(prompts(12, turns=1), shard="w", store=local_store, fleet=cfg,
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        assert srv.stats.failed > 0
    assert res.table.num_rows == 12 and res.failed.num_rows == 0 and res.stats.retries == srv.stats.failed


def test_hung_endpoint_is_cut_off_and_its_work_moves_on(tok, local_store):
    """A server that accepts requests and never answers holds no slot for long: read timeout, excluded, failover."""
    with LoopbackServer(model_path=TARGET, delay_s=6) as hung, LoopbackServer(model_path=TARGET) as good:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, request_timeout_s=120,
                                read_timeout_s=0.4, read_timeout_per_token_s=0.0,
                                endpoints=[EndpointConfig(url=hung.url, max_concurrency=4),
                                           EndpointConfig(url=good.url, max_concurrency=4)])
        t0 = time.perf_counter()
        res = regenerate_shard(prompts(16, turns=1), shard="hung", store=local_store, fleet=cfg,
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        elapsed = time.perf_counter() - t0
        assert hung.stats.generate_requests >= 3  # it did receive work
    assert res.table.num_rows == 16 and res.failed.num_rows == 0
    assert set(res.table["endpoint"].to_pylist()) == {good.url}
    ep = res.stats.endpoints[hung.url]
    assert ep["dead"] and "read timeout" in ep["dead_reason"]
    assert elapsed < 5, elapsed  # not 120 s (the total limit), nor 6 s (the hung server's delay)


def test_api_key_per_endpoint_from_config_environment_or_file_never_shown(tok, local_store, tmp_path, monkeypatch):
    keys = {"a": "sk-fleet-wide-aaaaaaaa", "b": "sk-from-env-bbbbbbbb", "c": "sk-from-file-cccccccc"}
    monkeypatch.setenv("LOOPBACK_B_KEY", keys["b"])
    (tmp_path / "c.key").write_text(keys["c"] + "\n")
    with LoopbackServer(model_path=TARGET, api_key=keys["a"]) as a, \
            LoopbackServer(model_path=TARGET, api_key=keys["b"]) as b, \
            LoopbackServer(model_path=TARGET, api_key=keys["c"]) as c:
        cfg = EngineFleetConfig(target_model=TARGET, api_key=keys["a"], endpoints=[
            EndpointConfig(url=a.url, max_concurrency=2),
            EndpointConfig(url=b.url, kind="openai", max_concurrency=2, api_key_env="LOOPBACK_B_KEY"),
            EndpointConfig(url=c.url, max_concurrency=2, api_key_file=str(tmp_path / "c.key"))])
        res = regenerate_shard(prompts(12, turns=1), shard="auth", store=local_store, fleet=cfg,
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        assert a.stats.unauthorized == b.stats.unauthorized == c.stats.unauthorized == 0
        assert a.stats.generate_requests and b.stats.chat_requests and c.stats.generate_requests
        # without a key the endpoint is refused with a clear status, and the key shows nowhere
        probe = probe_fleet(cfg.model_copy(update={"api_key": None}), tok)
    assert res.table.num_rows == 12 and res.failed.num_rows == 0
    assert probe.rows[0].status != "ok" and "HTTP 401" in probe.rows[0].detail
    shown = [repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.endpoints), probe.markdown(), str(res.probe),
             str(res.stats.to_metadata()), repr(res.stats)]
    for key in keys.values():
        assert not any(key in text for text in shown), key
    monkeypatch.delenv("LOOPBACK_B_KEY")
    with pytest.raises(ValueError, match="LOOPBACK_B_KEY.*not set"):
        probe_fleet(cfg, tok)


# -- the plan's inputs, read with bounded memory ---------------------------------------------


class _ColumnRecordingStore(LocalStore):
    """A real local store that records every Parquet read (key, columns) and every file handed to a scan."""

    def __init__(self, root):
        super().__init__(root)
        self.reads: list[tuple[str, tuple | None]] = []
        self.scanned: list[str] = []

    def local_path(self, key):
        self.scanned.append(key)
        return super().local_path(key)

    def read_parquet(self, key, columns=None):
        self.reads.append((key, tuple(columns) if columns is not None else None))
        return super().read_parquet(key, columns=columns)


def test_plan_inputs_come_from_completions_and_prompts_column_by_column(tok, tmp_path):
    import pyarrow as pa

    from dflash_assets.planning.measurements import measure_completions, measure_prompts, mean_output_tokens
    from dflash_assets.store import layout

    store = _ColumnRecordingStore(tmp_path / "store")
    assert measure_completions(store) is None and measure_prompts(store, max_turns=2) is None
    shards = {"s0": prompts(5, turns=3), "s1": prompts(4, turns=1)}
    gen = GenerationConfig(max_new_tokens=64, max_turns=2)
    with LoopbackServer(model_path=TARGET) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=srv.url, max_concurrency=4)])
        tables = {}
        for shard, rows in shards.items():
            store.write_parquet(layout.raw_prompts(shard), pa.Table.from_pylist(
                [{**r, "num_user_turns": len(r["user_turns"])} for r in rows]))
            tables[shard] = regenerate_shard(rows, shard=shard, store=store, fleet=cfg, generation=gen,
                                             tokenizer=tok).table
    store.reads.clear()
    done = measure_completions(store)
    all_rows = [r for t in tables.values() for r in t.to_pylist()]
    per_turn = [n for r in all_rows for n in r["completion_tokens"]]
    assert (done.shards, done.prompts, done.turns) == (2, 9, 5 * 2 + 4 * 1)  # num_turns, capped at max_turns
    assert done.turns_per_prompt == pytest.approx(14 / 9) and done.completion_tokens == sum(per_turn)
    assert done.output_tokens_per_turn == pytest.approx(sum(per_turn) / len(per_turn))
    assert done.prompt_tokens == sum(n for r in all_rows for n in r["prompt_tokens"])
    assert mean_output_tokens(tables["s0"]) == pytest.approx(
        sum(n for r in tables["s0"].to_pylist() for n in r["completion_tokens"]) / 10)
    # one lazy scan over the shards' files (it reads only the columns it sums): no shard as Python objects
    assert store.reads == [] and store.scanned == [layout.completions("s0"), layout.completions("s1")]
    sampled = measure_completions(store, sample=5).sample  # real requests as the run sent them
    row0 = tables["s0"].to_pylist()[0]["messages"]
    assert len(sampled) == 5 and sampled[0] == ({"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "question 0 part 0"})
    assert sampled[1] == (sampled[0][0], sampled[0][1], {"role": "assistant", "content": row0[2]["content"]},
                          {"role": "user", "content": "question 0 part 1"})  # history re-sent, no reasoning
    seen = measure_prompts(store, max_turns=2, sample=7)
    assert (seen.prompts, seen.turns) == (9, 14) and len(seen.sample) == 7
    assert seen.sample[0][0] == {"role": "system", "content": "Be brief."}  # prompt 0 has a system prompt
    assert seen.sample[1] == ({"role": "user", "content": "question 1 part 0"},)


def test_burst_sends_real_prompts_with_the_completions_sampling(tok):
    from dflash_assets.planning.measurements import measure_throughput

    chats = [[{"role": "user", "content": f"real prompt number {i} " * (1 + i)}] for i in range(5)]
    with LoopbackServer(model_path=TARGET) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=srv.url, max_concurrency=2)])
        _, (m,) = measure_throughput(cfg, tokenizer=tok, max_new_tokens=16, requests=10, conversations=chats,
                                     generation=GenerationConfig(temperature=0.3, top_p=0.8, seed=7))
        sp = srv.stats.last_body["sampling_params"]
        assert len(srv.stats.prompts_seen) == 5  # every real prompt, not one fixed one
    assert m.ok == 10 and m.completion_tokens == 10 * 16
    assert (sp["temperature"], sp["top_p"], sp["sampling_seed"], sp["ignore_eos"]) == (0.3, 0.8, 7, True)


def test_pilot_on_real_prompts_predicts_the_run(tok, tmp_path):
    """Before any completions: a pilot of real prompts through the whole path, scaled to the corpus."""
    import pyarrow as pa

    from dflash_assets.planning.measurements import pilot, sample_prompt_rows
    from dflash_assets.store import layout

    store = LocalStore(tmp_path / "store")
    rows = prompts(32, turns=2)
    store.write_parquet(layout.raw_prompts("s0"), pa.Table.from_pylist(rows[:20]))
    store.write_parquet(layout.raw_prompts("s1"), pa.Table.from_pylist(rows[20:]))
    sample = sample_prompt_rows(store, 8)
    assert sample["prompt_id"].to_pylist() == [r["prompt_id"] for r in rows[:8]]
    assert sample_prompt_rows(store, 25).num_rows == 25  # across shards
    assert sample_prompt_rows(LocalStore(tmp_path / "empty"), 3) is None
    gen = GenerationConfig(max_new_tokens=64)
    with LoopbackServer(model_path=TARGET, delay_s=0.1) as srv:  # 0.1 s a request, 4 in flight
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=srv.url, max_concurrency=4)])
        p = pilot(cfg, sample, generation=gen, tokenizer=tok)
        assert not store.list(layout.completions_journal("pilot")) and not store.exists(layout.completions("pilot"))
        t0 = time.perf_counter()
        regenerate_shard(rows, shard="all", store=store, fleet=cfg, generation=gen, tokenizer=tok)
        measured = time.perf_counter() - t0
    assert (p.prompts, p.done, p.failed, p.turns, p.concurrency) == (8, 8, 0, 16, 4) and p.saturated
    predicted = p.estimate_wall_s(32)
    assert predicted == pytest.approx(measured, rel=0.3), (predicted, measured)  # 32 x 2 x 0.1 s / 4 = 1.6 s
    meta = p.to_metadata(32)
    assert meta["pilot_turns_per_prompt"] == 2.0 and meta["pilot_estimated_wall_s"] == round(predicted, 1)


def test_sglang_command_carries_the_flags_the_probe_reads():
    """The tool-call parser and deterministic inference (seeds hold only then) are start flags."""
    from dflash_assets.generation.server import engine_server_command

    argv = engine_server_command("sglang", "/models/Qwen3.6-27B", port=30000, tool_call_parser="qwen3_coder",
                                 deterministic_inference=True)
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[argv.index("--tool-call-parser") + 1] == "qwen3_coder" and "--enable-deterministic-inference" in argv
    assert "--enable-deterministic-inference" not in engine_server_command("sglang", "m", port=1)


def test_probe_table_shows_context_length_and_whether_a_seed_holds(tok):
    with LoopbackServer(model_path=TARGET, context_length=4096) as default, \
            LoopbackServer(model_path=TARGET, deterministic=True) as det:
        cfg = EngineFleetConfig(target_model=TARGET, endpoints=[EndpointConfig(url=default.url),
                                                                EndpointConfig(url=det.url, kind="openai")])
        probe = probe_fleet(cfg, tok)
        configured = probe_fleet(cfg.model_copy(update={"endpoints": [
            EndpointConfig(url=default.url, context_length=1000, deterministic_inference=True)]}), tok)
    rows = {r.endpoint: r for r in probe.rows}
    assert (rows[default.url].context_length, rows[default.url].seed_honoured) == (4096, False)
    assert (rows[det.url].context_length, rows[det.url].seed_honoured) == (32768, True)
    assert rows[det.url].reasoning_parser == "qwen3" and not probe.seed_honoured  # one endpoint ignores seeds
    assert (configured.rows[0].context_length, configured.rows[0].seed_honoured) == (1000, True)
    assert configured.seed_honoured and "| 4096 | no |" in probe.markdown()
    assert probe.to_arrow().column("seed_honoured").to_pylist() == [False, True]
