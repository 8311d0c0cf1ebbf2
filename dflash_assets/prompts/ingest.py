"""Prompt-corpus ingest: normalize, dedupe, quarantine and shard prompts; write shard tables.

Two steps, because Dagster runs them separately:

1. :func:`ingest_prompt_source` reads a source (:mod:`dflash_assets.prompts.sources`),
   normalizes each record (:func:`normalize_record`, :func:`normalize_agentic_record`),
   drops exact duplicates, quarantines bad records with a reason code
   (:data:`QUARANTINE_REASONS`), assigns new prompts to shards and commits a new
   corpus index; concurrent ingests, sharding and memory are described there.
2. :func:`materialize_prompt_shard` copies one staged shard to
   ``raw_prompts/<shard>.parquet`` (a ``raw_prompts`` partition) after checking it
   against the index; each partition reads only its own staged shard, never the
   whole corpus (914K prompts are ~900 shards).

Reads: the source, and the store's ``prompt_corpus/`` index, manifest and staged
shards. Writes, atomically through the store (keys in :mod:`dflash_assets.store.layout`):
``prompt_corpus/`` staged shards, assignment manifest, commit, ``index.json``,
quarantine table and report; ``raw_prompts/<shard>.parquet``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
import tempfile
import time
import unicodedata
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.store import layout
from dflash_assets.prompts.sources import (
    DEFAULT_MAX_RAW_RECORD_CHARS,
    SourceItem,
    read_source,
    source_label,
)

__all__ = [
    "IngestConfig",
    "IngestReport",
    "ShardStats",
    "Prompt",
    "Rejection",
    "NoValidPromptsError",
    "ConcurrentIngestError",
    "QUARANTINE_REASONS",
    "PROMPT_SCHEMA",
    "QUARANTINE_SCHEMA",
    "normalize_record",
    "normalize_agentic_record",
    "prompt_id",
    "agentic_prompt_id",
    "AGENTIC_PROMPT_SCHEMA",
    "ingest_prompt_source",
    "materialize_prompt_shard",
    "list_shard_keys",
    "read_corpus_shard",
    "shard_name",
]


USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLE_MAP = {
    "human": USER, "user": USER,
    "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT, "assistant": ASSISTANT,
    "system": SYSTEM,
}

QUARANTINE_REASONS = {
    "malformed_json": "not valid JSON (a JSONL line, or an array element: reading the array stops there)",
    "trailing_data": "data after a JSON array's closing ']' that is not another array (kept as one row; not read)",
    "nested_too_deep": "a record nested deeper than the JSON parser's recursion limit; an agentic record nested "
                       "deeper than max_json_depth, or holding JSON text (tools, call arguments) that is; a tool's "
                       "parameters schema nested deeper than max_tool_schema_depth",
    "invalid_utf8": "invalid UTF-8 bytes in the record, or lone surrogates in its system/user text",
    "oversize": "raw record over max_raw_record_chars, or system+user text over max_record_chars",
    "not_an_object": "the record is not a JSON object",
    "missing_conversation": "no 'conversations' or 'messages' list",
    "empty_conversation": "the conversation has no turns",
    "bad_turn": "a turn that is not an object, or has no role or no content",
    "unknown_role": "a role outside human/user/gpt/chatgpt/bing/bard/assistant/system",
    "non_string_content": "a turn's content is not a string (or a list of text parts)",
    "late_system_turn": "a system turn after the conversation started",
    "no_user_turn": "no non-empty user turn (assistant-only, system-only, blank user turns)",
    "assistant_first": "starts with an assistant turn (only with leading_assistant='quarantine')",
    "bad_tools": "tool definitions that are not a list of named function objects (or its JSON text), "
                 "parameters that are not a valid JSON Schema (Draft 2020-12, as SGLang checks them), "
                 "or tool calls recorded without any tool definitions",
    "bad_tool_call": "a recorded tool call without a name, with arguments that are not a JSON object, "
                     "or naming a tool the record does not define",
    "orphan_tool_result": "a tool result with no tool call before it (or more results than calls)",
    "missing_tool_result": "a tool call step followed by another turn before all its results",
    "duplicate_tool_call_id": "two tool calls of one assistant turn with the same id (results could not be "
                              "matched to calls; quarantined, not renamed)",
}

PROMPT_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("system", pa.string()),
    pa.field("user_turns", pa.list_(pa.string()), nullable=False),
    pa.field("num_user_turns", pa.int32(), nullable=False),
    pa.field("prompt_chars", pa.int64(), nullable=False),  # chars of system + user turns
    pa.field("source", pa.string(), nullable=False),
    pa.field("source_id", pa.string(), nullable=False),  # the record's `id`, else "#<index>"
    pa.field("source_index", pa.int64(), nullable=False),  # position of the record in the source
    pa.field("category", pa.string(), nullable=False),  # the record's category field, else "unknown"
    pa.field("starts_mid_conversation", pa.bool_(), nullable=False),  # leading assistant turns dropped
    pa.field("ingest_generation", pa.int32(), nullable=False),  # the ingest that added the prompt
])

QUARANTINE_SCHEMA = pa.schema([
    pa.field("source", pa.string(), nullable=False),
    pa.field("source_index", pa.int64(), nullable=False),
    pa.field("source_id", pa.string()),
    pa.field("reason", pa.string(), nullable=False),
    pa.field("detail", pa.string(), nullable=False),
    pa.field("byte_offset", pa.int64()),
    pa.field("raw_chars", pa.int64(), nullable=False),
    pa.field("raw", pa.string(), nullable=False),  # JSON text of the record, truncated
])

# A shard holding an agentic prompt: two more columns (null for its plain chats).
AGENTIC_PROMPT_SCHEMA = PROMPT_SCHEMA.append(pa.field("tools", pa.string())).append(
    pa.field("agentic_turns", pa.string()))

MANIFEST_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("generation", pa.int32(), nullable=False),
])


class NoValidPromptsError(ValueError):
    """An ingest found no valid prompt; the message gives the quarantine counts."""


@dataclass(frozen=True)
class IngestConfig:
    max_prompts_per_shard: int = 1024
    max_record_chars: int = 65_536  # system + user text after normalization; ~16K tokens
    limit: int | None = None  # keep only the first N valid (unique) prompts of the source
    source_name: str | None = None  # default: the file name without extensions
    leading_assistant: Literal["drop", "quarantine"] = "drop"
    # New prompts first fill the last shard if it has room. False: they always open
    # new shards, so no shard whose completions were generated ever changes.
    fill_last_shard: bool = True
    category_field: str = "category"
    max_raw_record_chars: int = DEFAULT_MAX_RAW_RECORD_CHARS  # a record's raw text, before parsing
    quarantine_raw_chars: int = 4096  # raw JSON kept per quarantined record
    quarantine_rows_per_group: int = 4096  # rejected records held in memory before they go to the Parquet file
    # Nesting (levels of objects and arrays) allowed in an agentic record and in each JSON text it holds
    # (tools, call arguments); deeper is nested_too_deep. What the ingest keeps is JSON-dumped again later,
    # which recursion limits: 100 + 100 levels stay far below Python's ~1000 frames.
    max_json_depth: int = 100
    # Nesting allowed in one tool's parameters before jsonschema's check_schema sees it (it recurses ~8 Python
    # frames per level and overflows at ~120 levels from a shallow stack); deeper is nested_too_deep.
    max_tool_schema_depth: int = 32

    def __post_init__(self) -> None:
        if self.max_prompts_per_shard < 1:
            raise ValueError("max_prompts_per_shard must be >= 1")
        if self.max_record_chars < 1:
            raise ValueError("max_record_chars must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1 or None")
        if self.quarantine_rows_per_group < 1:
            raise ValueError("quarantine_rows_per_group must be >= 1")
        if self.max_json_depth < 1 or self.max_tool_schema_depth < 1:
            raise ValueError("max_json_depth and max_tool_schema_depth must be >= 1")
        if self.leading_assistant not in ("drop", "quarantine"):
            raise ValueError("leading_assistant must be 'drop' or 'quarantine'")


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


@dataclass(frozen=True)
class Rejection:
    reason: str  # a key of QUARANTINE_REASONS
    detail: str


@dataclass(frozen=True)
class IngestReport:
    source_uri: str
    source_name: str
    source_format: str
    compression: str
    generation: int
    records_read: int  # complete records (and unreadable lines/elements) read from the source
    valid: int  # unique valid prompts in the source (up to `limit`)
    duplicates: int  # valid records whose prompt_id was already seen in this source
    quarantined: dict[str, int]  # reason -> count; records_read == valid + duplicates + sum(quarantined)
    truncated: bool
    truncated_at_byte: int | None
    parse_error: str | None
    json_arrays: int  # top-level JSON arrays read one after another (1 for a plain array file, 0 for JSONL/Parquet)
    limit_reached: bool
    new_prompts: int
    existing_prompts: int  # valid prompts already in the corpus
    kept_not_in_source: int  # corpus prompts this ingest did not see (they keep their shard)
    corpus_prompts: int
    shard_keys: list[str]
    shard_sizes: dict[str, int]
    new_shards: list[str]
    changed_shards: list[str]  # shards that existed before and gained prompts
    notes: dict[str, int]  # normalization counters (leading_assistant_dropped, user_turns_merged, ...)
    roles: dict[str, int]  # source role -> count over valid prompts
    quarantine_key: str
    seconds: float
    agentic_prompts: int = 0  # valid prompts with tools, tool calls or tool results

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())

    @property
    def num_valid(self) -> int:
        return self.valid

    def to_metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata (per-shard lists left out: ~900 shards for 914K prompts)."""
        sizes = list(self.shard_sizes.values())
        out: dict[str, Any] = {
            "source_uri": self.source_uri, "source_name": self.source_name,
            "source_format": self.source_format, "compression": self.compression,
            "generation": self.generation, "records_read": self.records_read, "valid": self.valid,
            "duplicates": self.duplicates, "quarantined_total": self.quarantined_total,
            "quarantined": self.quarantined, "truncated": self.truncated,
            "truncated_at_byte": self.truncated_at_byte, "parse_error": self.parse_error,
            "json_arrays": self.json_arrays,
            "limit_reached": self.limit_reached, "new_prompts": self.new_prompts,
            "existing_prompts": self.existing_prompts, "kept_not_in_source": self.kept_not_in_source,
            "corpus_prompts": self.corpus_prompts, "num_shards": len(sizes),
            "shard_size_min": min(sizes, default=0), "shard_size_max": max(sizes, default=0),
            "new_shards": len(self.new_shards), "changed_shards": ", ".join(self.changed_shards) or "none",
            "notes": self.notes, "roles": self.roles, "quarantine_key": self.quarantine_key,
            "seconds": self.seconds, "agentic_prompts": self.agentic_prompts,
        }
        return out

    @property
    def shards_to_materialize(self) -> list[str]:
        return sorted(self.new_shards + self.changed_shards)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShardStats:
    """What one ``raw_prompts`` partition holds; ``to_metadata()`` gives its fields for asset metadata."""

    shard: str
    key: str  # raw_prompts/<shard>.parquet
    num_prompts: int
    num_user_turns: int
    max_user_turns: int
    with_system: int
    starts_mid_conversation: int
    prompt_chars_mean: float
    prompt_chars_max: int
    sources: dict[str, int]
    categories: dict[str, int]
    sha256: str  # of the Parquet bytes: a data version for the partition
    generation: int  # the ingest generation that last changed this shard
    agentic_prompts: int = 0  # prompts with tools, tool calls or tool results

    def to_metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata (the name every result type of the library uses)."""
        return asdict(self)


def shard_name(n: int) -> str:
    return f"shard-{n:05d}"


_SHARD_RE = re.compile(r"shard-(\d{5,})")


def _shard_number(key: str) -> int:
    m = _SHARD_RE.fullmatch(key)
    if not m:
        raise ValueError(f"not a shard key: {key!r}")
    return int(m.group(1))


# --- normalization -------------------------------------------------------------

_MISSING = object()


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


def _id_text(value: Any) -> str | None:
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
    return {"source_id": _id_text(record.get("id")) or f"#{index}", "category": category or "unknown"}


def normalize_record(record: Any, config: IngestConfig | None = None, *, index: int = 0) -> Prompt | Rejection:
    """One source record -> a :class:`Prompt`, or a :class:`Rejection` with a reason code.

    - Records are ShareGPT (``conversations`` of ``from``/``value``) or OpenAI
      (``messages`` of ``role``/``content``; content a string or a list of
      ``{"type": "text"}`` parts). Roles, case-insensitive: human/user -> user;
      gpt/chatgpt/bing/bard/assistant -> assistant; system -> system. A record
      with tools, tool calls or tool results goes to :func:`normalize_agentic_record`.
    - Assistant turns are dropped (the target regenerates every completion).
      What is kept: the system prompt (if any) and the user turns in order;
      the regenerator answers after each user turn.
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
    turns = record.get("conversations", _MISSING)
    if turns is _MISSING or turns is None:
        turns = record.get("messages", _MISSING)
    if turns is _MISSING or turns is None:
        return Rejection("missing_conversation", "no 'conversations' or 'messages' field")
    if not isinstance(turns, list):
        return Rejection("missing_conversation", f"conversation is a {type(turns).__name__}, not a list")
    if not turns:
        return Rejection("empty_conversation", "0 turns")
    if _is_agentic(record, turns):
        return normalize_agentic_record(record, config, index=index)

    systems: list[str] = []
    runs: list[list[str]] = []  # user turns; a run has no assistant turn inside
    run: list[str] | None = None
    roles: list[str] = []
    started = False  # a non-system turn was seen
    leading_assistant = 0
    empty_user = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Rejection("bad_turn", f"turn {i} is a {type(turn).__name__}")
        if "from" in turn:
            role = turn["from"]
            content = turn["value"] if "value" in turn else turn.get("content", _MISSING)
        elif "role" in turn:
            role = turn["role"]
            content = turn["content"] if "content" in turn else turn.get("value", _MISSING)
        else:
            return Rejection("bad_turn", f"turn {i} has no 'from' or 'role'")
        if not isinstance(role, str):
            return Rejection("bad_turn", f"turn {i} role is a {type(role).__name__}")
        kind = ROLE_MAP.get(role)
        name = role
        if kind is None:
            name = role.strip().lower()
            kind = ROLE_MAP.get(name)
            if kind is None:
                return Rejection("unknown_role", f"turn {i} role {role[:40]!r}")
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
    )


