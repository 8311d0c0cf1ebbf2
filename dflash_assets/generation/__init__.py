"""Stage 2, completions: what a regeneration samples with (`config`), engine clients for SGLang, OpenAI-compatible
and in-process engines (`engines/`, one module per engine beside their shared protocol) and their tokenizer adapter (`chat_tokenizer`), the fleet of engines (`fleet`),
shard regeneration with a journal (`completions`), tool calls parsed out of the target's text and compared with the
recorded ones (`tool_calls`), serving a target on a host (`server`), a few answers as readable text
(`examples`), and the completions stage over the store (`stage`)."""
