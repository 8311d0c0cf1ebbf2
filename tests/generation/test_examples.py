"""`generation.examples`: the answers a person reads in the demo's console and the completions' metadata."""

from __future__ import annotations

import pyarrow as pa

from dflash_assets.generation.examples import answer_examples, examples_markdown, one_line
from dflash_assets.store.schemas import COMPLETIONS_MESSAGES_TYPE


def _table(conversations: list[list[dict]]) -> pa.Table:
    return pa.table({"messages": pa.array(conversations, type=COMPLETIONS_MESSAGES_TYPE)})


def test_the_first_answered_conversations_in_order_skipping_empty_ones():
    turn = lambda role, text, reasoning=None: {"role": role, "content": text, "reasoning_content": reasoning}
    table = _table([
        [turn("system", "Be brief."), turn("user", "What is 2+2?"), turn("assistant", "4", "add them")],
        [turn("user", "Say nothing."), turn("assistant", "  ")],  # an empty answer is no example
        [turn("user", "Hi"), turn("assistant", "Hello!"), turn("user", "Bye"), turn("assistant", "Goodbye.")],
        [turn("user", "Third?"), turn("assistant", "Not reached.")],
    ])
    assert answer_examples(table, 2) == [("What is 2+2?", "4"), ("Hi", "Goodbye.")]
    assert answer_examples(pa.table({"prompt_id": ["x"]})) == []


def test_markdown_cells_are_one_line_escaped_and_cut():
    text = examples_markdown([("a | b\n\nc", "x" * 50)], limit=20)
    assert text.splitlines() == ["| prompt | answer |", "| --- | --- |", f"| a \\| b c | {'x' * 17}... |"]
    assert one_line("  one\n two  ", 100) == "one two" and one_line("abcdef", 5) == "ab..."