_DEFAULT_CONFIG = IngestConfig()


# --- agentic conversations ---------------------------------------------------------

TOOL, CALL = "tool", "call"
AGENTIC_ROLE_MAP = {
    "tool": TOOL, "function": TOOL, "observation": TOOL, "function_response": TOOL, "function-response": TOOL,
    "function_call": CALL, "function-call": CALL,
}
TOOLS_FIELDS = ("tools", "functions")  # where a record keeps its tool definitions


def _is_agentic(record: dict, turns: list) -> bool:
    """Tool definitions, a tool call or a tool result anywhere in the record."""
    for name in TOOLS_FIELDS:
        value = record.get(name)
        if value is not None and value != [] and not (isinstance(value, str) and value.strip() in ("", "[]")):
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
    name = next((f for f in TOOLS_FIELDS if record.get(f) is not None), None)
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

    Agentic records (issue 17) carry tool definitions (``tools`` or
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
    without an agentic prompt is written exactly as before (``PROMPT_SCHEMA``);
    one with an agentic prompt has the two extra columns
    (``AGENTIC_PROMPT_SCHEMA``, null for its plain chats).

    Checked before anything is kept (issue 22 item 4, issue 24 item 5):
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
    turns = record.get("conversations")
    if turns is None:
        turns = record.get("messages")
    tools, why = _parse_tools(record, config)
    if why is not None:
        return Rejection("bad_tools", why)
    declared = {t["function"]["name"] for t in tools} if tools else set()
    systems: list[str] = []
    top = record.get("system")
    if top is not None:
        if not isinstance(top, str):
            return Rejection("non_string_content", f"the record's 'system' field is a {type(top).__name__}")
        systems.append(top)
    events: list[dict] = []
    roles: list[str] = []
    started = has_user = False
    leading = empty_user = 0
    merged = False
    last: str | None = None  # user | calls | tool | answer
    open_calls = 0  # calls of the last call step still without a result
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Rejection("bad_turn", f"turn {i} is a {type(turn).__name__}")
        if "from" in turn:
            role = turn["from"]
            content = turn["value"] if "value" in turn else turn.get("content", _MISSING)
        elif "role" in turn:
            role = turn["role"]
            content = turn["content"] if "content" in turn else turn.get("value", _MISSING)
        else:
            return Rejection("bad_turn", f"turn {i} has no 'from' or 'role'")
        if not isinstance(role, str):
            return Rejection("bad_turn", f"turn {i} role is a {type(role).__name__}")
        name = role.strip().lower()
        kind = ROLE_MAP.get(name) or AGENTIC_ROLE_MAP.get(name)
        if kind is None:
            return Rejection("unknown_role", f"turn {i} role {role[:40]!r}")
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
    )


