"""Agentic conversations: a record with tools, tool calls or tool results -> a :class:`Prompt` whose
``agentic_turns`` keep the user turns, the recorded calls and their results, or a :class:`Rejection`.

Tools and call arguments are parsed as JSON with a depth limit, tool schemas checked with ``jsonschema``; the id is
a content hash of the whole conversation (:func:`agentic_prompt_id`).

Reads the record it is given (and, for tool schemas, the ``jsonschema`` package); writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.records import (
    ASSISTANT,
    CALL,
    DEFAULT_CONFIG,
    MISSING,
    Prompt,
    ROLE_MAP,
    Rejection,
    SYSTEM,
    TOOL,
    USER,
    content_text,
    merge_system,
    parse_turns,
    read_record_fields,
    record_conversation,
    record_provenance,
    tools_given,
    unicode_normalize,
)

AGENTIC_ROLE_MAP = {
    "tool": TOOL, "function": TOOL, "observation": TOOL, "function_response": TOOL, "function-response": TOOL,
    "function_call": CALL, "function-call": CALL,
}
_AGENTIC_ROLES = {**ROLE_MAP, **AGENTIC_ROLE_MAP}  # the turn parser's role table for agentic records
TOOLS_FIELDS = ("tools", "functions")  # where a record keeps its tool definitions


def is_agentic(record: dict, turns: list) -> bool:
    """Tool definitions, a tool call or a tool result anywhere in the record."""
    for name in TOOLS_FIELDS:
        value = record.get(name)
        if value is not None and tools_given(value):
            return True
    for turn in turns:
        if isinstance(turn, dict):
            if turn.get("tool_calls") or turn.get("function_call"):
                return True
            role = turn["from"] if "from" in turn else turn.get("role")
            if isinstance(role, str) and role.strip().lower() in AGENTIC_ROLE_MAP:
                return True
    return False


class _NestedTooDeep(Exception):
    """Part of an agentic record nests deeper than its limit; the message says which part (-> ``nested_too_deep``)."""


def _nests_deeper_than(value: Any, limit: int) -> bool:
    """Does ``value`` hold objects/arrays more than ``limit`` levels deep? (``{}`` is 1 level, ``[{}]`` 2.)

    Walks level by level, without recursion, so any depth is safe to measure.
    """
    level = [value] if value.__class__ in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        inner = []
        for container in level:
            for child in (container.values() if container.__class__ is dict else container):
                if child.__class__ is dict or child.__class__ is list:
                    inner.append(child)
        level = inner
    return False


def _json_text(text: str, where: str, max_depth: int) -> Any:
    """The value of a JSON text held in a record; raises ``ValueError`` when it is not JSON and
    :class:`_NestedTooDeep` when it nests deeper than ``max_depth`` (or than the parser can go)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _NestedTooDeep(f"{where} is JSON text nested deeper than the JSON parser's recursion limit "
                             f"({sys.getrecursionlimit()})") from None
    if _nests_deeper_than(value, max_depth):
        raise _NestedTooDeep(f"{where} is JSON text nested deeper than max_json_depth {max_depth}")
    return value


_SCHEMA_VERDICTS: dict[str, str | None] = {}  # canonical parameters JSON -> why it is not a valid schema (None: valid)
_SCHEMA_VERDICTS_MAX = 4096  # tools repeat across the records of a corpus; the cache is cleared when full


def _schema_problem(parameters: dict, where: str, max_depth: int) -> str | None:
    """Why a tool's ``parameters`` are not a valid JSON Schema (Draft 2020-12, ``check_schema`` as SGLang's chat
    route runs it before answering 400), or None. Raises :class:`_NestedTooDeep` above ``max_depth`` levels,
    before ``check_schema`` (which recurses) sees it."""
    if _nests_deeper_than(parameters, max_depth):
        raise _NestedTooDeep(f"{where}: parameters nest deeper than max_tool_schema_depth {max_depth}")
    key = json.dumps(parameters, sort_keys=True, ensure_ascii=False, default=repr)
    if key in _SCHEMA_VERDICTS:
        return _SCHEMA_VERDICTS[key]
    from jsonschema import Draft202012Validator  # imported on the first tool schema, not with the module
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
        verdict = None
    except SchemaError as e:
        message = e.message if len(e.message) <= 200 else e.message[:200] + "..."
        verdict = f"parameters are not a valid JSON Schema (Draft 2020-12) at {e.json_path}: {message}"
    if len(_SCHEMA_VERDICTS) >= _SCHEMA_VERDICTS_MAX:
        _SCHEMA_VERDICTS.clear()
    _SCHEMA_VERDICTS[key] = verdict
    return verdict


