"""Prompt normalization: one source record -> a :class:`Prompt` (plain chat or agentic) or a :class:`Rejection`.

Plain chats (ShareGPT ``conversations`` or OpenAI ``messages``) go through
:func:`normalize_record`; a record with tools, tool calls or tool results goes
on to :func:`normalize_agentic_record`. Both read a turn's role and content
with one turn parser (:func:`_parse_turns`) and the one role table
(:data:`ROLE_MAP`, plus :data:`AGENTIC_ROLE_MAP` for agentic records). A
prompt's id is a content hash (:func:`prompt_id`, :func:`agentic_prompt_id`);
a rejection carries a reason code of
:data:`dflash_assets.prompts.quarantine.QUARANTINE_REASONS`. Every field that
carries conversation content (:data:`RECORD_FIELDS`, :data:`TURN_FIELDS`) is
kept in the prompt, or the record is rejected (``unkept_content`` when the
prompt has no place for it); other non-null fields are named in
``Prompt.unknown_fields`` for the ingest to count.

Reads the record it is given (and, for tool schemas, the ``jsonschema``
package); writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dflash_assets.prompts.config import IngestConfig

__all__ = [
    "USER",
    "ASSISTANT",
    "SYSTEM",
    "ROLE_MAP",
    "AGENTIC_ROLE_MAP",
    "Prompt",
    "Rejection",
    "normalize_record",
    "normalize_agentic_record",
    "prompt_id",
    "agentic_prompt_id",
    "record_id_text",
    "RECORD_FIELDS",
    "TURN_FIELDS",
]


USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLE_MAP = {
    "human": USER, "user": USER,
    "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT, "assistant": ASSISTANT,
    "system": SYSTEM,
}


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    system: str | None
    user_turns: tuple[str, ...]
    source_id: str
    category: str
    starts_mid_conversation: bool
    prompt_chars: int
    roles: tuple[str, ...]  # source roles (lower-cased) of the record's turns
    notes: tuple[str, ...] = ()  # what normalization changed, e.g. "user_turns_merged"
    tools: str | None = None  # agentic: JSON text of the tool definitions (OpenAI form)
    agentic_turns: str | None = None  # agentic: JSON text of user turns, recorded tool calls and tool results
    unknown_fields: tuple[str, ...] = ()  # non-null fields not read, e.g. "model", "conversations[].weight"


@dataclass(frozen=True)
class Rejection:
    reason: str  # a key of quarantine.QUARANTINE_REASONS
    detail: str


# --- normalization -------------------------------------------------------------

_MISSING = object()

# The fields content is read from (with IngestConfig.category_field); any other non-null field of a record or
# of a turn is not kept and is named in Prompt.unknown_fields ("model", "conversations[].weight").
RECORD_FIELDS = frozenset({"conversations", "messages", "system", "tools", "functions", "id"})
TURN_FIELDS = frozenset({"from", "value", "role", "content", "tool_calls", "function_call", "tool_call_id", "name"})
_NOT_ON_USER_TURNS = ("name", "tool_calls", "function_call", "tool_call_id")  # nowhere to keep them in a prompt


def _carries(value: Any) -> bool:
    """Does a field's value hold anything (not null, not an empty string, list or object)?"""
    return value is not None and value != "" and value != [] and value != {}


def _tools_given(value: Any) -> bool:
    """Does a ``tools``/``functions`` value define anything (an empty list, or its JSON text, does not)?"""
    return value is not None and value != [] and not (isinstance(value, str) and value.strip() in ("", "[]"))


def _read_record_fields(record: dict, config: IngestConfig) -> tuple[str | None, frozenset[str]] | Rejection:
    """(the top-level ``system`` text or None, names of the record's unknown non-null fields), or a
    :class:`Rejection` when the record holds content a prompt cannot keep whole: two conversation lists, two
    tool lists (``unkept_content``), a ``system`` field that is not text (``non_string_content``)."""
    if "messages" in record and "conversations" in record and _carries(record["conversations"]) and _carries(
            record["messages"]):
        return Rejection("unkept_content", "the record has both 'conversations' and 'messages'; a prompt keeps one")
    if "functions" in record and "tools" in record and _tools_given(record["tools"]) and _tools_given(
            record["functions"]):
        return Rejection("unkept_content", "the record has both 'tools' and 'functions'; a prompt keeps one")
    system = record.get("system")
    if system is not None:
        system = _content_text(system)
        if system is None:
            return Rejection("non_string_content",
                             f"the record's 'system' field is a {type(record['system']).__name__}")
    extra = record.keys() - RECORD_FIELDS
    if not extra:
        return system, _NONE
    return system, frozenset(k for k in extra if k != config.category_field and record[k] is not None)


