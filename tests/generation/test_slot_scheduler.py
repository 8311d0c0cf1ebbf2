"""The slot scheduler: requests from an asyncio loop to the decoder of the shortest slots that hold them, decoded
in turn or overlapped, with generate's greedy tokens; one that fits no slot fails alone."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_assets.generation.slot_decoding import SlotDecoder, SlotRequest
from dflash_assets.generation.slot_scheduler import SlotScheduler
from tests.generation.test_slot_decoding import STOP, _alone, _model, _prompts


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_sends_each_request_to_the_shortest_slot_that_holds_it(overlap):
    """From an asyncio loop: short requests to the short slots, long ones to the long slots (both decoded in turn,
    or with `overlap` every step queued before any is read; the tokens generate's), one that fits no slot fails
    alone."""
    model = _model("qwen3")
    rng = random.Random(9)
    short = _prompts(10, seed=4)
    long = [([rng.randrange(1, 300) for _ in range(n)], 25) for n in (150, 120, 90)]
    decoders = [SlotDecoder(model, slots=4, slot_len=64), SlotDecoder(model, slots=2, slot_len=200)]

    async def go():
        scheduler = SlotScheduler(lambda: decoders, ThreadPoolExecutor(max_workers=1), overlap=overlap)
        asks = [scheduler.generate(SlotRequest(ids, n, STOP)) for ids, n in [*short, *long]]
        too_long = scheduler.generate(SlotRequest(list(range(1, 190)), 20, STOP))
        return await asyncio.gather(*asks, too_long, return_exceptions=True)

    *answers, refused = asyncio.run(go())
    assert [a[0] for a in answers] == [_alone(model, ids, n) for ids, n in [*short, *long]]
    assert isinstance(refused, ValueError) and "do not fit a slot of 200" in str(refused)
    assert decoders[0].stats.requests == 10 and decoders[1].stats.requests == 3
    assert all(d.stream is None for d in decoders)  # CUDA streams only on CUDA
