"""ShareGPT as a completions-shaped table, for tests and benchmarks of tokenization.

Reads the embedded ShareGPT file through :func:`dflash_assets.prompts.sources.sharegpt_records`
(the ingest's reader) and returns an Arrow table in the completions shape
(``prompt_id``, ``messages``); writes nothing.
"""

from __future__ import annotations

import pyarrow as pa

from dflash_assets.prompts.normalization import ROLE_MAP
from dflash_assets.prompts.sources import sharegpt_records
from dflash_assets.store.schemas import COMPLETIONS_MESSAGES_TYPE

__all__ = ["sharegpt_completions"]


def sharegpt_completions(n: int) -> pa.Table:
    """A completions-shaped table from the first `n` ShareGPT records.

    Roles map as the ingest maps them (human/gpt/chatgpt/bing/bard/system to
    user/assistant/system); ``gpt`` turns become assistant content without
    reasoning (as if the target answered with thinking off). Records are kept
    as they are, including empty and assistant-first ones: the tokenizer must
    cope. ``prompt_id`` is ``sharegpt-<id>``.
    """
    records = sharegpt_records(n)

    def message(m: dict) -> dict:
        role = m.get("from", "")
        return {"role": ROLE_MAP.get(role, role), "content": m.get("value", ""), "reasoning_content": None}

    messages = [[message(m) for m in r.get("conversations", [])] for r in records]
    return pa.table(
        {
            "prompt_id": pa.array([f"sharegpt-{r.get('id', i)}" for i, r in enumerate(records)], pa.string()),
            "messages": pa.array(messages, COMPLETIONS_MESSAGES_TYPE),
        }
    )