_NONE: frozenset[str] = frozenset()


_normalize = unicodedata.normalize


def _nfc(text: str) -> str:
    return _normalize("NFC", text).strip()


def _content_text(content: Any) -> str | None:
    """The text of a turn's content, or None when it is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                return None
            parts.append(part["text"])
        return "".join(parts)
    return None


def _parse_turns(turns: list, role_map: dict[str, str], where: str,
                 unknown: set[str]) -> Iterator[tuple[int, dict, str, str, Any] | Rejection]:
    """The turns of a conversation, each as ``(i, turn, kind, role name, content)``, or a :class:`Rejection`
    for the first malformed one (the caller returns it): the one turn parser of both normalizers.

    A turn is ShareGPT (``from``/``value``) or OpenAI (``role``/``content``), the other content key accepted
    too, a null role or content read as absent when the other key has one (a Parquet row of mixed shapes holds
    both, one null); ``content`` is ``_MISSING`` when the turn has none (each normalizer decides what that means). The
    role is looked up in ``role_map`` as written, else stripped and lower-cased (the name given is then the
    lower-cased role; the map's keys are lower-case); a role in neither form is ``unknown_role``. A turn with
    two roles or two contents that differ, or a user or system turn carrying ``name``, tool calls or a tool
    call id, is ``unkept_content``. Non-null fields outside :data:`TURN_FIELDS` are added to ``unknown`` as
    ``<where>[].<field>`` (``where``: the record's list, ``conversations`` or ``messages``). A generator, not a
    call per turn: normalization is the ingest's hot loop.
    """
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            yield Rejection("bad_turn", f"turn {i} is a {type(turn).__name__}")
            return
        # A role and a content and nothing else (nearly every turn) needs no look at other fields.
        plain = len(turn) == 2 and (("from" in turn and "value" in turn) or ("role" in turn and "content" in turn))
        if not plain:
            if (why := _two_of_a_kind(turn)) is not None:
                yield Rejection("unkept_content", f"turn {i} has {why}")
                return
            for key in turn.keys() - TURN_FIELDS:
                if turn[key] is not None:
                    unknown.add(f"{where}[].{key}")
        if "from" in turn and (turn["from"] is not None or turn.get("role") is None):
            role, first, second = turn["from"], "value", "content"
        elif "role" in turn:
            role, first, second = turn["role"], "content", "value"
        else:
            yield Rejection("bad_turn", f"turn {i} has no 'from' or 'role'")
            return
        content = turn.get(first, _MISSING)
        if content is None or content is _MISSING:  # a null field is no content: the other key, if it has one
            other = turn.get(second, _MISSING)
            if other is not _MISSING and (other is not None or content is _MISSING):
                content = other
        if not isinstance(role, str):
            yield Rejection("bad_turn", f"turn {i} role is a {type(role).__name__}")
            return
        kind = role_map.get(role)
        name = role
        if kind is None:
            name = role.strip().lower()
            kind = role_map.get(name)
            if kind is None:
                yield Rejection("unknown_role", f"turn {i} role {role[:40]!r}")
                return
        if not plain and (kind == USER or kind == SYSTEM or kind == TOOL):
            kept = ("tool_call_id", "name") if kind == TOOL else ()
            for key in _NOT_ON_USER_TURNS:
                if key not in kept and _carries(turn.get(key)):
                    yield Rejection("unkept_content", f"turn {i} ({name}) carries {key!r}, which a prompt has "
                                                      f"no place for on a {kind} turn")
                    return
        yield i, turn, kind, name, content


def _two_of_a_kind(turn: dict) -> str | None:
    """Two roles (``from`` and ``role``) or two contents (``value`` and ``content``) that differ, or None."""
    for a, b in (("from", "role"), ("value", "content")):
        if turn.get(a) is not None and turn.get(b) is not None and turn[a] != turn[b]:
            return f"both {a!r} and {b!r}, and they differ (a prompt keeps one)"
    return None


def record_id_text(value: Any) -> str | None:
    """A record's ``id`` as text (a string or an integer, invalid UTF-8 escaped), or None when it has none."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        text = str(value)
        return text.encode("utf-8", "backslashreplace").decode("utf-8") if text else None
    return None


def prompt_id(system: str | None, user_turns: Iterable[str]) -> str:
    """Content hash of a normalized prompt: 20 hex chars of sha256.

    The hash covers, for ``system or ""`` and then each user turn, the UTF-8
    byte length as 8 bytes big-endian followed by the UTF-8 bytes. Raises
    ``UnicodeEncodeError`` on text that is not valid Unicode (lone surrogates).
    """
    h = hashlib.sha256(b"dflash-prompt-v1")
    for text in (system or "", *user_turns):
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:20]


def _provenance(record: dict, config: IngestConfig, index: int) -> dict[str, str]:
    """The record's `source_id` (its id, else its position) and `category` (NFC, "unknown" when absent)."""
    category = record.get(config.category_field)
    category = _nfc(category) if isinstance(category, str) else ""
    if category:
        category = category.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"source_id": record_id_text(record.get("id")) or f"#{index}", "category": category or "unknown"}


