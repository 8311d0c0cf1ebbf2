"""Agentic conversations through ingest -> raw_prompts -> completions -> tokenized_samples.

The corpus (tests/data/agentic_corpus.jsonl, written for this project) mixes OpenAI-style records (``tools``,
``tool_calls``, role ``tool``; legacy ``functions``/``function_call``/role ``function``) and ShareGPT-style ones as
LLaMA-Factory writes them (``function_call``/``observation`` turns, ``tools`` as JSON text, a top-level ``system``),
some malformed. Completions run on the SGLang-shaped loopback server, which answers tool calls by rule.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_assets.generation.completions import GenerationConfig, output_schema, regenerate_shard
from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
from dflash_assets.generation.tool_calls import parse_qwen_tool_calls, same_calls
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import list_shard_keys
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.normalization import normalize_record
from dflash_assets.prompts.quarantine import QUARANTINE_REASONS
from dflash_assets.prompts.shards import AGENTIC_PROMPT_SCHEMA, PROMPT_SCHEMA, materialize_prompt_shard
from dflash_assets.prompts.sources import sharegpt_records
from dflash_assets.store import layout
from tests.support.sglang_loopback import LoopbackServer
from dflash_assets.tokenization.samples import AGENTIC_MESSAGES_TYPE, TokenizeConfig, tokenize_completions

CORPUS = Path(__file__).parents[1] / "data" / "agentic_corpus.jsonl"
TARGET = "/models/Qwen3.6-27B"
# The loopback's calls: Lyon and Porto as the source recorded them, the currency call with another currency.
RULES = (
    ("weather in Lyon", "get_weather", {"city": "Lyon"}),
    ('"rain_mm": 4', "get_forecast", {"city": "Lyon", "days": 2}),
    ("How warm is it in Porto", "get_weather", {"city": "Porto"}),
    ("next 3 days", "get_forecast", {"city": "Porto", "days": 3}),
    ("Convert 100 EUR", "convert_currency", {"amount": 100, "from": "EUR", "to": "USD"}),
    ("Find the docs for asyncio.gather", "search_docs", {"query": "asyncio.gather"}),
)


def source_ids() -> dict[str, dict]:
    return {json.loads(line)["id"]: json.loads(line) for line in CORPUS.read_text().splitlines()}


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


@pytest.fixture(scope="module")
def enc():
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer
    from dflash_assets.tokenization.encoder import qwen3_6_encoder

    return qwen3_6_encoder(build_qwen3_6_tokenizer(), strict=True)


# -- ingest ------------------------------------------------------------------------------------------------


def test_ingest_counts_on_the_agentic_corpus(local_store):
    rep = ingest_prompt_source(CORPUS, local_store)
    assert (rep.records_read, rep.valid, rep.duplicates) == (22, 12, 1)
    assert rep.quarantined == {"bad_tool_call": 3, "bad_tools": 3, "missing_tool_result": 1, "orphan_tool_result": 2}
    assert rep.agentic_prompts == 11 and rep.notes["agentic"] == 11
    table, stats = materialize_prompt_shard(local_store, rep.shard_keys[0])
    assert table.schema.equals(AGENTIC_PROMPT_SCHEMA) and stats.agentic_prompts == 11
    rows = {r["source_id"]: r for r in table.to_pylist()}
    assert "oa-weather-lyon-again" not in rows  # the same conversation with other call ids: a duplicate
    assert rows["plain-chat"]["tools"] is None and rows["plain-chat"]["agentic_turns"] is None

    lyon = json.loads(rows["oa-weather-lyon"]["agentic_turns"])
    assert [e["role"] for e in lyon] == ["user", "assistant", "tool", "assistant", "tool"]  # the answer is dropped
    assert lyon[1]["tool_calls"] == [{"id": "c1", "name": "get_weather", "arguments": {"city": "Lyon"}}]
    assert lyon[4] == {"role": "tool", "content": '{"rain_tomorrow": true, "rain_sunday": false}', "tool_call_id": "c2"}
    assert rows["oa-weather-lyon"]["system"] == "You are a travel assistant. Use the tools when they help."
    assert rows["oa-weather-lyon"]["user_turns"] == [lyon[0]["content"]]

    docs = rows["sg-docs"]  # ShareGPT: top-level system, tools as JSON text of bare definitions
    assert docs["system"] == "You help with Python questions."
    assert json.loads(docs["tools"])[0]["type"] == "function"
    assert json.loads(docs["tools"])[0]["function"]["name"] == "search_docs"
    assert [e["role"] for e in json.loads(docs["agentic_turns"])] == ["user", "assistant", "tool"]
    parallel = json.loads(rows["sg-parallel"]["agentic_turns"])
    assert [c["arguments"]["path"] for c in parallel[1]["tool_calls"]] == ["setup.cfg", "pyproject.toml"]
    assert rows["sg-mid"]["starts_mid_conversation"]  # the call and result before the first human turn dropped
    assert json.loads(rows["oa-legacy"]["agentic_turns"])[2]["name"] == "get_weather"

    quarantine = local_store.read_parquet(rep.quarantine_key).to_pylist()
    assert {(q["source_id"], q["reason"]) for q in quarantine} == {
        ("oa-bad-args", "bad_tool_call"), ("oa-orphan", "orphan_tool_result"), ("oa-tools-object", "bad_tools"),
        ("oa-undeclared", "bad_tool_call"), ("oa-missing-result", "missing_tool_result"),
        ("sg-call-not-json", "bad_tool_call"), ("sg-orphan", "orphan_tool_result"),
        ("sg-tools-not-json", "bad_tools"), ("sg-no-tools", "bad_tools")}


def test_agentic_id_covers_tools_and_tool_turns():
    rec = source_ids()["oa-weather-lyon"]
    base = normalize_record(rec).prompt_id
    other_result = json.loads(json.dumps(rec))
    other_result["messages"][3]["content"] = '{"city": "Lyon", "temp_c": 15, "rain_mm": 4}'
    other_tools = json.loads(json.dumps(rec))
    other_tools["tools"][0]["function"]["description"] = "Weather now"
    plain = {"messages": [m for m in rec["messages"] if m["role"] in ("system", "user")]}
    ids = {base, normalize_record(other_result).prompt_id, normalize_record(other_tools).prompt_id,
           normalize_record(plain).prompt_id}
    assert len(ids) == 4


def test_plain_chats_keep_their_raw_prompts(tmp_path):
    """First 2,000 embedded ShareGPT records: the plain-chat schema, and prompt ids, shards and rows equal to the
    recorded digests of a plain-chat ingest (agentic support changes nothing for plain chats)."""
    from dflash_assets.store.backends import LocalStore

    src = tmp_path / "sharegpt2000.json"
    src.write_text(json.dumps(sharegpt_records(2000)))
    store = LocalStore(tmp_path / "store")
    rep = ingest_prompt_source(src, store, IngestConfig(max_prompts_per_shard=256))
    assert (rep.valid, rep.duplicates, rep.agentic_prompts) == (1914, 46, 0)
    ids, rows = [], hashlib.sha256()
    for key in list_shard_keys(store):
        table, _ = materialize_prompt_shard(store, key)
        assert table.schema.equals(PROMPT_SCHEMA)
        for r in table.to_pylist():
            ids.append((r["prompt_id"], r["shard"]))
            rows.update(json.dumps(r, sort_keys=True).encode())
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest() == (
        "244168e0006803449441c45ad25fe4bee1acb9197f871f3521908286a622b713")
    assert rows.hexdigest() == "57a3df0564c0f5f594e01785c9784f47b227f168b992bf5902f8614b3d8accd8"


def test_a_plain_shard_that_gains_an_agentic_prompt_keeps_its_rows(tmp_path, local_store):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                             for i in range(3)))
    ingest_prompt_source(plain, local_store)
    before, _ = materialize_prompt_shard(local_store, "shard-00000")
    assert before.schema.equals(PROMPT_SCHEMA)
    agentic = tmp_path / "agentic.jsonl"
    agentic.write_text(json.dumps(source_ids()["sg-docs"]) + "\n")
    rep = ingest_prompt_source(agentic, local_store)
    assert rep.changed_shards == ["shard-00000"]
    after, stats = materialize_prompt_shard(local_store, "shard-00000")
    assert after.schema.equals(AGENTIC_PROMPT_SCHEMA) and stats.agentic_prompts == 1
    assert after.select(PROMPT_SCHEMA.names).slice(0, 3).equals(before)
    assert after.column("agentic_turns").null_count == 3


# -- ingest never aborts on one record, tool schemas ---------------------------------------------------------


def _copy(record: dict) -> dict:
    return json.loads(json.dumps(record))


def _nested_text(depth: int) -> str:
    """JSON text of an object ``depth`` levels deep: {"a": {"a": ... {} ...}}."""
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def _write(tmp_path, records: list[dict], fmt: str) -> Path:
    """The records as a JSON array or JSONL file, written with json's C encoder (no depth limit there for text
    that is already a string; nested values are built as text by the callers)."""
    path = tmp_path / f"records.{fmt}"
    parts = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("[" + ",\n".join(parts) + "]" if fmt == "json" else "".join(p + "\n" for p in parts))
    return path


def _ingest_mixed(tmp_path, local_store, bad: dict[str, dict | str], fmt: str = "jsonl"):
    """Two good agentic records around the bad ones; returns (report, quarantine rows by source id)."""
    good = [source_ids()["oa-weather-lyon"], source_ids()["sg-docs"]]
    rep = ingest_prompt_source(_write(tmp_path, [good[0], *bad.values(), good[1]], fmt), local_store)
    assert rep.valid == 2 and rep.agentic_prompts == 2
    assert rep.records_read == rep.valid + rep.duplicates + rep.quarantined_total == 2 + len(bad)
    assert set(rep.quarantined) <= set(QUARANTINE_REASONS)  # every reason written is a documented one
    rows = {q["source_id"]: q for q in local_store.read_parquet(rep.quarantine_key).to_pylist()}
    assert set(rows) == set(bad)
    return rep, rows


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_nesting_at_any_depth_in_any_field_is_quarantined(tmp_path, local_store, fmt):
    """A record whose arguments are JSON text nested thousands deep is quarantined; the ingest does not abort with
    RecursionError."""
    lyon = source_ids()["oa-weather-lyon"]
    bad: dict[str, dict | str] = {}

    def variant(name: str, change) -> None:
        record = _copy(lyon)
        record["id"] = name
        change(record)
        bad[name] = record

    def set_args(text):
        return lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("arguments", text)

    variant("args-5000", set_args(_nested_text(5000)))  # past the JSON parser's recursion limit
    variant("args-150", set_args(_nested_text(150)))  # parses, but deeper than max_json_depth (100)
    variant("tools-text-5000", lambda r: r.__setitem__("tools", "[" * 5000 + "]" * 5000))
    sg = _copy(source_ids()["sg-docs"])
    sg["id"] = "sg-call-5000"
    sg["conversations"][1]["value"] = "[" * 5000 + "]" * 5000
    bad["sg-call-5000"] = sg
    # a tool result nested 500 deep in the record itself: the parser takes it, max_json_depth does not
    head = json.dumps({**_copy(lyon), "id": "result-500", "messages": lyon["messages"][:3]})
    assert head.endswith("}]}")
    bad["result-500"] = (head[:-2] + ', {"role": "tool", "tool_call_id": "c1", "content": ' + "[" * 500 + "]" * 500
                         + "}]}")
    # a schema 40 levels deep (inside max_json_depth): refused before jsonschema's recursive check_schema
    schema = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    variant("schema-41", lambda r: r["tools"][0]["function"].__setitem__("parameters", schema))

    rep, rows = _ingest_mixed(tmp_path, local_store, bad, fmt)
    assert rep.quarantined == {"nested_too_deep": 6}
    assert "arguments is JSON text nested deeper than the JSON parser's recursion limit" in rows["args-5000"]["detail"]
    assert "arguments is JSON text nested deeper than max_json_depth 100" in rows["args-150"]["detail"]
    assert rows["tools-text-5000"]["detail"].startswith("'tools' is JSON text nested deeper")
    assert rows["sg-call-5000"]["detail"].startswith("turn 1: the function_call value is JSON text nested deeper")
    assert rows["result-500"]["detail"] == "the record nests deeper than max_json_depth 100"
    assert rows["schema-41"]["detail"] == ("'tools' item 0 (get_weather): parameters nest deeper than "
                                           "max_tool_schema_depth 32")
    assert all(row["raw_chars"] > 0 for row in rows.values())


def test_a_recursion_error_anywhere_in_normalization_is_one_quarantined_record(tmp_path, local_store, monkeypatch):
    """The last guard in the ingest loop, for a path the depth checks would miss. Fault injection: the agentic
    normalizer raises RecursionError for one record, as Python does when a stack runs out; the real reader,
    quarantine and corpus commit run around it."""
    from dflash_assets.prompts import normalization

    real = normalization.normalize_agentic_record

    def runs_out_of_stack_on_one(record, config=None, *, index=0):
        if record.get("id") == "boom":
            raise RecursionError("maximum recursion depth exceeded")
        return real(record, config, index=index)

    monkeypatch.setattr(normalization, "normalize_agentic_record", runs_out_of_stack_on_one)
    boom = {**_copy(source_ids()["oa-weather-lyon"]), "id": "boom"}
    path = _write(tmp_path, [source_ids()["sg-docs"], boom, source_ids()["oa-currency"]], "jsonl")
    rep = ingest_prompt_source(path, local_store)
    assert rep.valid == 2 and rep.quarantined == {"nested_too_deep": 1}
    (row,) = local_store.read_parquet(rep.quarantine_key).to_pylist()
    assert row["source_id"] == "boom"
    assert row["detail"].startswith("nested too deeply to normalize (Python's recursion limit")


def test_duplicate_tool_call_ids_in_one_turn_are_quarantined(tmp_path, local_store):
    same_id = _copy(source_ids()["oa-parallel"])
    same_id["id"] = "same-id"
    same_id["messages"][1]["tool_calls"][1]["id"] = "p1"
    # one id in two different turns is not a duplicate: each step's results follow its own calls
    across = _copy(source_ids()["oa-two-queries"])
    across["id"] = "across-turns"
    later = next(m for m in across["messages"][4:] if m.get("tool_calls"))
    later["tool_calls"][0]["id"] = across["messages"][1]["tool_calls"][0]["id"]
    assert normalize_record(across).tools is not None
    rep, rows = _ingest_mixed(tmp_path, local_store, {"same-id": same_id})
    assert rep.quarantined == {"duplicate_tool_call_id": 1}
    assert rows["same-id"]["reason"] == "duplicate_tool_call_id"
    assert rows["same-id"]["detail"] == "turn 1: calls 0 and 1 both have id 'p1'"


VALID_SCHEMAS = {
    "empty": {},
    "nested": {"type": "object", "properties": {"loc": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90}, "tags": {"type": "array", "items": {"type": "string"}}}}},
        "required": ["loc"], "additionalProperties": False},
    "refs": {"$defs": {"unit": {"enum": ["C", "F"]}}, "type": "object",
             "properties": {"unit": {"$ref": "#/$defs/unit"}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "2020-12-only": {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
}
INVALID_SCHEMAS = {  # name -> (parameters, where check_schema points)
    "misspelt-type": ({"type": "object", "properties": {"city": {"type": "strin"}}}, "$.properties.city.type"),
    "required-not-a-list": ({"type": "object", "required": "city"}, "$.required"),
    "properties-a-list": ({"type": "object", "properties": [{"city": {"type": "string"}}]}, "$.properties"),
    "negative-min-length": ({"type": "string", "minLength": -1}, "$.minLength"),
}


def test_tool_parameters_must_be_a_valid_json_schema(tmp_path, local_store):
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    lyon = source_ids()["oa-weather-lyon"]

    def with_parameters(name: str, parameters: dict) -> dict:
        record = _copy(lyon)
        record["id"] = name
        record["tools"][1]["function"]["parameters"] = parameters  # the second tool: item 1
        return record

    for parameters in VALID_SCHEMAS.values():  # what jsonschema itself accepts, checked here independently
        Draft202012Validator.check_schema(parameters)
        assert normalize_record(with_parameters("ok", parameters)).tools is not None
    bad = {name: with_parameters(name, parameters) for name, (parameters, _) in INVALID_SCHEMAS.items()}
    sg = _copy(source_ids()["sg-docs"])  # ShareGPT: tools as JSON text of bare definitions
    sg["id"] = "sg-bad-schema"
    tools = json.loads(sg["tools"])
    tools[0]["parameters"]["properties"]["query"]["type"] = 7
    sg["tools"] = json.dumps(tools)
    bad["sg-bad-schema"] = sg
    for record in bad.values():
        parameters = (record["tools"][1]["function"] if "messages" in record else json.loads(record["tools"])[0]
                      )["parameters"]
        with pytest.raises(SchemaError):
            Draft202012Validator.check_schema(parameters)

    rep, rows = _ingest_mixed(tmp_path, local_store, bad)
    assert rep.quarantined == {"bad_tools": len(bad)}
    for name, (_, where) in INVALID_SCHEMAS.items():
        assert rows[name]["detail"].startswith(f"'tools' item 1 (get_forecast): parameters are not a valid JSON "
                                               f"Schema (Draft 2020-12) at {where}: ")
    assert "'strin' is not valid" in rows["misspelt-type"]["detail"]
    assert rows["sg-bad-schema"]["detail"].startswith("'tools' item 0 (search_docs): parameters are not a valid")


# -- tool calls in the target's text -------------------------------------------------------------------------


def test_qwen_tool_calls_parse_what_the_template_renders(tok):
    from dflash_assets.target_model.chat_template import ChatRenderer

    tools = json.loads(normalize_record(source_ids()["sg-two-steps"]).tools)
    calls = [{"name": "run_tests", "arguments": {"path": "tests/test_math.py", "verbose": True}},
             {"name": "read_file", "arguments": {"path": "42"}}]  # a string that reads as JSON: kept a string
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "Let me look.", "reasoning_content": "r",
                 "tool_calls": [{"type": "function", "function": c} for c in calls]}]
    text = ChatRenderer.from_tokenizer(tok)(messages, tools=tools)
    step = text.split("</think>\n\n")[-1].removesuffix("<|im_end|>\n")
    assert step.startswith("Let me look.\n\n<tool_call>\n<function=run_tests>\n<parameter=path>\ntests/test_math.py")
    content, parsed, malformed = parse_qwen_tool_calls(step, tools)
    assert (content, parsed, malformed) == ("Let me look.", calls, False)
    assert parse_qwen_tool_calls(step)[1][1]["arguments"] == {"path": 42}  # no schema: JSON where it reads as JSON
    broken = step.replace("</function>", "", 1)
    assert parse_qwen_tool_calls(broken, tools) == (broken, [], True)
    assert parse_qwen_tool_calls("just text", tools) == ("just text", [], False)


def test_same_calls_compares_parsed_json():
    a = [{"name": "f", "arguments": {"n": 1, "flag": True, "xs": [1, 2]}}]
    assert same_calls(a, [{"name": "f", "arguments": {"xs": [1.0, 2], "flag": True, "n": 1.0}}])
    assert not same_calls(a, [{"name": "f", "arguments": {"n": 1, "flag": 1, "xs": [1, 2]}}])
    assert not same_calls(a, [{"name": "g", "arguments": a[0]["arguments"]}])
    assert not same_calls(a + a, list(reversed(a + [{"name": "f", "arguments": {}}])))


def test_chat_tokenizer_keeps_tool_call_markers(tok):
    ids = tok.encode("ok\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True).count("<tool_call>") == 0  # special in this tokenizer
    assert ChatTokenizer(tok).decode(ids) == "ok\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"


# -- ingest -> completions -> samples ------------------------------------------------------------------------


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    m = np.asarray(mask, dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@pytest.mark.parametrize("route", ["sglang", "openai_parser", "openai_text"])
def test_agentic_pipeline_masks_cover_each_step(route, tok, enc, local_store, tiny_dense_target):
    rep = ingest_prompt_source(CORPUS, local_store)
    shard = rep.shard_keys[0]
    prompts, _ = materialize_prompt_shard(local_store, shard)
    kind = "sglang" if route == "sglang" else "openai"
    with LoopbackServer(model_path=TARGET, tokenizer_json=str(tiny_dense_target / "tokenizer.json"),
                        tool_rules=RULES, tool_call_parser=route == "openai_parser") as srv:
        fleet = EngineFleetConfig(target_model=TARGET, backoff_initial_s=0.01,
                                  endpoints=[EndpointConfig(url=srv.url, kind=kind)])
        res = regenerate_shard(prompts, shard=shard, store=local_store, fleet=fleet, tokenizer=tok,
                               generation=GenerationConfig(max_new_tokens=256))
        requests = srv.stats.generate_requests + srv.stats.chat_requests
        again = regenerate_shard(prompts, shard=shard, store=local_store, fleet=fleet, tokenizer=tok,
                                 generation=GenerationConfig(max_new_tokens=256))
        assert srv.stats.generate_requests + srv.stats.chat_requests == requests  # resumed from the published rows
        assert again.stats.prompts_resumed == 12 and again.stats.agentic_stopped_at_divergent_call == 6
        one = prompts.filter(pa.array([r == "oa-weather-lyon" for r in prompts.column("source_id").to_pylist()]))
        regenerate_shard(one, shard="shard-lyon", store=local_store, fleet=fleet, tokenizer=tok,
                         generation=GenerationConfig(max_new_tokens=256))
        body = srv.stats.last_body  # the last step's request carries the tool definitions and the history
        if kind == "openai":
            assert [t["function"]["name"] for t in body["tools"]] == ["get_weather", "get_forecast"]
            assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
            assert json.loads(body["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Lyon"}
        else:
            text = tok.decode(body["input_ids"])
            assert "<tools>\n" in text and text.count("<tool_response>") == 2
    table = local_store.read_parquet(layout.completions(shard))
    assert table.schema.equals(output_schema(agentic=True))
    assert table.schema.field("messages").type.equals(AGENTIC_MESSAGES_TYPE)  # what tokenization reads
    by_source = {r["source_id"]: r["prompt_id"] for r in prompts.to_pylist()}
    rows = {r["prompt_id"]: r for r in table.to_pylist()}

    lyon = rows[by_source["oa-weather-lyon"]]
    assert [m["role"] for m in lyon["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                      "assistant"]
    steps = [m for m in lyon["messages"] if m["role"] == "assistant"]
    assert [json.loads(c["function"]["arguments"]) for c in steps[0]["tool_calls"]] == [{"city": "Lyon"}]
    assert steps[1]["tool_calls"][0]["function"]["name"] == "get_forecast" and steps[2]["tool_calls"] is None
    tool_msgs = [m for m in lyon["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [s["tool_calls"][0]["id"] for s in steps[:2]]
    assert tool_msgs[1]["content"] == '{"rain_tomorrow": true, "rain_sunday": false}'  # the source's result
    assert lyon["agentic_stop"] is None and json.loads(lyon["tools"])[1]["function"]["name"] == "get_forecast"

    porto = rows[by_source["oa-two-queries"]]  # two user queries, a matching call in each
    assert [m["role"] for m in porto["messages"]] == ["user", "assistant", "tool", "assistant"] * 2
    assert porto["agentic_stop"] is None

    currency = rows[by_source["oa-currency"]]  # the target converted to USD, the source to JPY: stop there
    assert [m["role"] for m in currency["messages"]] == ["user", "assistant"]
    assert json.loads(currency["messages"][1]["tool_calls"][0]["function"]["arguments"])["to"] == "USD"
    assert currency["agentic_stop"] == "divergent_call"
    parallel = rows[by_source["oa-parallel"]]  # the source called, the target answered: stop too
    assert parallel["agentic_stop"] == "divergent_call" and len(parallel["messages"]) == 2
    assert rows[by_source["plain-chat"]]["tools"] is None  # plain chats as before
    assert [m["role"] for m in rows[by_source["plain-chat"]]["messages"]] == ["user", "assistant"]

    stopped = sum(r["agentic_stop"] == "divergent_call" for r in rows.values())
    assert stopped == 6 and res.stats.agentic_stopped_at_divergent_call == 6  # currency, parallel, legacy, 3 ShareGPT
    assert res.stats.agentic_conversations == 11 and res.stats.empty_content == 0
    assert res.stats.agentic_tool_calls == 6  # Lyon 2, Porto 2, currency 1, docs 1

    samples, stats = tokenize_completions(table, enc)
    assert stats.dropped == {} and stats.agentic_samples == 11
    sample = next(s for s in samples.to_pylist() if s["prompt_id"] == lyon["prompt_id"])
    spans = _spans(sample["loss_mask"])
    assert len(spans) == 3  # one per step after the last user query
    texts = [enc.tokenizer.decode(sample["input_ids"][a:b]) for a, b in spans]
    assert "<function=get_weather>\n<parameter=city>\nLyon\n</parameter>" in texts[0]
    assert "<function=get_forecast>" in texts[1] and "<tool_call>" not in texts[2]
    assert all(t.endswith("<|im_end|>\n") for t in texts)
    context = enc.tokenizer.decode(sample["input_ids"])
    assert context.count("<tool_response>") == 2 and not any("<tool_response>" in t for t in texts)
    every = tokenize_completions(table, enc, TokenizeConfig(supervise="every_turn"))[0]
    assert sum(s["prompt_id"] == porto["prompt_id"] for s in every.to_pylist()) == 2


def test_completions_schema_of_plain_shards_is_unchanged():
    assert output_schema().field("messages").type.equals(
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])))
    assert output_schema(agentic=True).names == output_schema().names + ["tools", "agentic_stop"]