# --- corpus index ---------------------------------------------------------------


@dataclass(frozen=True)
class _ShardEntry:
    key: str  # staged object
    num_prompts: int
    sha256: str
    generation: int


@dataclass(frozen=True)
class _CorpusIndex:
    """One generation of the corpus: what ``prompt_corpus/commits/gen-<N>.json`` (created once) and its copy
    ``prompt_corpus/index.json`` hold: generation, run, manifest key, shard -> staged object + sha256."""

    generation: int = 0
    manifest_key: str | None = None
    shards: dict[str, _ShardEntry] = field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    run: str | None = None  # the ingest run that committed this generation

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "generation": self.generation,
            "run": self.run,
            "manifest_key": self.manifest_key,
            "shards": {k: asdict(v) for k, v in sorted(self.shards.items())},
            "sources": self.sources,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> _CorpusIndex:
        if obj.get("format") != 1:
            raise ValueError(f"unknown prompt-corpus index format {obj.get('format')!r}")
        return cls(
            generation=int(obj["generation"]),
            manifest_key=obj["manifest_key"],
            shards={k: _ShardEntry(**v) for k, v in obj["shards"].items()},
            sources=obj.get("sources", {}),
            run=obj.get("run"),
        )


def _load_index(store: Any) -> _CorpusIndex:
    """The newest committed generation: ``index.json``, rolled forward through any newer commit objects.

    ``index.json`` is written after the commit object, so it can lag (a crash
    in between) or, rarely, be set back by a slow writer; the commit objects
    are the truth and are never overwritten.
    """
    try:
        index = _CorpusIndex.from_json(store.read_json(layout.corpus_index()))
    except FileNotFoundError:
        index = _CorpusIndex()
    while True:
        try:
            obj = store.read_json(layout.corpus_commit(index.generation + 1))
        except FileNotFoundError:
            return index
        index = _CorpusIndex.from_json(obj)


