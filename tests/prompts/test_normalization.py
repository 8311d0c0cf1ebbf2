"""Every piece of a record's text is kept in its prompt, or the record is quarantined whole (normalization, ingest).

The fields that carry conversation content (a top-level ``system``, tools, role names) are kept; fields the
normalizer does not read are counted by name in the ingest report; content a prompt has no place for sends the
record to the quarantine. The property test generates records of every supported shape (ShareGPT and OpenAI,
plain and agentic) from a seeded random generator, ingests them from a real JSONL file into a LocalStore, and
checks each string of each record against the stored prompt row, the report or the quarantine row.
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import list_shard_keys
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.normalization import Prompt, Rejection, normalize_record, prompt_id
from dflash_assets.prompts.quarantine import QUARANTINE_REASONS
from dflash_assets.prompts.shards import materialize_prompt_shard
from dflash_assets.store import layout
from dflash_assets.store.backends import LocalStore


def conv(*turns, **extra):
    return {"conversations": [{"from": r, "value": v} for r, v in turns], **extra}


def msgs(*turns, **extra):
    return {"messages": [{"role": r, "content": v} for r, v in turns], **extra}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


# --- a top-level system field ------------------------------------------------------------------------------


def test_sharegpt_system_field_is_the_system_prompt_and_part_of_the_id():
    plain = normalize_record(conv(("human", "What is 2+2?"), ("gpt", "4")))
    with_system = normalize_record(conv(("human", "What is 2+2?"), ("gpt", "4"), system="  Answer in French. "))
    assert isinstance(with_system, Prompt) and with_system.system == "Answer in French."
    assert with_system.prompt_id == prompt_id("Answer in French.", ("What is 2+2?",)) != plain.prompt_id
    assert plain.system is None and plain.prompt_id == prompt_id(None, ("What is 2+2?",))
    # the same prompt as a system turn, and in the OpenAI shape
    as_turn = normalize_record(conv(("system", "Answer in French."), ("human", "What is 2+2?")))
    openai = normalize_record(msgs(("user", "What is 2+2?"), system="Answer in French."))
    assert as_turn.prompt_id == openai.prompt_id == with_system.prompt_id


def test_system_field_then_system_turns_are_merged_and_parts_are_text():
    p = normalize_record(conv(("system", "Be brief."), ("human", "q"), system="You are a tutor."))
    assert p.system == "You are a tutor.\n\nBe brief." and "system_turns_merged" in p.notes
    parts = normalize_record(msgs(("user", "q"), system=[{"type": "text", "text": "You are "},
                                                         {"type": "text", "text": "a tutor."}]))
    assert parts.system == "You are a tutor."
    blank = normalize_record(conv(("human", "q"), system="  "))
    assert blank.system is None and blank.notes == ("empty_system_dropped",)
    assert normalize_record(conv(("human", "q"), system=None)).system is None  # null: no system field


@pytest.mark.parametrize("system", [42, {"text": "x"}, [{"type": "image_url", "image_url": {"url": "u"}}]])
def test_system_field_that_is_not_text_is_quarantined(system):
    for record in (conv(("human", "q"), system=system), msgs(("user", "q"), tools=TOOLS, system=system)):
        r = normalize_record(record)
        assert isinstance(r, Rejection) and r.reason == "non_string_content" and "'system' field" in r.detail


# --- content a prompt has no place for ---------------------------------------------------------------------------


@pytest.mark.parametrize("record, detail", [
    ({"conversations": [{"from": "human", "value": "a"}], "messages": [{"role": "user", "content": "b"}]},
     "both 'conversations' and 'messages'"),
    (msgs(("user", "q"), tools=TOOLS, functions=[TOOLS[0]["function"]]), "both 'tools' and 'functions'"),
    ({"conversations": [{"from": "human", "role": "assistant", "value": "q"}]}, "both 'from' and 'role'"),
    ({"conversations": [{"from": "human", "value": "q", "content": "other q"}]}, "both 'value' and 'content'"),
    ({"messages": [{"role": "user", "name": "alice", "content": "q"}]}, "'name'"),
    ({"messages": [{"role": "system", "name": "example_user", "content": "s"}, {"role": "user", "content": "q"}]},
     "'name'"),
    ({"messages": [{"role": "user", "content": "q", "tool_call_id": "c1"}]}, "'tool_call_id'"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather",
                                                                                  "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny",
                    "tool_calls": [{"id": "c2", "function": {"name": "get_weather", "arguments": "{}"}}]}],
      "tools": TOOLS}, "'tool_calls'"),
])
def test_content_without_a_place_in_the_prompt_is_quarantined(record, detail):
    r = normalize_record(record)
    assert isinstance(r, Rejection) and r.reason == "unkept_content", r
    assert detail in r.detail and "unkept_content" in QUARANTINE_REASONS


def test_fields_that_repeat_the_same_content_or_carry_none_are_accepted():
    same = normalize_record({"conversations": [{"from": "human", "role": "human", "value": "q", "content": "q"}]})
    assert isinstance(same, Prompt) and same.user_turns == ("q",)
    empty_other = normalize_record({"conversations": [], "messages": [{"role": "user", "content": "q"}]})
    assert isinstance(empty_other, Prompt) and empty_other.user_turns == ("q",)
    # a Parquet row of mixed shapes: the other shape's fields are null
    row = {"conversations": None, "messages": [{"from": None, "value": None, "role": "user", "content": "q",
                                                "name": None}], "system": None, "tools": None}
    p = normalize_record(row)
    assert isinstance(p, Prompt) and p.unknown_fields == () and p.user_turns == ("q",)
    # tools given once, the other list empty: the tools are kept
    legacy = normalize_record({"messages": [{"role": "user", "content": "weather?"}], "tools": [],
                               "functions": [TOOLS[0]["function"]]})
    assert isinstance(legacy, Prompt) and json.loads(legacy.tools)[0]["function"]["name"] == "get_weather"


# --- fields the normalizer does not read --------------------------------------------------------------------------


def test_unknown_fields_are_named_on_the_prompt():
    record = {"id": "r1", "model": "gpt-4", "lang": None, "category": "coding",
              "conversations": [{"from": "human", "value": "q", "weight": 0, "markdown": None},
                                {"from": "gpt", "value": "a", "weight": 1}]}
    p = normalize_record(record)
    assert p.unknown_fields == ("conversations[].weight", "model")  # null values carry nothing: not named
    p = normalize_record(record, IngestConfig(category_field="lang"))
    assert p.unknown_fields == ("category", "conversations[].weight", "model")
    agentic = normalize_record(msgs(("user", "q"), tools=TOOLS, source="glaive"))
    assert agentic.tools is not None and agentic.unknown_fields == ("source",)
    assert normalize_record(conv(("human", "q"), id="x", system="s", category="c")).unknown_fields == ()


def test_the_ingest_report_counts_unknown_fields_per_source(tmp_path):
    records = [
        {"id": "a", "model": "m1", "conversations": [{"from": "human", "value": "q1", "weight": 1}]},
        {"id": "b", "model": "m2", "conversations": [{"from": "human", "value": "q2"}]},
        {"id": "dup", "model": "m3", "conversations": [{"from": "human", "value": "q2"}]},  # a duplicate of b
        {"id": "c", "conversations": [{"from": "human", "value": "q3"}], "system": "Be kind."},
        {"id": "d", "hash": "h", "conversations": "not a list"},  # quarantined whole: nothing dropped
    ]
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    store = LocalStore(tmp_path / "store")
    report = ingest_prompt_source(path, store)
    assert (report.valid, report.duplicates, report.quarantined) == (3, 1, {"missing_conversation": 1})
    assert report.unknown_fields == {"conversations[].weight": 1, "model": 3}
    assert report.to_metadata()["unknown_fields"] == {"conversations[].weight": 1, "model": 3}
    assert store.read_json(layout.corpus_report(report.source_name))["unknown_fields"] == report.unknown_fields
    (key,) = list_shard_keys(store)
    rows = {r["source_id"]: r for r in materialize_prompt_shard(store, key)[0].to_pylist()}
    assert rows["c"]["system"] == "Be kind." and rows["a"]["system"] is None


# --- the property: each piece of text is kept, counted or quarantined ---------------------------------------------

ASSISTANT_ROLES = ("gpt", "chatgpt", "bing", "bard", "assistant")  # their text is dropped by design
KNOWN_TURN_FIELDS = {"from", "value", "role", "content", "tool_calls", "function_call", "tool_call_id", "name"}
KNOWN_RECORD_FIELDS = {"conversations", "messages", "system", "tools", "functions", "id", "category"}
SHAPES = ("sharegpt", "openai", "sharegpt_agentic", "openai_agentic")


class RecordGenerator:
    """Seeded random records of every supported shape; each text holds a unique «n» tag, so no two texts
    overlap and no two records are duplicates. About a quarter get one fault from :data:`FAULTS`."""

    FAULTS = ("both_lists", "name_on_user", "role_conflict", "content_conflict", "system_not_text", "late_system",
              "unknown_role", "both_tool_lists", "undeclared_call", "blank_users", "tool_calls_on_user")

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.n = 0

    def text(self) -> str:
        rng = self.rng
        self.n += 1
        body = " ".join(rng.choices(["alpha", "Cafe\u0301", "日本", "🎉", '"quoted"', "back\\slash", "a\nb",
                                     "<b>", "x\ty", "naïve"], k=rng.randint(0, 4)))
        return rng.choice(["", " ", "\n", "  "]) + f"«{self.n}» {body}" + rng.choice(["", " ", "\n"])

    def record(self, shape: str) -> dict:
        rng = self.rng
        rec = self._agentic(shape) if shape.endswith("agentic") else self._plain(shape)
        if rng.random() < 0.6:
            rec["id"] = f"id«{self._tag()}»"
        if rng.random() < 0.3:
            rec["category"] = self.text()
        if rng.random() < 0.3 and "system" not in rec:
            rec["system"] = self.text() if rng.random() < 0.7 else [{"type": "text", "text": self.text()},
                                                                     {"type": "text", "text": self.text()}]
        if rng.random() < 0.25:
            rec[rng.choice(["model", "lang", "source"])] = self.text()
        if rng.random() < 0.25:
            self._fault(rec, rng.choice(self.FAULTS))
        return rec

    def _tag(self) -> int:
        self.n += 1
        return self.n

    def _turn(self, sharegpt: bool, role: str, content: Any) -> dict:
        turn = {"from": role, "value": content} if sharegpt else {"role": role, "content": content}
        if self.rng.random() < 0.1:
            turn[self.rng.choice(["weight", "markdown"])] = self.text()
        return turn

    def _user_content(self, sharegpt: bool) -> Any:
        if not sharegpt and self.rng.random() < 0.2:
            return [{"type": "text", "text": self.text()}, {"type": "text", "text": self.text()}]
        return self.text() if self.rng.random() > 0.05 else "   "

    def _plain(self, shape: str) -> dict:
        rng, sharegpt = self.rng, shape == "sharegpt"
        user = rng.choice(["human", "user", "Human"]) if sharegpt else "user"
        turns = [self._turn(sharegpt, "system", self.text()) for _ in range(rng.choice([0, 0, 1, 2]))]
        if rng.random() < 0.15:
            turns.append(self._turn(sharegpt, rng.choice(ASSISTANT_ROLES), self.text()))
        for _ in range(rng.randint(1, 3)):
            turns.append(self._turn(sharegpt, user, self._user_content(sharegpt)))
            if rng.random() < 0.7:
                turns.append(self._turn(sharegpt, rng.choice(ASSISTANT_ROLES) if sharegpt else "assistant",
                                        self.text()))
        return {"conversations" if sharegpt else "messages": turns}

    def _agentic(self, shape: str) -> dict:
        rng, sharegpt = self.rng, shape == "sharegpt_agentic"
        defs = [{"name": f"fn«{self._tag()}»", "description": self.text(),
                 "parameters": {"type": "object", "properties": {f"arg«{self._tag()}»": {
                     "type": "string", "description": self.text()}}}} for _ in range(rng.randint(1, 2))]
        rec: dict[str, Any] = {}
        if sharegpt:
            rec["tools"] = json.dumps(defs, ensure_ascii=False) if rng.random() < 0.5 else defs
        elif rng.random() < 0.8:
            rec["tools"] = [{"type": "function", "function": d} for d in defs]
        else:
            rec["functions"] = defs
        turns: list[dict] = []
        if rng.random() < 0.3:
            turns.append(self._turn(sharegpt, "system", self.text()))
        if rng.random() < 0.15:  # the tail of an earlier conversation: a call and its result, dropped
            turns += self._call_step(sharegpt, defs)
        for _ in range(rng.randint(1, 2)):
            turns.append(self._turn(sharegpt, "human" if sharegpt else "user", self._user_content(sharegpt)))
            if rng.random() < 0.8:
                turns += self._call_step(sharegpt, defs)
            if rng.random() < 0.6:
                turns.append(self._turn(sharegpt, "gpt" if sharegpt else "assistant", self.text()))
        rec["conversations" if sharegpt else "messages"] = turns
        return rec

    def _call_step(self, sharegpt: bool, defs: list[dict]) -> list[dict]:
        rng = self.rng
        calls = []
        for _ in range(rng.randint(1, 2)):
            d = rng.choice(defs)
            calls.append({"name": d["name"], "arguments": {next(iter(d["parameters"]["properties"])): self.text()}})
        if sharegpt:
            value = calls[0] if len(calls) == 1 else calls
            return [{"from": "function_call", "value": json.dumps(value, ensure_ascii=False)}] + [
                {"from": rng.choice(["observation", "function_response", "tool"]), "value": self.text()}
                for _ in calls]
        tool_calls = []
        for c in calls:
            args = json.dumps(c["arguments"], ensure_ascii=False) if rng.random() < 0.5 else c["arguments"]
            tool_calls.append({"id": f"call«{self._tag()}»", "type": "function",
                               "function": {"name": c["name"], "arguments": args}})
        step = [{"role": "assistant", "content": self.text() if rng.random() < 0.3 else None, "tool_calls": tool_calls}]
        for tc in tool_calls:
            result = {"role": "tool", "tool_call_id": tc["id"], "content": self.text()}
            if rng.random() < 0.3:
                result["name"] = tc["function"]["name"]
            step.append(result)
        return step

    def _fault(self, rec: dict, fault: str) -> None:
        rng = self.rng
        key = "conversations" if "conversations" in rec else "messages"
        turns = rec[key]
        users = [t for t in turns if (t.get("from") or t.get("role")) in ("human", "user", "Human")]
        if fault == "both_lists":
            rec["messages" if key == "conversations" else "conversations"] = [{"role": "user", "content": self.text()}]
        elif fault == "name_on_user":
            users[0]["name"] = self.text()
        elif fault == "role_conflict":
            users[0]["role" if "from" in users[0] else "from"] = "assistant"
        elif fault == "content_conflict":
            users[0]["content" if "value" in users[0] else "value"] = self.text()
        elif fault == "system_not_text":
            rec["system"] = {"text": self.text()}
        elif fault == "late_system":
            turns.append({"from": "system", "value": self.text()} if key == "conversations"
                         else {"role": "system", "content": self.text()})
        elif fault == "unknown_role":
            turns.insert(rng.randrange(len(turns) + 1), {"from": "narrator", "value": self.text()})
        elif fault == "both_tool_lists":
            rec["functions" if "tools" in rec else "tools"] = [{"name": f"fn«{self._tag()}»"}]
        elif fault == "undeclared_call":
            turns.insert(turns.index(users[0]) + 1, {"role": "assistant", "tool_calls": [
                {"id": "x", "function": {"name": f"fn«{self._tag()}»", "arguments": {"a": self.text()}}}]})
        elif fault == "blank_users":
            for t in users:
                t["value" if "value" in t else "content"] = " \n"
        elif fault == "tool_calls_on_user":
            users[0]["tool_calls"] = [{"id": "y", "function": {"name": "f", "arguments": {"b": self.text()}}}]


def _json_leaves(value: Any, keys: bool = False) -> Iterator[str]:
    """Every string in a JSON value (dict keys too with ``keys``), ``type`` markers of OpenAI objects left out."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _json_leaves(v, keys)
    elif isinstance(value, dict):
        for k, v in value.items():
            if keys:
                yield k
            if not (k == "type" and v in ("function", "text", "object", "string")):
                yield from _json_leaves(v, keys)