def _parse_tools(record: dict, config: IngestConfig) -> tuple[list[dict] | None, str | None]:
    """(tool definitions in OpenAI form, None) or (None, why they are bad); (None, None) when there are none.

    Raises :class:`_NestedTooDeep` for tools (as JSON text) or a parameters schema nested too deep.
    """
    name = next((f for f in TOOLS_FIELDS if tools_given(record.get(f))), None)
    if name is None:
        return None, None
    value = record[name]
    if isinstance(value, str):
        if not value.strip():
            return None, None
        try:
            value = _json_text(value, f"'{name}'", config.max_json_depth)
        except ValueError as e:
            return None, f"'{name}' is not JSON: {e}"
    if not isinstance(value, list):
        return None, f"'{name}' is a JSON {type(value).__name__}, not a list"
    tools: list[dict] = []
    seen: set[str] = set()
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            return None, f"'{name}' item {k} is not an object"
        fname = fn.get("name")
        if not isinstance(fname, str) or not fname.strip():
            return None, f"'{name}' item {k} has no name"
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                return None, f"'{name}' item {k} ({fname}): parameters are not an object"
            why = _schema_problem(fn["parameters"], f"'{name}' item {k} ({fname})", config.max_tool_schema_depth)
            if why is not None:
                return None, f"'{name}' item {k} ({fname}): {why}"
        if fname in seen:
            return None, f"'{name}' defines {fname!r} twice"
        seen.add(fname)
        tools.append({"type": "function", "function": fn})
    return tools or None, None


def _call_of(raw: Any, where: str, max_depth: int) -> dict | str:
    """``{"id", "name", "arguments"}`` of one recorded call, or why it is malformed.

    Raises :class:`_NestedTooDeep` for arguments (as JSON text) nested deeper than ``max_depth``.
    """
    if not isinstance(raw, dict):
        return f"{where} is a JSON {type(raw).__name__}, not an object"
    fn = raw["function"] if isinstance(raw.get("function"), dict) else raw
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where} has no name"
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = _json_text(args, f"{where} ({name}) arguments", max_depth) if args.strip() else {}
        except ValueError:
            return f"{where} ({name}): arguments are not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"{where} ({name}): arguments are a JSON {type(args).__name__}, not an object"
    call_id = raw.get("id")
    return {"id": call_id if isinstance(call_id, str) and call_id else None, "name": name.strip(), "arguments": args}


def _raw_calls(kind: str, turn: dict, content: Any, i: int, max_depth: int) -> list | str:
    """The recorded calls of an assistant turn (maybe none), or why they are malformed.

    Raises :class:`_NestedTooDeep` for a ShareGPT call value (JSON text) nested deeper than ``max_depth``.
    """
    if kind == CALL:  # ShareGPT: the value is the JSON of one call or a list of calls
        value = content
        if isinstance(value, str):
            try:
                value = _json_text(value, f"turn {i}: the function_call value", max_depth)
            except ValueError:
                return f"turn {i}: the function_call value is not JSON"
        if isinstance(value, dict):
            return [value]
        if isinstance(value, list) and value:
            return value
        return f"turn {i}: the function_call value is a JSON {type(value).__name__}, not a call"
    calls = turn.get("tool_calls")
    if calls:
        return calls if isinstance(calls, list) else f"turn {i}: tool_calls is a {type(calls).__name__}, not a list"
    if turn.get("function_call"):
        return [turn["function_call"]]
    return []


