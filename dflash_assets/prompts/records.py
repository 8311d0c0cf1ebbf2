"""One source record's fields and turns, as every normalizer reads them: the prompt and rejection types, the role
table, the one turn parser, content text, the merged system prompt, the record's own fields and provenance, and
prompt ids.

Reads the record it is given; writes nothing.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dflash_assets.prompts.config import IngestConfig


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

MISSING = object()

# The fields content is read from (with IngestConfig.category_field); any other non-null field of a record or
# of a turn is not kept and is named in Prompt.unknown_fields ("model", "conversations[].weight").
RECORD_FIELDS = frozenset({"conversations", "messages", "system", "tools", "functions", "id"})
TURN_FIELDS = frozenset({"from", "value", "role", "content", "tool_calls", "function_call", "tool_call_id", "name"})
_NOT_ON_USER_TURNS = ("name", "tool_calls", "function_call", "tool_call_id")  # nowhere to keep them in a prompt


def _carries(value: Any) -> bool:
    """Does a field's value hold anything (not null, not an empty string, list or object)?"""
    return value is not None and value != "" and value != [] and value != {}


def tools_given(value: Any) -> bool:
    """Does a ``tools``/``functions`` value define anything (an empty list, or its JSON text, does not)?"""
    return value is not None and value != [] and not (isinstance(value, str) and value.strip() in ("", "[]"))


def read_record_fields(record: dict, config: IngestConfig) -> tuple[str | None, frozenset[str]] | Rejection:
    """(the top-level ``system`` text or None, names of the record's unknown non-null fields), or a
    :class:`Rejection` when the record holds content a prompt cannot keep whole: two conversation lists, two
    tool lists (``unkept_content``), a ``system`` field that is not text (``non_string_content``)."""
    if "messages" in record and "conversations" in record and _carries(record["conversations"]) and _carries(
            record["messages"]):
        return Rejection("unkept_content", "the record has both 'conversations' and 'messages'; a prompt keeps one")
    if "functions" in record and "tools" in record and tools_given(record["tools"]) and tools_given(
            record["functions"]):
        return Rejection("unkept_content", "the record has both 'tools' and 'functions'; a prompt keeps one")
    system = record.get("system")
    if system is not None:
        system = content_text(system)
        if system is None:
            return Rejection("non_string_content",
                             f"the record's 'system' field is a {type(record['system']).__name__}")
    extra = record.keys() - RECORD_FIELDS
    if not extra:
        return system, _NONE
    return system, frozenset(k for k in extra if k != config.category_field and record[k] is not None)


_NONE: frozenset[str] = frozenset()


unicode_normalize = unicodedata.normalize


def nfc(text: str) -> str:
    return unicode_normalize("NFC", text).strip()


def merge_system(systems: list[str]) -> tuple[str | None, list[str]]:
    """The system prompt of a record's system texts (each NFC-normalized and stripped, the empty ones dropped, the
    rest joined by a blank line; None when none is left) and its notes: ``system_turns_merged`` (more than one
    kept), ``empty_system_dropped`` (some given, none kept)."""
    parts = [p for p in (nfc(s) for s in systems) if p]
    notes = []
    if len(parts) > 1:
        notes.append("system_turns_merged")
    if systems and not parts:
        notes.append("empty_system_dropped")
    return ("\n\n".join(parts) if parts else None), notes


def content_text(content: Any) -> str | None:
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


def parse_turns(turns: list, role_map: dict[str, str], where: str,
                 unknown: set[str]) -> Iterator[tuple[int, dict, str, str, Any] | Rejection]:
    """The turns of a conversation, each as ``(i, turn, kind, role name, content)``, or a :class:`Rejection`
    for the first malformed one (the caller returns it): the one turn parser of both normalizers.

    A turn is ShareGPT (``from``/``value``) or OpenAI (``role``/``content``), the other content key accepted
    too, a null role or content read as absent when the other key has one (a Parquet row of mixed shapes holds
    both, one null); ``content`` is ``MISSING`` when the turn has none (each normalizer decides what that means). The
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
        content = turn.get(first, MISSING)
        if content is None or content is MISSING:  # a null field is no content: the other key, if it has one
            other = turn.get(second, MISSING)
            if other is not MISSING and (other is not None or content is MISSING):
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


def record_provenance(record: dict, config: IngestConfig, index: int) -> dict[str, str]:
    """The record's `source_id` (its id, else its position) and `category` (NFC, "unknown" when absent)."""
    category = record.get(config.category_field)
    category = nfc(category) if isinstance(category, str) else ""
    if category:
        category = category.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"source_id": record_id_text(record.get("id")) or f"#{index}", "category": category or "unknown"}


def record_conversation(record: dict) -> tuple[str, Any]:
    """(name of the record's turn list, the list): ``conversations``, else ``messages`` (also when
    ``conversations`` is an empty list and ``messages`` is not); the list is None when there is neither."""
    turns = record.get("conversations")
    if turns is not None and not (turns == [] and _carries(record.get("messages"))):
        return "conversations", turns
    return "messages", record.get("messages")


DEFAULT_CONFIG = IngestConfig()

TOOL, CALL = "tool", "call"