def _parsed(value: Any) -> Any:
    """A JSON text held in a record (tools, call arguments, a ShareGPT call), parsed; other values as they are."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _calls(value: Any) -> Any:
    """Tool calls with their arguments parsed when they are JSON text."""
    if isinstance(value, list):
        return [_calls(v) for v in value]
    if isinstance(value, dict):
        return {k: (_parsed(v) if k == "arguments" else _calls(v)) for k, v in value.items()}
    return value


def _pieces(record: dict) -> Iterator[tuple[str, str, str | None]]:
    """(how the ingest must account for it, text, field) for each string of a record: ``keep`` (in the prompt
    row), ``role`` (in the report's roles), ``unknown`` (the field named in the report's unknown_fields) or
    ``dropped`` (assistant text and what comes before the first user turn: dropped by design)."""
    for key, value in record.items():
        if key in ("conversations", "messages"):
            yield from _turn_pieces(key, value)
        elif key in ("tools", "functions"):
            yield from (("keep", s, key) for s in _json_leaves(_parsed(value), keys=True))
        elif key in KNOWN_RECORD_FIELDS:
            yield from (("keep", s, key) for s in _json_leaves(value))
        else:
            yield from (("unknown", s, key) for s in _json_leaves(value))


def _turn_pieces(key: str, turns: list) -> Iterator[tuple[str, str, str | None]]:
    def role_of(t: dict) -> str:
        return (t.get("from") or t.get("role")).strip().lower()

    def text_of(t: dict) -> str:
        content = t.get("value", t.get("content"))
        return "".join(_json_leaves(content)) if content is not None else ""

    first_user = next((i for i, t in enumerate(turns) if role_of(t) in ("human", "user") and text_of(t).strip()),
                      len(turns))
    for i, turn in enumerate(turns):
        role = role_of(turn)
        for field, value in turn.items():
            if field in ("from", "role"):
                yield "role", value, field
            elif field not in KNOWN_TURN_FIELDS:
                yield from (("unknown", s, f"{key}[].{field}") for s in _json_leaves(value))
            elif (i < first_user and role != "system") or (role in ASSISTANT_ROLES and field != "tool_calls"
                                                              and field != "function_call"):
                yield from (("dropped", s, field) for s in _json_leaves(value))
            elif role == "function_call" or field in ("tool_calls", "function_call"):
                yield from (("keep", s, field) for s in _json_leaves(_calls(_parsed(value)), keys=True))
            else:
                yield from (("keep", s, field) for s in _json_leaves(value))


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text).strip()


@pytest.mark.parametrize("seed", [1, 2])
def test_every_piece_of_text_is_kept_counted_or_quarantined(tmp_path, seed):
    gen = RecordGenerator(seed)
    shapes = [SHAPES[k % len(SHAPES)] for k in range(200)]
    records = [gen.record(shape) for shape in shapes]
    path = tmp_path / "generated.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    store = LocalStore(tmp_path / "store")
    report = ingest_prompt_source(path, store, IngestConfig(quarantine_raw_chars=1 << 20))

    rows = {}
    for key in list_shard_keys(store):
        rows.update({r["source_index"]: r for r in materialize_prompt_shard(store, key)[0].to_pylist()})
    quarantined = {q["source_index"]: q for q in store.read_parquet(report.quarantine_key).to_pylist()}
    assert report.records_read == len(records) and report.duplicates == 0
    assert rows.keys().isdisjoint(quarantined) and rows.keys() | quarantined.keys() == set(range(len(records)))

    kept_by_shape: Counter[str] = Counter()
    for index, record in enumerate(records):
        if index in quarantined:  # the whole record, and why
            q = quarantined[index]
            assert json.loads(q["raw"]) == record and q["raw_chars"] == len(q["raw"])
            assert q["reason"] in QUARANTINE_REASONS and q["detail"]
            continue
        row = rows[index]
        kept_by_shape[shapes[index]] += 1
        kept = [row["system"] or "", *row["user_turns"], row["source_id"], row["category"]]
        for column in ("tools", "agentic_turns"):
            if row.get(column):
                kept += _json_leaves(json.loads(row[column]), keys=True)
        for how, text, field in _pieces(record):
            if not text.strip() or how == "dropped":
                continue
            if how == "role":
                assert text.strip().lower() in report.roles, (index, text)
            elif how == "unknown":
                assert report.unknown_fields.get(field, 0) > 0, (index, field)
            else:
                assert any(text.strip() in k or _nfc(text) in k for k in kept), (index, field, text, record, row)

    # every shape gave kept prompts and quarantined records, for more than one reason
    assert set(kept_by_shape) == set(SHAPES)
    assert {shapes[i] for i in quarantined} == set(SHAPES)
    assert len(report.quarantined) >= 5 and report.quarantined.get("unkept_content", 0) > 0
    assert report.unknown_fields and report.notes.get("system_turns_merged", 0) > 0