def normalize_record(record: Any, config: IngestConfig | None = None, *, index: int = 0) -> Prompt | Rejection:
    """One source record -> a :class:`Prompt`, or a :class:`Rejection` with a reason code.

    - Records are ShareGPT (``conversations`` of ``from``/``value``) or OpenAI
      (``messages`` of ``role``/``content``; content a string or a list of
      ``{"type": "text"}`` parts). Roles, case-insensitive: human/user -> user;
      gpt/chatgpt/bing/bard/assistant -> assistant; system -> system. A record
      with tools, tool calls or tool results goes to :func:`normalize_agentic_record`.
    - Assistant turns are dropped (the target regenerates every completion).
      What is kept: the system prompt (a top-level ``system`` field, text or
      text parts, then leading system turns; none when neither is there) and
      the user turns in order; the regenerator answers after each user turn.
    - Content a prompt cannot keep whole is quarantined as ``unkept_content``
      (both ``conversations`` and ``messages``, both ``tools`` and
      ``functions``, a turn with two roles or two contents that differ, a user
      or system turn carrying ``name``, tool calls or a tool call id); a
      ``system`` field that is not text is ``non_string_content``. Any other
      non-null field (outside :data:`RECORD_FIELDS`, ``config.category_field``
      and :data:`TURN_FIELDS`) is not kept and is named in ``unknown_fields``.
    - Text is NFC-normalized and stripped. Empty user turns are dropped; user
      turns with no assistant turn between them are merged with a blank line;
      leading system turns are merged. Each of these is counted in ``notes``.
    - A system turn after the first non-system turn is quarantined
      (``late_system_turn``): there is no faithful place for it in a prompt.
    - Leading assistant turns (the later parts of ShareGPT's split conversations
      start with ``gpt``) are dropped, the prompt is flagged
      ``starts_mid_conversation`` and counted in ``notes`` (policy ``"drop"``,
      the default: their user turns are real prompts for the target); policy
      ``"quarantine"`` quarantines them as ``assistant_first`` instead.
    - ``prompt_id`` = 20 hex chars of a sha256 over the system prompt and the
      user turns (length-prefixed UTF-8, see :func:`prompt_id`). The ingest
      counts records whose id was already seen in this source as duplicates
      (the first is kept), not quarantined.
    """
    config = config or _DEFAULT_CONFIG
    if not isinstance(record, dict):
        return Rejection("not_an_object", f"record is a JSON {type(record).__name__}")
    where, turns = _conversation(record)
    if turns is None:
        return Rejection("missing_conversation", "no 'conversations' or 'messages' field")
    if not isinstance(turns, list):
        return Rejection("missing_conversation", f"conversation is a {type(turns).__name__}, not a list")
    if not turns:
        return Rejection("empty_conversation", "0 turns")
    if _is_agentic(record, turns):
        return normalize_agentic_record(record, config, index=index)
    fields = _read_record_fields(record, config)
    if fields.__class__ is Rejection:
        return fields
    top_system, record_unknown = fields
    unknown: set[str] = set(record_unknown)

    systems: list[str] = [] if top_system is None else [top_system]
    runs: list[list[str]] = []  # user turns; a run has no assistant turn inside
    run: list[str] | None = None
    roles: list[str] = []
    started = False  # a non-system turn was seen
    leading_assistant = 0
    empty_user = 0
    for parsed in _parse_turns(turns, ROLE_MAP, where, unknown):
        if parsed.__class__ is Rejection:
            return parsed
        i, turn, kind, name, content = parsed
        if content is _MISSING:
            return Rejection("bad_turn", f"turn {i} has no content")
        text = content if content.__class__ is str else _content_text(content)
        if text is None:
            return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
        roles.append(name)
        if kind == SYSTEM:
            if started:
                return Rejection("late_system_turn", f"system turn at position {i}")
            systems.append(text)
        elif kind == USER:
            started = True
            text = _normalize("NFC", text).strip()
            if not text:
                empty_user += 1
                continue
            if run is None:
                run = []
                runs.append(run)
            run.append(text)
        else:
            started = True
            if not runs:
                leading_assistant += 1
            run = None

    if not runs:
        kinds = {ROLE_MAP[r] for r in roles}
        what = ("system-only" if kinds == {SYSTEM} else "assistant-only" if USER not in kinds
                else "user turns are empty")
        return Rejection("no_user_turn", f"{what} ({len(turns)} turns)")
    if leading_assistant and config.leading_assistant == "quarantine":
        return Rejection("assistant_first", f"{leading_assistant} assistant turn(s) before the first user turn")

    notes = []
    system_parts = [p for p in (_nfc(s) for s in systems) if p]
    system = "\n\n".join(system_parts) if system_parts else None
    if len(system_parts) > 1:
        notes.append("system_turns_merged")
    if systems and not system_parts:
        notes.append("empty_system_dropped")
    if empty_user:
        notes.append("empty_user_turns_dropped")
    if any(len(r) > 1 for r in runs):
        notes.append("user_turns_merged")
    if leading_assistant:
        notes.append("leading_assistant_dropped")
    user_turns = tuple(r[0] if len(r) == 1 else "\n\n".join(r) for r in runs)

    chars = (len(system) if system else 0) + sum(len(u) for u in user_turns)
    if chars > config.max_record_chars:
        return Rejection("oversize", f"system+user text is {chars} chars > max_record_chars {config.max_record_chars}")
    try:
        digest = prompt_id(system, user_turns)
    except UnicodeEncodeError:
        return Rejection("invalid_utf8", "lone surrogate in system/user text")

    return Prompt(
        prompt_id=digest,
        system=system,
        user_turns=user_turns,
        **_provenance(record, config, index),
        starts_mid_conversation=leading_assistant > 0,
        prompt_chars=chars,
        roles=tuple(roles),
        notes=tuple(notes),
        unknown_fields=tuple(sorted(unknown)),
    )