def agentic_prompt_id(system: str | None, conversation: str) -> str:
    """Content hash of a normalized agentic conversation: 20 hex chars of sha256.

    Like :func:`prompt_id` (length-prefixed UTF-8 of ``system or ""`` and of
    ``conversation``: the canonical JSON of tools and turns, keys sorted,
    call ids left out) under another prefix, so no agentic id equals a plain one.
    """
    h = hashlib.sha256(b"dflash-agentic-prompt-v1")
    for text in (system or "", conversation):
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:20]


def normalize_agentic_record(record: dict, config: IngestConfig | None = None, *, index: int = 0) -> Prompt | Rejection:
    """A record with tools, tool calls or tool results -> an agentic :class:`Prompt`, or a :class:`Rejection`.

    The same rules as :func:`normalize_record` for system, user and leading
    assistant turns (leading assistant turns drop their tool results too);
    assistant text is dropped, recorded calls and tool results are kept.
    A call step must be followed by all its results before the next turn
    (``missing_tool_result``), except at the end of the conversation.

    Agentic records carry tool definitions (``tools`` or
    ``functions``: a list, or its JSON text, of OpenAI ``{"type": "function",
    "function": {...}}`` or bare ``{"name", "parameters"}`` objects), assistant
    tool calls (OpenAI ``tool_calls``, legacy ``function_call``; ShareGPT
    ``function_call``/``function-call`` turns whose value is the JSON of
    ``{"name", "arguments"}`` or a list of them) or tool results (role
    ``tool``/``function``; ShareGPT ``observation``/``function_response``).
    Kept: the system prompt (system turns and a top-level ``system`` field, as
    LLaMA-Factory's ShareGPT files carry it), the tool definitions (column
    ``tools``: JSON text, OpenAI form) and the sequence of user turns, recorded
    tool calls (name and arguments as an object) and tool results (column
    ``agentic_turns``: JSON text of ``{"role": "user", "content"}``,
    ``{"role": "assistant", "tool_calls": [{"id", "name", "arguments"}]}``,
    ``{"role": "tool", "content", "tool_call_id"?, "name"?}``); ``user_turns``
    holds its user turns as for a plain chat. Its id (:func:`agentic_prompt_id`)
    covers the system prompt, the tools and the turns (call ids left out), so it
    never equals a plain chat's. Malformed ones are quarantined: ``bad_tools``,
    ``bad_tool_call``, ``orphan_tool_result``, ``missing_tool_result``. A shard
    without an agentic prompt is written with ``PROMPT_SCHEMA`` alone;
    one with an agentic prompt has the two extra columns
    (``AGENTIC_PROMPT_SCHEMA``, null for its plain chats).

    Checked before anything is kept:
    nesting deeper than ``config.max_json_depth`` anywhere in the record or
    in a JSON text it holds (``tools``, call ``arguments``, a ShareGPT call
    value), or than ``config.max_tool_schema_depth`` in one tool's
    ``parameters``, is ``nested_too_deep``; ``parameters`` that are not a
    valid Draft 2020-12 JSON Schema (``check_schema``, what SGLang's chat
    route refuses with 400) are ``bad_tools``; two calls of one turn with the
    same id are ``duplicate_tool_call_id`` (quarantined, never renamed: a
    renamed id would no longer match the results the source recorded).
    """
    config = config or DEFAULT_CONFIG
    if _nests_deeper_than(record, config.max_json_depth):
        return Rejection("nested_too_deep", f"the record nests deeper than max_json_depth {config.max_json_depth}")
    try:
        return _normalize_agentic_record(record, config, index)
    except _NestedTooDeep as e:
        return Rejection("nested_too_deep", str(e))


def _normalize_agentic_record(record: dict, config: IngestConfig, index: int) -> Prompt | Rejection:
    """:func:`normalize_agentic_record` once the record's own depth is checked; raises :class:`_NestedTooDeep`."""
    where, turns = record_conversation(record)
    fields = read_record_fields(record, config)
    if fields.__class__ is Rejection:
        return fields
    top_system, record_unknown = fields
    unknown: set[str] = set(record_unknown)
    tools, why = _parse_tools(record, config)
    if why is not None:
        return Rejection("bad_tools", why)
    walk = _AgenticTurns({t["function"]["name"] for t in tools} if tools else set(), config.max_json_depth,
                         [] if top_system is None else [top_system])
    for parsed in parse_turns(turns, _AGENTIC_ROLES, where, unknown):
        if parsed.__class__ is Rejection:
            return parsed
        rejection = walk.take(*parsed)
        if rejection is not None:
            return rejection
    return _agentic_prompt(record, config, index, walk, tools, unknown, len(turns))