class ConcurrentIngestError(RuntimeError):
    """Another ingest committed the generation this one was building; nothing of this one was committed."""


def corpus_prompt_count(store: Any) -> int:
    """Prompts in the whole corpus, from the ingest's index (0 before the first ingest)."""
    return sum(entry.num_prompts for entry in _load_index(store).shards.values())


def list_shard_keys(store: Any) -> list[str]:
    """Shard keys of the committed corpus, sorted (the ``prompt_shards`` partitions)."""
    return sorted(_load_index(store).shards)


def read_corpus_shard(store: Any, shard_key: str, columns: list[str] | None = None) -> pa.Table:
    """The committed corpus's rows of one shard (what ``raw_prompts/<shard>`` holds once materialized), read
    without writing anything; the cost plan samples prompts from it before any ``raw_prompts`` run."""
    return store.read_parquet(_load_index(store).shards[shard_key].key, columns=columns)


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _safe_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return name or "source"


def _default_source_name(source_uri: Any) -> str:
    label = source_label(source_uri).rstrip("/")
    base = label.rsplit("/", 1)[-1]
    for ext in (".gz", ".zst", ".zstd", ".json", ".jsonl", ".ndjson", ".parquet"):
        if base.lower().endswith(ext):
            base = base[: -len(ext)]
    return base