def _conversation(record: dict) -> tuple[str, Any]:
    """(name of the record's turn list, the list): ``conversations``, else ``messages`` (also when
    ``conversations`` is an empty list and ``messages`` is not); the list is None when there is neither."""
    turns = record.get("conversations")
    if turns is not None and not (turns == [] and _carries(record.get("messages"))):
        return "conversations", turns
    return "messages", record.get("messages")


_DEFAULT_CONFIG = IngestConfig()


# --- agentic conversations ---------------------------------------------------------

TOOL, CALL = "tool", "call"
AGENTIC_ROLE_MAP = {
    "tool": TOOL, "function": TOOL, "observation": TOOL, "function_response": TOOL, "function-response": TOOL,
    "function_call": CALL, "function-call": CALL,
}
_AGENTIC_ROLES = {**ROLE_MAP, **AGENTIC_ROLE_MAP}  # the turn parser's role table for agentic records
TOOLS_FIELDS = ("tools", "functions")  # where a record keeps its tool definitions


def _is_agentic(record: dict, turns: list) -> bool:
    """Tool definitions, a tool call or a tool result anywhere in the record."""
    for name in TOOLS_FIELDS:
        value = record.get(name)
        if value is not None and _tools_given(value):
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
    name = next((f for f in TOOLS_FIELDS if _tools_given(record.get(f))), None)
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
    config = config or _DEFAULT_CONFIG
    if _nests_deeper_than(record, config.max_json_depth):
        return Rejection("nested_too_deep", f"the record nests deeper than max_json_depth {config.max_json_depth}")
    try:
        return _normalize_agentic_record(record, config, index)
    except _NestedTooDeep as e:
        return Rejection("nested_too_deep", str(e))