@dataclass
class _AgenticTurns:
    """A walk over an agentic record's turns, one :meth:`take` a turn: the events kept (user turns, call steps,
    tool results) and what the rules need on the way (the last step, the calls still without a result)."""

    declared: set[str]  # the names of the record's tools
    max_json_depth: int
    systems: list[str]  # the top-level system field, then the system turns
    events: list[dict] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    started: bool = False  # a non-system turn was seen
    has_user: bool = False
    leading: int = 0  # turns before the first user turn (dropped, tool results too)
    empty_user: int = 0
    merged: bool = False  # user turns merged
    last: str | None = None  # user | calls | tool | answer
    open_calls: int = 0  # calls of the last call step still without a result

    def take(self, i: int, turn: dict, kind: str, name: str, content: Any) -> Rejection | None:
        """One parsed turn: kept, dropped, or the record's rejection."""
        self.roles.append(name)
        if kind == SYSTEM:
            if self.started:
                return Rejection("late_system_turn", f"system turn at position {i}")
            text = content_text(content) if content is not MISSING else None
            if text is None:
                return Rejection("non_string_content", f"turn {i} (system) content is a {type(content).__name__}")
            self.systems.append(text)
            return None
        self.started = True
        if kind != USER and not self.has_user:  # before the first user turn: dropped, tool results too
            self.leading += 1
            return None
        if kind == USER:
            return self._user(i, content)
        if kind in (ASSISTANT, CALL):
            return self._call_step(i, turn, kind, name, content)
        return self._tool_result(i, turn, name, content)

    def _user(self, i: int, content: Any) -> Rejection | None:
        text = content_text(content) if content is not MISSING else None
        if text is None:
            return Rejection("non_string_content", f"turn {i} (user) content is a {type(content).__name__}")
        text = unicode_normalize("NFC", text).strip()
        if not text:
            self.empty_user += 1
            return None
        if self.open_calls:
            return Rejection("missing_tool_result", f"turn {i}: a user turn before the results of "
                                                    f"{self.open_calls} tool call(s)")
        self.has_user = True
        if self.last == "user":
            self.events[-1]["content"] += "\n\n" + text
            self.merged = True
        else:
            self.events.append({"role": "user", "content": text})
        self.last = "user"
        return None

    def _call_step(self, i: int, turn: dict, kind: str, name: str, content: Any) -> Rejection | None:
        """An assistant turn: its text is dropped; its calls, if any, become a call step awaiting their results."""
        if self.open_calls:
            return Rejection("missing_tool_result", f"turn {i}: an assistant turn before the results of "
                                                    f"{self.open_calls} tool call(s)")
        if kind == ASSISTANT and content is not MISSING and content is not None and content_text(content) is None:
            return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
        raw = _raw_calls(kind, turn, None if content is MISSING else content, i, self.max_json_depth)
        if isinstance(raw, str):
            return Rejection("bad_tool_call", raw)
        if not raw:
            self.last = "answer"
            return None
        calls = _checked_calls(raw, i, self.declared, self.max_json_depth)
        if calls.__class__ is Rejection:
            return calls
        self.events.append({"role": "assistant", "tool_calls": calls})
        self.last, self.open_calls = "calls", len(calls)
        return None

    def _tool_result(self, i: int, turn: dict, name: str, content: Any) -> Rejection | None:
        if not self.open_calls:
            return Rejection("orphan_tool_result", f"turn {i}: a tool result with no tool call before it"
                             if self.last not in ("calls", "tool") else f"turn {i}: more tool results than calls")
        if content is MISSING:
            return Rejection("bad_turn", f"turn {i} has no content")
        text = content_text(content)
        if text is None and isinstance(content, (dict, list)):
            text = json.dumps(content, ensure_ascii=False)
        if text is None:
            return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
        event: dict[str, Any] = {"role": "tool", "content": unicode_normalize("NFC", text).strip()}
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str) and turn[key]:
                event[key] = turn[key]
        self.events.append(event)
        self.open_calls -= 1
        self.last = "tool"
        return None