class _ShardBuilder:
    """Columns of the rows being added to one shard."""

    def __init__(self, shard: str, existing: pa.Table | None, capacity: int):
        self.shard = shard
        if existing is not None:
            existing = existing.cast(AGENTIC_PROMPT_SCHEMA if "agentic_turns" in existing.column_names
                                     else PROMPT_SCHEMA)
        self.existing = existing
        self.free = capacity - (existing.num_rows if existing is not None else 0)
        self.cols: dict[str, list[Any]] = {f.name: [] for f in AGENTIC_PROMPT_SCHEMA}

    def add(self, p: Prompt, source: str, index: int, generation: int) -> None:
        c = self.cols
        c["prompt_id"].append(p.prompt_id)
        c["shard"].append(self.shard)
        c["system"].append(p.system)
        c["user_turns"].append(list(p.user_turns))
        c["num_user_turns"].append(len(p.user_turns))
        c["prompt_chars"].append(p.prompt_chars)
        c["source"].append(source)
        c["source_id"].append(p.source_id)
        c["source_index"].append(index)
        c["category"].append(p.category)
        c["starts_mid_conversation"].append(p.starts_mid_conversation)
        c["ingest_generation"].append(generation)
        c["tools"].append(p.tools)
        c["agentic_turns"].append(p.agentic_turns)
        self.free -= 1

    @property
    def added(self) -> int:
        return len(self.cols["prompt_id"])

    def table(self) -> pa.Table:
        """PROMPT_SCHEMA while the shard holds no agentic prompt (plain shards as before), else AGENTIC_PROMPT_SCHEMA."""
        old = self.existing
        agentic = (any(v is not None for v in self.cols["agentic_turns"])
                   or (old is not None and "agentic_turns" in old.column_names))
        schema = AGENTIC_PROMPT_SCHEMA if agentic else PROMPT_SCHEMA
        new = pa.table({f.name: self.cols[f.name] for f in schema}, schema=schema)
        if old is None:
            return new
        if agentic and "agentic_turns" not in old.column_names:
            for name in ("tools", "agentic_turns"):
                old = old.append_column(schema.field(name), pa.nulls(old.num_rows, pa.string()))
        return pa.concat_tables([old, new])


class _QuarantineWriter:
    """Rejected records, streamed to a local Parquet file a row group at a time; ``publish`` uploads it.

    Memory holds at most ``rows_per_group`` rows (each raw text truncated to
    ``raw_chars``), whatever the number of rejected records.
    """

    def __init__(self, source: str, raw_chars: int, rows_per_group: int = 4096):
        self.source = source
        self.raw_chars = raw_chars
        self.rows_per_group = rows_per_group
        self.cols: dict[str, list[Any]] = {f.name: [] for f in QUARANTINE_SCHEMA}
        self.counts: Counter[str] = Counter()
        self._dir = tempfile.mkdtemp(prefix="dflash-quarantine-")
        self.path = Path(self._dir) / "quarantine.parquet"
        self._writer = pq.ParquetWriter(self.path, QUARANTINE_SCHEMA, compression="zstd")

    def add(self, index: int, reason: str, detail: str, *, record: Any = _MISSING, raw: str | None = None,
            raw_chars: int = 0, byte_offset: int | None = None) -> None:
        if record is not _MISSING:
            try:
                text = json.dumps(record, ensure_ascii=False, default=str)
            except RecursionError:  # parsed, but too deep to print again from here
                text = f"<record nested too deeply to print: {type(record).__name__}>"
            raw, raw_chars = text[: self.raw_chars], len(text)
        raw = (raw or "").encode("utf-8", "backslashreplace").decode("utf-8")
        c = self.cols
        c["source"].append(self.source)
        c["source_index"].append(index)
        c["source_id"].append(_id_text(record.get("id")) if isinstance(record, dict) else None)
        c["reason"].append(reason)
        c["detail"].append(detail.encode("utf-8", "backslashreplace").decode("utf-8"))
        c["byte_offset"].append(byte_offset)
        c["raw_chars"].append(raw_chars)
        c["raw"].append(raw)
        self.counts[reason] += 1
        if len(c["reason"]) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self.cols["reason"]:
            self._writer.write_table(pa.table(self.cols, schema=QUARANTINE_SCHEMA))
            self.cols = {f.name: [] for f in QUARANTINE_SCHEMA}

    def publish(self, store: Any, key: str) -> None:
        """Close the file and upload it to ``key`` (atomic through the store)."""
        self._flush()
        self._writer.close()
        store.upload_file(key, self.path)

    def close(self) -> None:
        """Remove the local file (after ``publish``, or when the ingest fails)."""
        with contextlib.suppress(Exception):
            self._writer.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# --- ingest ----------------------------------------------------------------------


