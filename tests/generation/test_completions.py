"""Regenerated completions of a shard: output table, failures, stats, progress, journal and resume
(also after kill -9 of the generating process), local store and S3 (moto). Real HTTP servers."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest

from dflash_assets.store import layout
from dflash_assets.generation.completions import (
    GenerationConfig,
    TooManyFailedPrompts,
    aregenerate_shard,
    failed_prompts_markdown,
    output_schema,
    regenerate_shard,
)
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
from tests.support.sglang_loopback import LoopbackServer
from dflash_assets.store.backends import LocalStore

TARGET = "/models/Qwen3.6-27B"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


def fleet(*servers, concurrency: int = 4) -> EngineFleetConfig:
    return EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01,
                             endpoints=[EndpointConfig(url=s.url, max_concurrency=concurrency) for s in servers])


def prompts(n: int) -> list[dict]:
    """n prompts with 1..3 user turns, every third with a system prompt."""
    return [{"prompt_id": f"p{i:04d}", "system": "Answer briefly." if i % 3 == 0 else None,
             "user_turns": [f"q{i}.{t}" for t in range(1 + i % 3)]} for i in range(n)]


def test_output_table_rows_failures_and_stats(tok, local_store):
    rows = prompts(5) + [
        {"prompt_id": "p0001", "system": None, "user_turns": ["duplicate id, dropped"]},
        {"prompt_id": "empty", "system": None, "user_turns": []},
        {"prompt_id": "long", "system": "S", "user_turns": [f"turn {t}" for t in range(5)]},
    ]
    gen = GenerationConfig(max_new_tokens=64, max_turns=3)
    with LoopbackServer(model_path=TARGET) as srv:
        res = regenerate_shard(rows, shard="shard-00000", store=local_store, fleet=fleet(srv), generation=gen,
                               tokenizer=tok, max_failed_ratio=0.2)  # 1 of 7 fails: published
        requests = srv.stats.generate_requests
    table = local_store.read_parquet(layout.completions("shard-00000"))
    assert table.schema.equals(output_schema()) and table.equals(res.table)
    got = {r["prompt_id"]: r for r in table.to_pylist()}
    assert list(got) == ["p0000", "p0001", "p0002", "p0003", "p0004", "long"]  # input order, one row each
    assert got["p0001"]["messages"][0]["content"] == "q1.0"  # first occurrence kept
    assert got["long"]["num_turns"] == 3  # max_turns
    for r in got.values():
        roles = [m["role"] for m in r["messages"]]
        n = r["num_turns"]
        assert roles == (["system"] if roles[0] == "system" else []) + ["user", "assistant"] * n
        assert len(r["finish_reasons"]) == len(r["prompt_tokens"]) == len(r["completion_tokens"]) == n
        assert r["completion_tokens_total"] == sum(r["completion_tokens"]) > 0
        assert all(m["reasoning_content"] for m in r["messages"] if m["role"] == "assistant")
        assert all(m["reasoning_content"] is None for m in r["messages"] if m["role"] != "assistant")
        assert r["prompt_tokens"] == sorted(r["prompt_tokens"])  # history grows turn by turn
        assert r["endpoint"] == srv.url and r["served_model"] == TARGET and r["config_hash"] == res.config_hash
        assert r["started_at"] <= r["finished_at"] and r["attempts"] == n
    assert res.config_hash == gen.config_hash(TARGET)
    assert res.failed.to_pylist()[0]["prompt_id"] == "empty" and res.failed["reason"].to_pylist() == ["no user turns"]
    assert local_store.read_parquet(layout.completions_failed("shard-00000")).num_rows == 1
    s = res.stats
    turns = sum(r["num_turns"] for r in got.values())
    assert (s.prompts_total, s.prompts_done, s.prompts_failed, s.duplicates_dropped) == (7, 6, 1, 1)
    assert s.turns == turns == requests == s.requests and sum(s.finish_reasons.values()) == turns
    assert s.completion_tokens == sum(r["completion_tokens_total"] for r in got.values())
    assert s.endpoints[srv.url]["completion_tokens"] == s.completion_tokens and s.tokens_per_s > 0
    meta = s.to_metadata()
    assert meta["prompts_done"] == 6 and meta["finish_stop"] == turns and f"tokens_per_s[{srv.url}]" in meta
    # a failure stays: the journal is kept so a re-run retries only what failed
    assert local_store.list(layout.completions_journal("shard-00000"))
    # the writer's data version is what was published (the asset never re-reads the file to hash it)
    assert res.sha256 == hashlib.sha256(local_store.read_bytes(layout.completions("shard-00000"))).hexdigest()


def test_sync_and_async_entry_points_share_one_argument_list():
    """The blocking form forwards to the async one: one definition of the options, so they cannot drift."""
    assert inspect.signature(regenerate_shard) == inspect.signature(aregenerate_shard)
    assert "engines" in inspect.signature(regenerate_shard).parameters  # the async-only option reaches sync callers
    with pytest.raises(TypeError, match="unexpected keyword"):
        regenerate_shard([], shard="x", store=None, fleet=None, generation=None, no_such_option=1)


def test_history_carries_regenerated_answers_without_think_blocks(tok, local_store):
    rows = [{"prompt_id": "a", "system": None, "user_turns": ["first", "second"]}]
    with LoopbackServer(model_path=TARGET) as srv:
        res = regenerate_shard(rows, shard="h", store=local_store, fleet=fleet(srv),
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        last_ids = srv.stats.last_body["input_ids"]
    msgs = res.table.to_pylist()[0]["messages"]
    prompt = tok.decode(last_ids)
    assert msgs[1]["content"] in prompt and msgs[1]["reasoning_content"] not in prompt
    assert prompt.endswith("<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_truncated_turn_ends_conversation_and_empty_counts(tok, local_store):
    rows = prompts(6)
    with LoopbackServer(model_path=TARGET) as srv:
        cut = regenerate_shard(rows, shard="t", store=local_store, fleet=fleet(srv),
                               generation=GenerationConfig(max_new_tokens=3), tokenizer=tok)
        keep = regenerate_shard(rows, shard="t2", store=local_store, fleet=fleet(srv),
                                generation=GenerationConfig(max_new_tokens=3, stop_after_truncated_turn=False),
                                tokenizer=tok)
    assert cut.table["num_turns"].to_pylist() == [1] * 6 and cut.stats.finish_reasons == {"length": 6}
    assert keep.table["num_turns"].to_pylist() == [1 + i % 3 for i in range(6)]
    # cut inside the think block: reasoning only, empty answers, counted
    assert cut.stats.empty_content == 6 and cut.stats.empty_reasoning == 0
    with LoopbackServer(model_path=TARGET, reasoning_tokens=(0, 0)) as srv:
        res = regenerate_shard(rows, shard="e", store=local_store, fleet=fleet(srv),
                               generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
    assert res.stats.empty_reasoning == res.stats.turns > 0 and res.stats.empty_content == 0


def test_resume_reuses_only_rows_of_the_same_config_hash(tok, local_store):
    rows = prompts(9)
    a = GenerationConfig(max_new_tokens=64)
    b = GenerationConfig(max_new_tokens=64, temperature=0.7)
    turns = sum(len(r["user_turns"]) for r in rows)
    with LoopbackServer(model_path=TARGET) as srv:
        first = regenerate_shard(rows, shard="c", store=local_store, fleet=fleet(srv), generation=a, tokenizer=tok,
                                 keep_journal=True, flush_every=4)
        assert srv.stats.generate_requests == turns and first.stats.journal_chunks_written >= 2
        chunks = local_store.list(layout.completions_journal("c"))
        assert len(chunks) == first.stats.journal_chunks_written
        assert sum(len(local_store.read_bytes(k).splitlines()) for k in chunks) == 9
        again = regenerate_shard(rows, shard="c", store=local_store, fleet=fleet(srv), generation=a, tokenizer=tok,
                                 keep_journal=True)
        assert srv.stats.generate_requests == turns  # nothing regenerated
        other = regenerate_shard(rows, shard="c", store=local_store, fleet=fleet(srv), generation=b, tokenizer=tok)
        assert srv.stats.generate_requests == 2 * turns  # a new config regenerates everything
    assert again.stats.prompts_resumed == 9 and again.stats.prompts_generated == 0 and again.table.equals(first.table)
    assert other.stats.prompts_resumed == 0 and set(other.table["config_hash"].to_pylist()) == {b.config_hash(TARGET)}
    assert local_store.list(layout.completions_journal("c")) == []  # success without keep_journal: journal removed


def test_rerun_after_success_reuses_published_rows_of_the_same_config_hash(tok, local_store):
    """The journal is gone after success; a re-run (one new prompt) still regenerates only what has no row."""
    rows = prompts(9)
    gen = GenerationConfig(max_new_tokens=64)
    turns = sum(len(r["user_turns"]) for r in rows)
    extra = {"prompt_id": "new", "system": None, "user_turns": ["one more"]}
    with LoopbackServer(model_path=TARGET) as srv:
        first = regenerate_shard(rows, shard="pub", store=local_store, fleet=fleet(srv), generation=gen, tokenizer=tok)
        assert local_store.list(layout.completions_journal("pub")) == []
        again = regenerate_shard(rows[:4] + [extra] + rows[4:], shard="pub", store=local_store, fleet=fleet(srv),
                                 generation=gen, tokenizer=tok)
        assert srv.stats.generate_requests == turns + 1  # only the new prompt
        other = regenerate_shard(rows, shard="pub", store=local_store, fleet=fleet(srv),
                                 generation=gen.model_copy(update={"temperature": 0.7}), tokenizer=tok)
        assert srv.stats.generate_requests == 2 * turns + 1  # another config_hash: nothing reused
    assert again.stats.prompts_resumed == again.stats.prompts_resumed_published == 9
    assert again.table["prompt_id"].to_pylist() == [r["prompt_id"] for r in rows[:4]] + ["new"] + \
        [r["prompt_id"] for r in rows[4:]]
    kept = again.table.filter(pa.compute.not_equal(again.table["prompt_id"], "new"))
    assert kept.equals(first.table)  # reused rows are published unchanged, timestamps included
    assert other.stats.prompts_resumed == 0


def test_too_many_failed_prompts_fail_the_shard_and_the_next_run_retries_only_them(tok, local_store):
    rows = [{"prompt_id": f"p{i:02d}", "system": None, "user_turns": [f"q{i}"]} for i in range(20)]
    gen = GenerationConfig(max_new_tokens=64)
    with LoopbackServer(model_path=TARGET, fail_every=5, fail_status=400) as bad:  # 400: not retried
        with pytest.raises(TooManyFailedPrompts, match=r"4 of 20 prompts failed \(20.0%; 95% lower bound 8.1% > "
                           r"max_failed_ratio 1.0%\)") \
                as info:
            regenerate_shard(rows, shard="t", store=local_store, fleet=fleet(bad), generation=gen, tokenizer=tok)
    res = info.value.result
    assert res.stats.prompts_failed == 4 and res.table.num_rows == 16 and res.sha256 == ""
    assert not local_store.exists(layout.completions("t"))  # a partial shard is not published
    failed_ids = set(local_store.read_parquet(layout.completions_failed("t"))["prompt_id"].to_pylist())
    assert len(failed_ids) == 4 and all("HTTP 400" in r for r in res.failed["reason"].to_pylist())
    listed = failed_prompts_markdown(res.failed)  # what the asset puts in the failure's metadata
    assert listed.startswith("4 failed prompts") and all(f"| {pid} | 0 | 1 | POST http" in listed for pid in failed_ids)
    assert listed.count("HTTP 400") == 4
    with LoopbackServer(model_path=TARGET) as good:
        retry = regenerate_shard(rows, shard="t", store=local_store, fleet=fleet(good), generation=gen, tokenizer=tok)
        assert good.stats.generate_requests == 4  # only the failed ones
    assert retry.table.num_rows == 20 and retry.failed.num_rows == 0 and retry.stats.prompts_resumed == 16
    assert local_store.read_parquet(layout.completions_failed("t")).num_rows == 0
    # within the ratio the shard is published, failures listed, and they are retried on the next run
    with LoopbackServer(model_path=TARGET, fail_every=5, fail_status=400) as bad:
        part = regenerate_shard(rows, shard="u", store=local_store, fleet=fleet(bad), generation=gen, tokenizer=tok,
                                max_failed_ratio=0.25)
    assert part.table.num_rows == 16 and local_store.read_parquet(layout.completions("u")).num_rows == 16
    with LoopbackServer(model_path=TARGET) as good:
        rest = regenerate_shard(rows, shard="u", store=local_store, fleet=fleet(good), generation=gen, tokenizer=tok)
        assert good.stats.generate_requests == 4
    assert rest.table.num_rows == 20
    # the ratio checks' rule: 1 failure in 20 is not shown to be over 1% (95% lower bound 0.89%), so the shard
    # is published with its failure listed; the 4 in 20 above were (lower bound 8.1%)
    with LoopbackServer(model_path=TARGET, fail_every=20, fail_status=400) as bad:
        one = regenerate_shard(rows, shard="v", store=local_store, fleet=fleet(bad), generation=gen, tokenizer=tok)
    assert one.stats.prompts_failed == 1 and one.table.num_rows == 19 and one.sha256
    assert local_store.read_parquet(layout.completions("v")).num_rows == 19


def test_progress_callback(tok, local_store):
    updates = []
    with LoopbackServer(model_path=TARGET, delay_s=0.03) as srv:
        regenerate_shard(prompts(12), shard="g", store=local_store, fleet=fleet(srv, concurrency=2),
                         generation=GenerationConfig(max_new_tokens=64), tokenizer=tok,
                         progress=updates.append, progress_interval_s=0.05)
    assert len(updates) >= 3
    assert [u.done for u in updates] == sorted(u.done for u in updates)
    last = updates[-1]
    assert (last.done, last.total, last.failed, last.eta_s) == (12, 12, 0, 0.0) and last.tokens_per_s > 0
    assert any(u.eta_s and u.eta_s > 0 for u in updates[:-1]) and "12/12 done" in str(last)


def test_journal_and_resume_on_s3(tok, s3_store):
    rows = prompts(7)
    with LoopbackServer(model_path=TARGET) as srv:
        first = regenerate_shard(rows, shard="s3", store=s3_store, fleet=fleet(srv),
                                 generation=GenerationConfig(max_new_tokens=64), tokenizer=tok, keep_journal=True,
                                 flush_every=3)
        n = srv.stats.generate_requests
        chunks = s3_store.list(layout.completions_journal("s3"))
        again = regenerate_shard(rows, shard="s3", store=s3_store, fleet=fleet(srv),
                                 generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        assert srv.stats.generate_requests == n
    assert len(chunks) >= 2 and all(k.startswith("completions/_journal/s3/") and k.endswith(".jsonl") for k in chunks)
    assert again.stats.prompts_resumed == 7 and again.table.equals(first.table)
    assert s3_store.read_parquet("completions/s3.parquet").num_rows == 7
    assert s3_store.list(layout.completions_journal("s3")) == []


_CHILD = textwrap.dedent("""
    import sys
    from transformers import AutoTokenizer
    from dflash_assets.generation.completions import GenerationConfig, regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.store.backends import LocalStore
    store_dir, url, tok_dir, target, rows_json = sys.argv[1:6]
    import json
    rows = json.loads(open(rows_json).read())
    fleet = EngineFleetConfig(target_model=target, endpoints=[EndpointConfig(url=url, max_concurrency=2)])
    regenerate_shard(rows, shard="kill", store=LocalStore(store_dir), fleet=fleet,
                     generation=GenerationConfig(max_new_tokens=64), tokenizer=AutoTokenizer.from_pretrained(tok_dir),
                     flush_every=4)
