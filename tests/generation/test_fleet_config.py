"""The fleet's configuration: the slots cache's in-flight default (a whole shard), what keeps an endpoint busy, and
a whole shard reaching an in-process slot engine at once through the completions stage."""

from __future__ import annotations

import pytest

from dflash_assets.generation.completions import regenerate_shard
from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.engines import TransformersEngine
from dflash_assets.generation.fleet import SLOTS_IN_FLIGHT, EndpointConfig, EngineFleetConfig, build_engine


def test_a_slot_endpoint_keeps_a_whole_shard_in_flight_unless_told_otherwise():
    """kind transformers, cache slots: no max_concurrency given -> SLOTS_IN_FLIGHT in flight and as many rows as
    the field's default max_concurrency (or those given); given -> kept as it is. Other kinds and caches keep the field's default. A dump
    validates back to the same endpoint."""
    slots = EndpointConfig(url="inprocess://gpu", kind="transformers", cache="slots")
    assert (slots.max_concurrency, slots.max_batch_rows) == (SLOTS_IN_FLIGHT, 32)
    assert slots.busy_concurrency == 64  # twice its rows: what a throughput burst sends
    rows = EndpointConfig(url="inprocess://gpu", kind="transformers", cache="slots", max_batch_rows=512)
    assert (rows.max_concurrency, rows.max_batch_rows, rows.busy_concurrency) == (SLOTS_IN_FLIGHT, 512, 1024)
    told = EndpointConfig(url="inprocess://gpu", kind="transformers", cache="slots", max_concurrency=100)
    assert (told.max_concurrency, told.max_batch_rows, told.busy_concurrency) == (100, None, 100)
    for other in (EndpointConfig(url="inprocess://cpu", kind="transformers"),
                  EndpointConfig(url="http://127.0.0.1:30000", kind="sglang")):
        assert (other.max_concurrency, other.max_batch_rows, other.busy_concurrency) == (32, None, 32)
    again = EndpointConfig.model_validate(slots.model_dump())
    assert again == slots
    engine = build_engine(rows, EngineFleetConfig(target_model="m", endpoints=[rows]))
    assert isinstance(engine, TransformersEngine)
    assert (engine.max_concurrency, engine.max_batch_rows, engine.busy_concurrency) == (SLOTS_IN_FLIGHT, 512, 1024)


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_the_stage_hands_a_slot_engine_the_whole_shard_at_once(tiny_dense_target, local_store, monkeypatch,
                                                                max_concurrency):
    """Through regenerate_shard with the default in flight, every prompt of the shard is queued on the slot engine
    at once (so its long ones can reach their tiers at the start); with max_concurrency=2 never more than two
    are. The fleet starts one worker per prompt at most, not SLOTS_IN_FLIGHT of them."""
    from dflash_assets.generation import fleet as fleet_module
    from dflash_assets.generation.engines import inprocess_caches

    queued, most = [], []
    submit = inprocess_caches.SlotCache._slot_generate

    async def counting(self, ids, gen, stop_ids):
        queued.append(1)
        most.append(len(queued))
        try:
            return await submit(self, ids, gen, stop_ids)
        finally:
            queued.pop()

    monkeypatch.setattr(inprocess_caches.SlotCache, "_slot_generate", counting)
    workers = []
    worker = fleet_module._Dispatch._worker

    def counted_worker(self, ep):
        workers.append(ep)
        return worker(self, ep)

    monkeypatch.setattr(fleet_module._Dispatch, "_worker", counted_worker)
    told = {} if max_concurrency is None else {"max_concurrency": max_concurrency}
    cfg = EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[EndpointConfig(
        url="inprocess://tiny", kind="transformers", cache="slots", slot_len=256, max_batch_rows=2, **told)])
    rows = [{"prompt_id": f"p{i}", "system": None, "user_turns": [f"Say a word about the number {i}."]}
            for i in range(40)]  # more than the field's default of 32
    res = regenerate_shard(rows, shard="whole", store=local_store, fleet=cfg,
                           generation=GenerationConfig(max_new_tokens=4, temperature=0.0, max_turns=1))
    assert res.table.num_rows == 40 and res.stats.prompts_done == 40
    assert max(most) == (40 if max_concurrency is None else 2)
    assert len(workers) == (40 if max_concurrency is None else 2)