def ingest_prompt_source(source_uri: Any, store: Any, config: IngestConfig | None = None, *,
                         s3_client: Any = None) -> IngestReport:
    """Read, normalize, dedupe and quarantine a source; assign shards; commit the corpus index.

    ``source_uri``: a path, ``file://`` or ``s3://`` URI (read with ``s3_client``,
    else the store's client, else a new boto3 client), bytes or a binary stream.
    Returns the report; raises :class:`NoValidPromptsError` when nothing is valid
    (the quarantine table is still written, the corpus is left unchanged), and
    :class:`ConcurrentIngestError` when another ingest committed first (nothing
    of this one is committed; its staged objects are removed; run it again).

    Concurrent ingests: each run stages under keys carrying its own random run
    id, so no run overwrites another's objects. Generation N is committed by
    *creating* ``commits/gen-N.json`` (``Store.create``: a hard link locally,
    ``If-None-Match: *`` on S3), which exactly one run can do. Readers take
    ``index.json`` and roll forward through newer commit objects
    (:func:`_load_index`), so a crash between the commit and ``index.json``
    loses nothing. The quarantine (rejected records of this ingest of the
    source: one row per record with reason, detail and raw JSON text truncated)
    and the report are written after the commit (the quarantine alone when
    nothing is valid); counts per reason are in the report. Old objects go by
    :func:`_collect_garbage`.

    Sharding: a prompt keeps its shard forever. New prompts, in source order,
    fill the highest-numbered shard up to ``max_prompts_per_shard``, then open
    new shards (``shard-00000``, ``shard-00001``, ...); a staged shard is
    rewritten only when it gains prompts. A shard that gains prompts is reported
    in ``changed_shards`` (its downstream partitions are stale);
    ``fill_last_shard=False`` never touches an existing shard. A prompt that is
    no longer in the source stays in its shard (the corpus only grows; counted
    as ``kept_not_in_source``); start a new store prefix to drop prompts.
    Lowering ``max_prompts_per_shard`` later leaves fuller existing shards as
    they are.

    Memory: rejected records go to a local Parquet file a row group at a time
    (``quarantine_rows_per_group``), uploaded once; one shard's rows are held
    while it fills; the dedupe set and the manifest hold a prompt id per prompt.
    """
    config = config or IngestConfig()
    quarantine = _QuarantineWriter(source_name := _safe_name(config.source_name or _default_source_name(source_uri)),
                                   config.quarantine_raw_chars, config.quarantine_rows_per_group)
    run = uuid.uuid4().hex[:12]
    staged: list[str] = []  # objects this run wrote under staged/ and manifest/
    committed = False
    try:
        report = _ingest(source_uri, store, config, s3_client, source_name, run, quarantine, staged)
        committed = True
        return report
    finally:
        quarantine.close()
        if not committed:
            for key in staged:  # never another run's objects: these keys carry this run's id
                with contextlib.suppress(Exception):
                    store.delete(key)