""")


def test_kill_9_then_resume_regenerates_only_the_missing(tok, tiny_dense_target, local_store, tmp_path):
    rows = prompts(90)
    turns = {r["prompt_id"]: len(r["user_turns"]) for r in rows}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "child.py").write_text(_CHILD)
    with LoopbackServer(model_path=TARGET, delay_s=0.03) as srv:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(local_store.root), srv.url,
                                  str(tiny_dense_target), TARGET, str(tmp_path / "rows.json")], env=env,
                                 stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while len(local_store.list(layout.completions_journal("kill"))) < 3:
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "child wrote no journal chunks"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
        assert not local_store.exists(layout.completions("kill"))  # killed long before the end
        time.sleep(0.2)  # let requests the child left in flight land at the server
        before = srv.stats.generate_requests
        journaled = set()
        for key in local_store.list(layout.completions_journal("kill")):
            journaled |= {json.loads(line)["prompt_id"] for line in local_store.read_bytes(key).splitlines()}

        res = regenerate_shard(rows, shard="kill", store=local_store, fleet=fleet(srv), tokenizer=tok,
                               generation=GenerationConfig(max_new_tokens=64))
        resumed_requests = srv.stats.generate_requests - before

    assert 12 <= len(journaled) < 90 and res.stats.prompts_resumed == len(journaled)
    # exactly the turns of the prompts that were not journaled: fewer requests, nothing generated twice
    assert resumed_requests == sum(t for pid, t in turns.items() if pid not in journaled) < sum(turns.values())
    table = local_store.read_parquet(layout.completions("kill"))
    ids = table["prompt_id"].to_pylist()
    assert ids == [r["prompt_id"] for r in rows]  # one row per prompt, none lost, none duplicated
    assert local_store.list(layout.completions_journal("kill")) == []
    with LoopbackServer(model_path=TARGET) as ref:
        clean = regenerate_shard(rows, shard="kill", store=LocalStore(tmp_path / "ref"), fleet=fleet(ref),
                                 generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
    assert table["messages"].to_pylist() == clean.table["messages"].to_pylist()


def test_seeded_run_records_whether_the_engines_honour_the_seed(tok, local_store):
    """SGLang uses a seed only when started with --enable-deterministic-inference: the hash and
    the metadata say which, read from the servers' /server_info in the run's one probe."""
    rows = prompts(4)
    seeded = GenerationConfig(max_new_tokens=64, seed=5)
    with LoopbackServer(model_path=TARGET) as default, LoopbackServer(model_path=TARGET, deterministic=True) as det:
        ignored = regenerate_shard(rows, shard="s1", store=local_store, fleet=fleet(default), generation=seeded,
                                   tokenizer=tok)
        honoured = regenerate_shard(rows, shard="s2", store=local_store, fleet=fleet(det), generation=seeded,
                                    tokenizer=tok)
        mixed = regenerate_shard(rows, shard="s3", store=local_store, fleet=fleet(default, det), generation=seeded,
                                 tokenizer=tok)
        unseeded = regenerate_shard(rows, shard="s4", store=local_store, fleet=fleet(det),
                                    generation=GenerationConfig(max_new_tokens=64), tokenizer=tok)
        requests = det.stats.generate_requests
        again = regenerate_shard(rows, shard="s2", store=local_store, fleet=fleet(det), generation=seeded,
                                 tokenizer=tok)
        assert det.stats.generate_requests == requests  # resumed: the hash was known before any work
        assert det.stats.model_info_requests == 4  # one probe per run, also where the seed made it probe first
    assert ignored.config_hash == seeded.config_hash(TARGET, seed_honoured=False) == mixed.config_hash
    assert honoured.config_hash == seeded.config_hash(TARGET, seed_honoured=True) != ignored.config_hash
    assert set(honoured.table["config_hash"].to_pylist()) == {honoured.config_hash} == {again.config_hash}
    assert (ignored.stats.seed_effect, honoured.stats.seed_effect, mixed.stats.seed_effect) == \
        ("ignored", "honoured", "ignored")
    assert unseeded.stats.to_metadata()["seed_effect"] == "no seed"
    assert unseeded.config_hash == GenerationConfig(max_new_tokens=64).config_hash(TARGET)
    assert again.stats.prompts_resumed == 4 and honoured.probe.seed_honoured and not ignored.probe.seed_honoured


def test_turns_that_do_not_fit_the_context_are_cut_or_stopped_before_sending(tok, local_store):
    """With a 100-token context and at least 77 new tokens wanted, every first turn (13 to 22
    prompt tokens) is sent with max_new_tokens lowered to what fits, a second turn (its prompt longer by the
    answer and the next user turn) is not sent and its conversation ends at the first, and a prompt too long
    for any answer fails without a round trip."""
    rows = prompts(6) + [{"prompt_id": "too-long", "system": None, "user_turns": [" ".join(["word"] * 80)]}]
    cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, context_min_new_tokens=77,
                            endpoints=[EndpointConfig(url="http://x")])  # url replaced below
    with LoopbackServer(model_path=TARGET, context_length=100) as srv:
        cfg = cfg.model_copy(update={"endpoints": [EndpointConfig(url=srv.url, max_concurrency=4)]})
        res = regenerate_shard(rows, shard="ctx", store=local_store, fleet=cfg,
                               generation=GenerationConfig(max_new_tokens=128), tokenizer=tok, max_failed_ratio=0.2)
        requests = srv.stats.generate_requests
        sent = srv.stats.last_body["sampling_params"]["max_new_tokens"]
    s = res.stats
    assert res.table["num_turns"].to_pylist() == [1] * 6 and requests == 6  # no request for a turn that did not fit
    assert 77 <= sent <= 100 - 13 and s.turns_cut_to_context == 6 and s.turns == 6
    assert s.conversations_stopped_at_context == sum(len(r["user_turns"]) > 1 for r in rows) == 4
    assert s.prompts_failed_context_overflow == 1 and res.failed["prompt_id"].to_pylist() == ["too-long"]
    assert "context length 100" in res.failed["reason"].to_pylist()[0]
    assert all(reason == "stop" for r in res.table["finish_reasons"].to_pylist() for reason in r)
    meta = s.to_metadata()
    assert (meta["turns_cut_to_context"], meta["conversations_stopped_at_context"],
            meta["prompts_failed_context_overflow"]) == (6, 4, 1)


def test_agentic_step_that_does_not_fit_the_context_stops_the_conversation(tok, local_store, tiny_dense_target):
    """A long tool result pushes the next step past the context: that step is not sent, the row keeps what was
    generated and says agentic_stop: context_length."""
    from dflash_assets.generation.chat_tokenizer import ChatTokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    events = [{"role": "user", "content": "What is the weather in Lyon?"},
              {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}]},
              {"role": "tool", "name": "get_weather", "content": " ".join(["sunny"] * 300)},
              {"role": "assistant", "content": "Sunny."}]
    row = {"prompt_id": "agentic-long-result", "system": None, "user_turns": [events[0]["content"]],
           "agentic_turns": json.dumps(events), "tools": json.dumps(tools)}
    first = len(ChatTokenizer(tok).prompt_ids(events[:1], True, tools))
    with LoopbackServer(model_path=TARGET, context_length=first + 100,
                        tokenizer_json=str(tiny_dense_target / "tokenizer.json"),
                        tool_rules=(("weather in Lyon", "get_weather", {"city": "Lyon"}),)) as srv:
        cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, context_min_new_tokens=80,
                                endpoints=[EndpointConfig(url=srv.url)])
        res = regenerate_shard([row], shard="agentic-ctx", store=local_store, fleet=cfg, tokenizer=tok,
                               generation=GenerationConfig(max_new_tokens=256))
        requests, sent = srv.stats.generate_requests, srv.stats.last_body["sampling_params"]["max_new_tokens"]
    out = res.table.to_pylist()[0]
    assert requests == 1 and sent == 100 and res.stats.turns_cut_to_context == 1
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "tool"]
    assert out["agentic_stop"] == "context_length" and res.stats.conversations_stopped_at_context == 1
    assert res.stats.prompts_failed == 0


def test_max_context_tokens_keeps_generation_within_what_training_keeps(tok, local_store):
    """GenerationConfig.max_context_tokens (the drafter's max_length): the same cut-or-stop rule as an endpoint's
    context, from the config, on a server with a far larger context; prompts over it are listed as failed with
    their reason but do not fail the shard (3 of 9 here, over the default 1%), while an engine failure still
    counts; and the cap is part of config_hash only when set."""
    long = " ".join(["word"] * 80)
    rows = prompts(6) + [{"prompt_id": f"long-{i}", "system": None, "user_turns": [long]} for i in range(3)]
    gen = GenerationConfig(max_new_tokens=128, max_context_tokens=100)
    cfg = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01, context_min_new_tokens=77,
                            endpoints=[EndpointConfig(url="http://x")])
    with LoopbackServer(model_path=TARGET, context_length=32768) as srv:
        cfg = cfg.model_copy(update={"endpoints": [EndpointConfig(url=srv.url, max_concurrency=4)]})
        res = regenerate_shard(rows, shard="cap", store=local_store, fleet=cfg, generation=gen, tokenizer=tok)
        requests = srv.stats.generate_requests
        sent = srv.stats.last_body["sampling_params"]["max_new_tokens"]
    s = res.stats
    assert res.sha256 and local_store.read_parquet(layout.completions("cap")).num_rows == 6  # published
    assert requests == 6 and 77 <= sent <= 100 - 13 and s.turns_cut_to_context == 6
    assert s.conversations_stopped_at_context == 4 and res.table["num_turns"].to_pylist() == [1] * 6
    assert s.prompts_failed_context_overflow == s.prompts_over_max_context_tokens == 3
    assert sorted(res.failed["prompt_id"].to_pylist()) == ["long-0", "long-1", "long-2"]
    assert all("max_context_tokens 100" in r for r in res.failed["reason"].to_pylist())
    assert s.to_metadata()["prompts_over_max_context_tokens"] == 3
    # an engine's failures are still counted: 1 HTTP 400 in the 6 that fit, over 1% (lower bound 3.0%)
    with LoopbackServer(model_path=TARGET, fail_every=6, fail_status=400) as bad:
        cfg = cfg.model_copy(update={"endpoints": [EndpointConfig(url=bad.url, max_concurrency=1)]})
        with pytest.raises(TooManyFailedPrompts, match=r"4 of 9 prompts failed, 3 of them over max_context_tokens "
                           r"\(not counted\): 1 of 6 \(16.7%; 95% lower bound 3.0%") as info:
            regenerate_shard(rows, shard="cap2", store=local_store, fleet=cfg, generation=gen, tokenizer=tok)
    assert info.value.result.stats.prompts_over_max_context_tokens == 3
    # hashed only when set: rows generated without the field keep their hash
    assert gen.config_hash(TARGET) != gen.model_copy(update={"max_context_tokens": None}).config_hash(TARGET)
    assert GenerationConfig(max_context_tokens=None).config_hash(TARGET) == GenerationConfig().config_hash(TARGET)


@pytest.mark.parametrize("thinking", [True, False])
def test_turn_counts_over_the_table_equal_a_loop_over_its_rows(thinking):
    """The Arrow counts over a table of several chunks against the plain loop over the rows as dicts: finish
    reasons in first-seen order, blank answers by str.strip()'s whitespace (U+001C and U+3000 included), a tool
    call counting as an answer, nulls as empty."""
    import dflash_assets.generation.completions as C

    answers = ["ok", "", " \u3000\n", "\x1c", None, "x\u00a0"]
    rows = []
    for i in range(7):
        msgs = [{"role": "user", "content": f"q{i}", "reasoning_content": None, "tool_calls": None,
                 "tool_call_id": None, "name": None}]
        for t in range(1 + i % 3):
            call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] if i == 3 else None
            msgs.append({"role": "assistant", "content": answers[(i + t) % 6], "reasoning_content": answers[(i * 5 + t) % 6],
                         "tool_calls": call, "tool_call_id": None, "name": None})
        rows.append({"prompt_id": f"p{i}", "messages": msgs, "finish_reasons": ["length" if i == 4 else "stop", "tool_calls"][: 1 + i % 2],
                     "tools": "[]" if i % 2 else None, "agentic_stop": "divergent_call" if i == 5 else None})
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("prompt_id", pa.string()), ("messages", C.AGENTIC_MESSAGES_TYPE), ("finish_reasons", pa.list_(pa.string())),
        ("tools", pa.string()), ("agentic_stop", pa.string())]))
    table = pa.concat_tables([table.slice(0, 2), table.slice(2, 3), table.slice(5)])  # chunks, as read back
    assert table.column("messages").num_chunks == 3
    finish: dict[str, int] = {}
    empty_content = empty_reasoning = turns = 0
    for row in rows:
        for reason in row["finish_reasons"]:
            finish[reason] = finish.get(reason, 0) + 1
        for m in row["messages"]:
            if m["role"] == "assistant":
                turns += 1
                empty_content += not (m["content"] or "").strip() and not m.get("tool_calls")
                empty_reasoning += thinking and not (m["reasoning_content"] or "").strip()
    got = C.turn_counts(table, thinking)
    assert got == (finish, empty_content, empty_reasoning, turns) and list(got[0]) == list(finish)
    assert empty_content > 0 and turns == sum(1 + i % 3 for i in range(7))
