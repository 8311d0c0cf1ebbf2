"""Prompt normalization: one source record -> a :class:`Prompt` (plain chat or agentic) or a :class:`Rejection`.

Plain chats (ShareGPT ``conversations`` or OpenAI ``messages``) go through
:func:`normalize_record`; a record with tools, tool calls or tool results goes
on to :func:`normalize_agentic_record`. Both read a turn's role and content
with one turn parser (``records.parse_turns``) and the one role table
(:data:`ROLE_MAP`, plus :data:`AGENTIC_ROLE_MAP` for agentic records). A
prompt's id is a content hash (:func:`prompt_id`, :func:`agentic_prompt_id`);
a rejection carries a reason code of
:data:`dflash_assets.prompts.quarantine.QUARANTINE_REASONS`. Every field that
carries conversation content (:data:`RECORD_FIELDS`, :data:`TURN_FIELDS`) is
kept in the prompt, or the record is rejected (``unkept_content`` when the
prompt has no place for it); other non-null fields are named in
``Prompt.unknown_fields`` for the ingest to count.

The turn parser and the record types are ``prompts.records``'s, the agentic normalizer ``prompts.agentic``'s
(both re-exported here). Reads the record it is given (and, for tool schemas, the ``jsonschema`` package);
writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_assets.prompts.agentic import AGENTIC_ROLE_MAP, agentic_prompt_id, is_agentic, normalize_agentic_record
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.records import (
    ASSISTANT,
    DEFAULT_CONFIG,
    MISSING,
    Prompt,
    RECORD_FIELDS,
    ROLE_MAP,
    Rejection,
    SYSTEM,
    TURN_FIELDS,
    USER,
    content_text,
    merge_system,
    parse_turns,
    prompt_id,
    read_record_fields,
    record_conversation,
    record_id_text,
    record_provenance,
    unicode_normalize,
)

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
    config = config or DEFAULT_CONFIG
    if not isinstance(record, dict):
        return Rejection("not_an_object", f"record is a JSON {type(record).__name__}")
    where, turns = record_conversation(record)
    if turns is None:
        return Rejection("missing_conversation", "no 'conversations' or 'messages' field")
    if not isinstance(turns, list):
        return Rejection("missing_conversation", f"conversation is a {type(turns).__name__}, not a list")
    if not turns:
        return Rejection("empty_conversation", "0 turns")
    if is_agentic(record, turns):
        return normalize_agentic_record(record, config, index=index)
    fields = read_record_fields(record, config)
    if fields.__class__ is Rejection:
        return fields
    top_system, record_unknown = fields
    unknown: set[str] = set(record_unknown)
    chat = _plain_turns(turns, where, unknown, [] if top_system is None else [top_system])
    if chat.__class__ is Rejection:
        return chat
    return _plain_prompt(record, config, index, chat, unknown, len(turns))


@dataclass
class _PlainTurns:
    """A plain chat's turns as read: system texts, runs of user turns (a run has no assistant turn inside), roles."""

    systems: list[str]  # the top-level system field, then the leading system turns
    runs: list[list[str]] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    leading_assistant: int = 0  # assistant turns before the first user turn
    empty_user: int = 0


def _plain_turns(turns: list, where: str, unknown: set[str], systems: list[str]) -> _PlainTurns | Rejection:
    """Read a plain chat's turns in order; a turn without text content or a late system turn rejects the record."""
    chat = _PlainTurns(systems)
    run: list[str] | None = None
    started = False  # a non-system turn was seen
    for parsed in parse_turns(turns, ROLE_MAP, where, unknown):
        if parsed.__class__ is Rejection:
            return parsed
        i, turn, kind, name, content = parsed
        if content is MISSING:
            return Rejection("bad_turn", f"turn {i} has no content")
        text = content if content.__class__ is str else content_text(content)
        if text is None:
            return Rejection("non_string_content", f"turn {i} ({name}) content is a {type(content).__name__}")
        chat.roles.append(name)
        if kind == SYSTEM:
            if started:
                return Rejection("late_system_turn", f"system turn at position {i}")
            chat.systems.append(text)
        elif kind == USER:
            started = True
            text = unicode_normalize("NFC", text).strip()
            if not text:
                chat.empty_user += 1
                continue
            if run is None:
                run = []
                chat.runs.append(run)
            run.append(text)
        else:
            started = True
            if not chat.runs:
                chat.leading_assistant += 1
            run = None
    return chat


def _plain_prompt(record: dict, config: IngestConfig, index: int, chat: _PlainTurns, unknown: set[str],
                  num_turns: int) -> Prompt | Rejection:
    """The read chat's checks (a user turn, the leading-assistant policy), notes, size check and id -> the
    :class:`Prompt`."""
    runs, leading_assistant = chat.runs, chat.leading_assistant
    if not runs:
        kinds = {ROLE_MAP[r] for r in chat.roles}
        what = ("system-only" if kinds == {SYSTEM} else "assistant-only" if USER not in kinds
                else "user turns are empty")
        return Rejection("no_user_turn", f"{what} ({num_turns} turns)")
    if leading_assistant and config.leading_assistant == "quarantine":
        return Rejection("assistant_first", f"{leading_assistant} assistant turn(s) before the first user turn")

    system, notes = merge_system(chat.systems)
    if chat.empty_user:
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
        **record_provenance(record, config, index),
        starts_mid_conversation=leading_assistant > 0,
        prompt_chars=chars,
        roles=tuple(chat.roles),
        notes=tuple(notes),
        unknown_fields=tuple(sorted(unknown)),
    )