def _checked_calls(raw: list, i: int, declared: set[str], max_depth: int) -> list[dict] | Rejection:
    """Turn ``i``'s raw calls parsed (:func:`_call_of`), each naming a declared tool, no call id given twice."""
    calls = []
    call_of_id: dict[str, int] = {}  # call id -> the first call of this turn that carries it
    for k, one in enumerate(raw):
        call = _call_of(one, f"turn {i} call {k}", max_depth)
        if isinstance(call, str):
            return Rejection("bad_tool_call", call)
        if call["id"] is not None:
            if call["id"] in call_of_id:
                return Rejection("duplicate_tool_call_id",
                                 f"turn {i}: calls {call_of_id[call['id']]} and {k} both have id {call['id'][:60]!r}")
            call_of_id[call["id"]] = k
        if not declared:
            return Rejection("bad_tools", f"turn {i} calls {call['name']!r} but the record defines no tools")
        if call["name"] not in declared:
            return Rejection("bad_tool_call", f"turn {i} calls {call['name']!r}, not among the record's tools")
        calls.append(call)
    return calls


def _agentic_prompt(record: dict, config: IngestConfig, index: int, walk: _AgenticTurns, tools: list[dict] | None,
                    unknown: set[str], num_turns: int) -> Prompt | Rejection:
    """The walked conversation's end checks, notes, size check and id -> the :class:`Prompt`."""
    if not walk.has_user:
        return Rejection("no_user_turn", f"no non-empty user turn ({num_turns} turns)")
    if walk.open_calls and walk.last == "tool":
        return Rejection("missing_tool_result",
                         f"the conversation ends before the results of {walk.open_calls} tool call(s)")
    if walk.leading and config.leading_assistant == "quarantine":
        return Rejection("assistant_first", f"{walk.leading} assistant or tool turn(s) before the first user turn")

    system, system_notes = merge_system(walk.systems)
    notes = ["agentic", *system_notes]
    if walk.empty_user:
        notes.append("empty_user_turns_dropped")
    if walk.merged:
        notes.append("user_turns_merged")
    if walk.leading:
        notes.append("leading_assistant_dropped")
    events = walk.events
    user_turns = tuple(e["content"] for e in events if e["role"] == "user")
    tools_json = json.dumps(tools, ensure_ascii=False) if tools else None
    turns_json = json.dumps(events, ensure_ascii=False)
    chars = ((len(system) if system else 0) + len(turns_json) + (len(tools_json) if tools_json else 0))
    if chars > config.max_record_chars:
        return Rejection("oversize", f"system, tools and turns are {chars} chars > max_record_chars "
                                     f"{config.max_record_chars}")
    canonical = [({k: v for k, v in e.items() if k != "tool_call_id"} if e["role"] != "assistant"
                  else {"role": "assistant", "tool_calls": [{"name": c["name"], "arguments": c["arguments"]}
                                                            for c in e["tool_calls"]]}) for e in events]
    try:
        digest = agentic_prompt_id(system, json.dumps({"tools": tools, "turns": canonical}, ensure_ascii=False,
                                                      sort_keys=True, separators=(",", ":")))
    except UnicodeEncodeError:
        return Rejection("invalid_utf8", "lone surrogate in system, tools or turns")

    return Prompt(
        prompt_id=digest,
        system=system,
        user_turns=user_turns,
        **record_provenance(record, config, index),
        starts_mid_conversation=walk.leading > 0,
        prompt_chars=chars,
        roles=tuple(walk.roles),
        notes=tuple(notes),
        tools=tools_json,
        agentic_turns=turns_json,
        unknown_fields=tuple(sorted(unknown)),
    )
