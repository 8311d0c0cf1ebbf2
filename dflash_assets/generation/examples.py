"""A few of the target's answers, as text a person reads: the demo's console and the completions' UI metadata.

`answer_examples` takes the first (user prompt, final answer) pairs of a completions table;
`examples_markdown` renders them as a Markdown table with each text cut to a line.
Pure functions over an Arrow table: reads and writes nothing.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["answer_examples", "examples_markdown", "one_line"]


def answer_examples(table: pa.Table, count: int = 3) -> list[tuple[str, str]]:
    """The first ``count`` (first user turn, last assistant answer) pairs of a completions table's ``messages``,
    skipping conversations with no user text or an empty answer."""
    pairs: list[tuple[str, str]] = []
    if "messages" not in table.column_names:
        return pairs
    for messages in table.column("messages").to_pylist():
        messages = messages or []
        user = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        if user.strip() and answer.strip():
            pairs.append((user, answer))
        if len(pairs) == count:
            break
    return pairs


def one_line(text: str, limit: int) -> str:
    """``text`` with its white space folded to single spaces, cut to ``limit`` characters with '...'."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def examples_markdown(pairs: list[tuple[str, str]], limit: int = 300) -> str:
    """The pairs as a two-column Markdown table (prompt, answer), each cell one line of at most ``limit``."""
    def cell(text: str) -> str:
        return one_line(text, limit).replace("|", "\\|")

    rows = ["| prompt | answer |", "| --- | --- |"] + [f"| {cell(u)} | {cell(a)} |" for u, a in pairs]
    return "\n".join(rows)