def _ingest(source_uri: Any, store: Any, config: IngestConfig, s3_client: Any, source: str, run: str,
            quarantine: _QuarantineWriter, staged: list[str]) -> IngestReport:
    t0 = time.perf_counter()
    index = _load_index(store)
    generation = index.generation + 1
    cap = config.max_prompts_per_shard

    if index.manifest_key:
        old_manifest = store.read_parquet(index.manifest_key)
        in_corpus = set(old_manifest.column("prompt_id").to_pylist())
    else:
        old_manifest = None
        in_corpus = set()

    shards = dict(index.shards)
    next_shard = max((_shard_number(k) for k in shards), default=-1) + 1
    last = shard_name(next_shard - 1) if shards else None
    if last is not None and config.fill_last_shard and shards[last].num_prompts < cap:  # fill it first
        builder = _ShardBuilder(last, store.read_parquet(shards[last].key), cap)
    else:
        builder = _ShardBuilder(shard_name(next_shard), None, cap)
        next_shard += 1

    new_ids: list[str] = []
    new_shard_of: list[str] = []
    new_shards: list[str] = []
    changed_shards: list[str] = []

    def flush(b: _ShardBuilder) -> None:
        if not b.added:
            return
        table = b.table()
        data = _parquet_bytes(table)
        key = layout.corpus_staged_shard(generation, b.shard, run)
        staged.append(key)
        store.write_bytes(key, data)
        (changed_shards if b.shard in shards else new_shards).append(b.shard)
        shards[b.shard] = _ShardEntry(key, table.num_rows, hashlib.sha256(data).hexdigest(), generation)

    seen: set[str] = set()
    notes: Counter[str] = Counter()
    roles: Counter[str] = Counter()
    records = valid = duplicates = existing = agentic = 0
    limit_reached = False

    reader = read_source(source_uri, s3_client=s3_client, store=store,
                         max_raw_record_chars=config.max_raw_record_chars)
    with reader:
        item: SourceItem
        for item in reader:
            records += 1
            if item.problem is not None:
                quarantine.add(item.index, item.problem, item.detail, raw=item.raw, raw_chars=item.raw_chars,
                               byte_offset=item.byte_offset)
                continue
            try:
                p = normalize_record(item.record, config, index=item.index)
            except RecursionError:  # a path the depth checks missed: one record must never stop the corpus
                p = Rejection("nested_too_deep", "nested too deeply to normalize (Python's recursion limit "
                                                 f"{sys.getrecursionlimit()})")
            if isinstance(p, Rejection):
                quarantine.add(item.index, p.reason, p.detail, record=item.record, byte_offset=item.byte_offset)
                continue
            if p.prompt_id in seen:
                duplicates += 1
                continue
            seen.add(p.prompt_id)
            valid += 1
            agentic += p.agentic_turns is not None
            notes.update(p.notes)
            roles.update(p.roles)
            if p.prompt_id in in_corpus:
                existing += 1
            else:
                if builder.free <= 0:
                    flush(builder)
                    builder = _ShardBuilder(shard_name(next_shard), None, cap)
                    next_shard += 1
                builder.add(p, source, item.index, generation)
                new_ids.append(p.prompt_id)
                new_shard_of.append(builder.shard)
            if config.limit is not None and valid >= config.limit:
                limit_reached = True
                break
    summary = reader.summary
    del seen

    quarantine_key = layout.corpus_quarantine(source)
    if valid == 0:
        quarantine.publish(store, quarantine_key)
        counts = ", ".join(f"{k}={v}" for k, v in quarantine.counts.most_common()) or "none"
        why = f"{records} records read; quarantined: {counts}"
        if summary.truncated:
            why += f"; source truncated at byte {summary.truncated_at_byte}"
        if summary.parse_error:
            why += f"; {summary.parse_error}"
        raise NoValidPromptsError(
            f"no valid prompt in {summary.uri} ({summary.format}, {summary.compression}): {why}. "
            f"Rejected records are in {store.url(quarantine_key)}; the corpus is unchanged."
        )
    flush(builder)

    new_manifest = pa.table({"prompt_id": new_ids, "shard": new_shard_of,
                             "generation": pa.array([generation] * len(new_ids), pa.int32())},
                            schema=MANIFEST_SCHEMA)
    del new_ids, new_shard_of
    if old_manifest is not None:
        new_manifest = pa.concat_tables([old_manifest.cast(MANIFEST_SCHEMA), new_manifest])
    manifest_key = layout.corpus_manifest(generation, run)
    staged.append(manifest_key)
    store.write_parquet(manifest_key, new_manifest)

    seconds = time.perf_counter() - t0
    sources = dict(index.sources)
    sources[source] = {"uri": summary.uri, "generation": generation, "valid": valid, "new_prompts": len(new_manifest)
                       - (old_manifest.num_rows if old_manifest is not None else 0)}
    new_index = _CorpusIndex(generation, manifest_key, shards, sources, run)
    # The commit: generation N's index is created once; a run that finds it taken lost the race.
    if not store.create(layout.corpus_commit(generation), json.dumps(new_index.to_json(), indent=2).encode()):
        winner = _load_index(store)
        raise ConcurrentIngestError(
            f"another ingest (run {winner.run or 'unknown'}) committed generation {generation} of the prompt "
            f"corpus at {store.uri} while this one (run {run}, source {source}) ran from generation "
            f"{index.generation}; nothing of this run was committed and its staged objects are removed. "
            "Run the ingest again: it starts from the new corpus. (Ingests of one store should run one at a time.)"
        )
    store.write_json(layout.corpus_index(), new_index.to_json())  # a copy for readers; may lag, see _load_index
    quarantine.publish(store, quarantine_key)

    new_prompts = sources[source]["new_prompts"]
    report = IngestReport(
        source_uri=summary.uri,
        source_name=source,
        source_format=summary.format,
        compression=summary.compression,
        generation=generation,
        records_read=records,
        valid=valid,
        duplicates=duplicates,
        quarantined=dict(sorted(quarantine.counts.items())),
        truncated=summary.truncated,
        truncated_at_byte=summary.truncated_at_byte,
        parse_error=summary.parse_error,
        json_arrays=summary.json_arrays,
        limit_reached=limit_reached,
        new_prompts=new_prompts,
        existing_prompts=existing,
        kept_not_in_source=len(in_corpus) - existing,
        corpus_prompts=new_manifest.num_rows,
        shard_keys=sorted(shards),
        shard_sizes={k: shards[k].num_prompts for k in sorted(shards)},
        new_shards=sorted(new_shards),
        changed_shards=sorted(changed_shards),
        notes=dict(sorted(notes.items())),
        roles=dict(sorted(roles.items())),
        quarantine_key=quarantine_key,
        seconds=round(seconds, 3),
        agentic_prompts=agentic,
    )
    store.write_json(layout.corpus_report(source), report.as_dict())
    _collect_garbage(store, new_index, index)
    return report