def _normalize_agentic_record(record: dict, config: IngestConfig, index: int) -> Prompt | Rejection:
    """:func:`normalize_agentic_record` once the record's own depth is checked; raises :class:`_NestedTooDeep`."""
    where, turns = _conversation(record)
    fields = _read_record_fields(record, config)
    if fields.__class__ is Rejection:
        return fields
    top_system, record_unknown = fields
    unknown: set[str] = set(record_unknown)
    tools, why = _parse_tools(record, config)
    if why is not None:
        return Rejection("bad_tools", why)
    declared = {t["function"]["name"] for t in tools} if tools else set()
    systems: list[str] = [] if top_system is None else [top_system]
    events: list[dict] = []
    roles: list[str] = []
    started = has_user = False
    leading = empty_user = 0
    merged = False
    last: str | None = None  # user | calls | tool | answer
    open_calls = 0  # calls of the last call step still without a result
    for parsed in _parse_turns(turns, _AGENTIC_ROLES, where, unknown):
        if parsed.__class__ is Rejection:
            return parsed
        i, turn, kind, name, content = parsed
        roles.append(name)
        if kind == SYSTEM:
            if started:
                return Rejection("late_system_turn", f"system turn at position {i}")
            text = _content_text(content) if content is not _MISSING else None
            if text is None:
                return Rejection("non_string_content", f"turn {i} (system) content is a {type(content).__name__}")
            systems.append(text)
            continue
        started = True
        if kind != USER and not has_user:  # before the first user turn: dropped, tool results too
            leading += 1
            continue
        if kind == USER:
            text = _content_text(content) if content is not _MISSING else None
            if text is None:
                return Rejection("non_string_content", f"turn {i} (user) content is a {type(content).__name__}")
            text = _normalize("NFC", text).strip()
            if not text:
                empty_user += 1
                continue
            if open_calls:
                return Rejection("missing_tool_result", f"turn {i}: a user turn before the results of "
                                                        f"{open_calls} tool call(s)")
            has_user = True
            if last == "user":
                events[-1]["content"] += "\n\n" + text
                merged = True
            else:
                events.append({"role": "user", "content": text})
            last = "user"
        elif kind in (ASSISTANT, CALL):
            if open_calls:
                return Rejection("missing_tool_result", f"turn {i}: an assistant turn before the results of "
                                                        f"{open_calls} tool call(s)")
            if (kind == ASSISTANT and content is not _MISSING and content is not None
                    and _content_text(content) is None):
                return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
            raw = _raw_calls(kind, turn, None if content is _MISSING else content, i, config.max_json_depth)
            if isinstance(raw, str):
                return Rejection("bad_tool_call", raw)
            if not raw:
                last = "answer"
                continue
            calls = []
            call_of_id: dict[str, int] = {}  # call id -> the first call of this turn that carries it
            for k, one in enumerate(raw):
                call = _call_of(one, f"turn {i} call {k}", config.max_json_depth)
                if isinstance(call, str):
                    return Rejection("bad_tool_call", call)
                if call["id"] is not None:
                    if call["id"] in call_of_id:
                        return Rejection("duplicate_tool_call_id",
                                         f"turn {i}: calls {call_of_id[call['id']]} and {k} both have id "
                                         f"{call['id'][:60]!r}")
                    call_of_id[call["id"]] = k
                if not declared:
                    return Rejection("bad_tools", f"turn {i} calls {call['name']!r} but the record defines no tools")
                if call["name"] not in declared:
                    return Rejection("bad_tool_call", f"turn {i} calls {call['name']!r}, not among the record's tools")
                calls.append(call)
            events.append({"role": "assistant", "tool_calls": calls})
            last, open_calls = "calls", len(calls)
        else:  # a tool result
            if not open_calls:
                return Rejection("orphan_tool_result", f"turn {i}: a tool result with no tool call before it"
                                 if last not in ("calls", "tool") else f"turn {i}: more tool results than calls")
            if content is _MISSING:
                return Rejection("bad_turn", f"turn {i} has no content")
            text = _content_text(content)
            if text is None and isinstance(content, (dict, list)):
                text = json.dumps(content, ensure_ascii=False)
            if text is None:
                return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
            event: dict[str, Any] = {"role": "tool", "content": _normalize("NFC", text).strip()}
            for key in ("tool_call_id", "name"):
                if isinstance(turn.get(key), str) and turn[key]:
                    event[key] = turn[key]
            events.append(event)
            open_calls -= 1
            last = "tool"

    if not has_user:
        return Rejection("no_user_turn", f"no non-empty user turn ({len(turns)} turns)")
    if open_calls and last == "tool":
        return Rejection("missing_tool_result", f"the conversation ends before the results of {open_calls} tool call(s)")
    if leading and config.leading_assistant == "quarantine":
        return Rejection("assistant_first", f"{leading} assistant or tool turn(s) before the first user turn")

    notes = ["agentic"]
    system_parts = [p for p in (_nfc(s) for s in systems) if p]
    system = "\n\n".join(system_parts) if system_parts else None
    if len(system_parts) > 1:
        notes.append("system_turns_merged")
    if systems and not system_parts:
        notes.append("empty_system_dropped")
    if empty_user:
        notes.append("empty_user_turns_dropped")
    if merged:
        notes.append("user_turns_merged")
    if leading:
        notes.append("leading_assistant_dropped")
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
        **_provenance(record, config, index),
        starts_mid_conversation=leading > 0,
        prompt_chars=chars,
        roles=tuple(roles),
        notes=tuple(notes),
        tools=tools_json,
        agentic_turns=turns_json,
        unknown_fields=tuple(sorted(unknown)),
    )
