"""Prompt texts to ids for the in-process engine, batched per pass of the event loop and encoded off the GIL.

A shard's requests reach the engine all at once; encoded one by one on the event loop, the tokenizer's Rust
``encode`` holds Python's GIL for each prompt, seconds of it for a shard, while the engine's worker thread needs
the GIL to run its prefills and steps. `PromptEncoder` gathers the texts asked for in one pass of the loop and
encodes them with one ``encode_batch`` (`ChatTokenizer.encode_many`), which runs without the GIL and on all
cores. A batch of fewer than ``batch_chars`` characters (a lone later turn) is encoded text by text: that costs
less than handing the GIL to the worker thread and waiting to take it back. The ids are the same either way; a
text that fails to encode fails its own request only.

Reads and writes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

__all__ = ["PromptEncoder"]


class PromptEncoder:
    """``await encode(text)``: the text's ids, encoded together with the other texts asked for in the same pass
    of the event loop.

    ``encode_one(text)`` and ``encode_many(texts)`` must give the same ids (a ``ChatTokenizer``'s ``encode`` and
    ``encode_many``); a batch of at least ``batch_chars`` characters goes to ``encode_many``. ``batches`` counts
    the batches each way (for logs and tests)."""

    def __init__(self, encode_one: Callable[[str], list[int]],
                 encode_many: Callable[[Sequence[str]], list[list[int]]], *, batch_chars: int = 16384):
        self.encode_one = encode_one
        self.encode_many = encode_many
        self.batch_chars = int(batch_chars)
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the pending texts wait in
        self.batches = {"together": 0, "one_by_one": 0}

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if loop is not self._loop:  # another event loop (the engine serves one asyncio.run after another)
            self._pending, self._loop = [], loop
        if not self._pending:
            loop.call_soon(self._flush)  # after the callbacks already queued: the requests of this pass
        self._pending.append((text, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        texts = [text for text, _ in batch]
        if len(texts) > 1 and sum(map(len, texts)) >= self.batch_chars:
            try:
                rows = self.encode_many(texts)
            except Exception:  # noqa: BLE001 - text by text below: the error reaches only its own request
                pass
            else:
                self.batches["together"] += 1
                for (_, future), row in zip(batch, rows):
                    if not future.done():  # not a cancelled request
                        future.set_result(list(row))
                return
        self.batches["one_by_one"] += 1
        for text, future in batch:
            try:
                row = self.encode_one(text)
            except Exception as e:  # noqa: BLE001 - handed to the request that asked
                if not future.done():
                    future.set_exception(e)
                continue
            if not future.done():
                future.set_result(row)