_KEEP_COMMITS = 16  # commit objects kept behind the newest (index.json rolls forward through them)


def _collect_garbage(store: Any, current: _CorpusIndex, previous: _CorpusIndex) -> None:
    """Delete staged shards, manifests and commits that no live ingest can need.

    An unreferenced object of generation <= ``previous.generation`` belongs to
    a run that lost or died (that generation is committed by another run), so
    it goes; objects of newer generations may belong to an ingest still
    running (it will fail to commit and remove them itself) and stay. The
    previous generation's objects stay too, so that a partition run that read
    the old index can still finish. Commit objects more than ``_KEEP_COMMITS``
    (16) generations old go.
    """
    keep = {e.key for e in current.shards.values()} | {e.key for e in previous.shards.values()}
    keep |= {current.manifest_key, previous.manifest_key}
    for prefix in (layout.corpus_staged_prefix(), layout.corpus_manifest_prefix()):
        for key in store.list(prefix):
            gen = layout.corpus_key_generation(key)
            if key not in keep and gen is not None and gen <= previous.generation:
                store.delete(key)
    for key in store.list(layout.corpus_commits_prefix()):
        gen = layout.corpus_key_generation(key)
        if gen is not None and gen < current.generation - _KEEP_COMMITS:
            store.delete(key)


# --- materialize -------------------------------------------------------------------


def materialize_prompt_shard(store: Any, shard_key: str) -> tuple[pa.Table, ShardStats]:
    """Write ``raw_prompts/<shard_key>.parquet`` from the committed corpus; return its table and stats."""
    index = _load_index(store)
    entry = index.shards.get(shard_key)
    if entry is None:
        known = sorted(index.shards)
        span = f"{known[0]} .. {known[-1]}" if known else "none (run the ingest first)"
        raise KeyError(f"shard {shard_key!r} is not in the prompt corpus at {store.uri}; shards: {span}")
    data = store.read_bytes(entry.key)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ValueError(f"staged shard {entry.key} has sha256 {digest}, the index says {entry.sha256}")
    table = pq.read_table(pa.BufferReader(data))
    if table.num_rows != entry.num_prompts or set(table.column("shard").unique().to_pylist()) != {shard_key}:
        raise ValueError(f"staged shard {entry.key} does not hold {entry.num_prompts} rows of {shard_key}")
    key = layout.raw_prompts(shard_key)
    store.write_bytes(key, data)
    return table, _shard_stats(table, shard_key, key, digest, entry.generation)


def _shard_stats(table: pa.Table, shard: str, key: str, digest: str, generation: int) -> ShardStats:
    import pyarrow.compute as pc

    n = table.num_rows
    turns = table.column("num_user_turns")
    chars = table.column("prompt_chars")

    def counts(col: str) -> dict[str, int]:
        vc = pc.value_counts(table.column(col)).to_pylist()
        return {d["values"]: d["counts"] for d in sorted(vc, key=lambda d: (-d["counts"], d["values"]))}

    return ShardStats(
        shard=shard,
        key=key,
        num_prompts=n,
        num_user_turns=int(pc.sum(turns).as_py() or 0),
        max_user_turns=int(pc.max(turns).as_py() or 0),
        with_system=n - table.column("system").null_count,
        starts_mid_conversation=int(pc.sum(table.column("starts_mid_conversation").cast(pa.int64())).as_py() or 0),
        prompt_chars_mean=round(float(pc.mean(chars).as_py() or 0.0), 1),
        prompt_chars_max=int(pc.max(chars).as_py() or 0),
        sources=counts("source"),
        categories=counts("category"),
        sha256=digest,
        generation=generation,
        agentic_prompts=(n - table.column("agentic_turns").null_count) if "agentic_turns" in table.column_names else 0,
    )
