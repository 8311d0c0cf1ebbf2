"""Tool calls in the target's output: parse them, compare them with recorded ones.

Reads text and call objects in memory; writes nothing. Used by the completions
stage to regenerate agentic conversations.

- :func:`parse_qwen_tool_calls` reads the Qwen3.5/3.6 format that the
  packaged template renders and the models emit::

      <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

  A value is JSON text unless the tool's schema types the parameter as a
  string (as SGLang's ``qwen3_coder`` parser converts it); without a schema,
  text that is not JSON stays a string. The text before the first
  ``<tool_call>`` is the step's content. A block that cannot be read leaves
  the text as it is, with no calls, and ``malformed`` set.
- :func:`calls_from_server` normalizes the ``tool_calls`` an OpenAI-style
  server returns when it runs a tool-call parser (arguments as JSON text).
- :func:`same_calls` compares two call lists: same length and order, same
  names, arguments equal as parsed JSON (``1 == 1.0``, ``true != 1``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["parse_qwen_tool_calls", "calls_from_server", "same_calls", "tool_schemas", "TOOL_CALL_START"]

TOOL_CALL_START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?((?:(?!</?tool_call>|</function>).)*)</function>\s*</tool_call>",
                    re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict]:
    """Tool name -> its parameters' JSON schema properties (OpenAI or bare tool objects)."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
            props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
            out[fn["name"]] = dict(props)
    return out


def _value(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_qwen_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None
                          ) -> tuple[str, list[dict], bool]:
    """``(content, calls, malformed)`` of a generated step; calls are ``{"name", "arguments": dict}``."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, [], False
    schemas = tool_schemas(tools)
    calls: list[dict] = []
    pos = start
    while pos < len(text):
        m = _BLOCK.match(text, pos)
        if m is None:
            return text, [], True
        name = m.group(1).strip()
        props = schemas.get(name, {})
        args = {p.group(1).strip(): _value(p.group(2), props.get(p.group(1).strip()))
                for p in _PARAM.finditer(m.group(2))}
        calls.append({"name": name, "arguments": args})
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return text[:start].rstrip(), calls, False


def calls_from_server(raw: Any) -> tuple[list[dict], bool]:
    """``(calls, malformed)`` of a server's OpenAI ``tool_calls`` (arguments JSON text or an object)."""
    calls: list[dict] = []
    if not raw:
        return calls, False
    if not isinstance(raw, list):
        return [], True
    for item in raw:
        fn = item.get("function", item) if isinstance(item, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return [], True
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return [], True
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return [], True
        call = {"name": fn["name"], "arguments": dict(args)}
        if isinstance(item.get("id"), str) and item["id"]:
            call["id"] = item["id"]
        calls.append(call)
    return calls, False


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def same_calls(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two call lists name the same tools with equal arguments, in the same order."""
    return len(a) == len(b) and all(x["name"] == y["name"] and _json_equal(x["arguments"], y["arguments"])
                                    for x, y in zip(a, b))
