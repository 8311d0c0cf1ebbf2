"""Arrow types of the conversation data the stages hand each other through the store.

`completions/<shard>.parquet` holds a `messages` column of one of these list types; generation
writes it and tokenization reads it, so both take the type from here. Plain chats use
`COMPLETIONS_MESSAGES_TYPE`; agentic conversations `AGENTIC_MESSAGES_TYPE` (OpenAI-style tool
calls with arguments as JSON text, role `tool` results). Reads and writes nothing.
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
COMPLETIONS_MESSAGES_TYPE = pa.list_(MESSAGE_TYPE)

TOOL_CALL_TYPE = pa.struct([
    ("id", pa.string()),
    ("type", pa.string()),
    ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
])
AGENTIC_MESSAGE_TYPE = pa.struct([
    ("role", pa.string()),
    ("content", pa.string()),
    ("reasoning_content", pa.string()),
    ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    ("tool_call_id", pa.string()),
    ("name", pa.string()),
])
AGENTIC_MESSAGES_TYPE = pa.list_(AGENTIC_MESSAGE_TYPE)
