"""The completions stage over a real local store and the SGLang-shaped loopback: a partition's raw prompts
regenerated and published, resumed for the same target, regenerated for another target of the same name."""

from __future__ import annotations

import pyarrow as pa

from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
from dflash_assets.generation.stage import regenerate_partition
from dflash_assets.store import layout
from tests.support.sglang_loopback import LoopbackServer


def test_resume_does_not_reuse_rows_of_another_target_of_the_same_name(two_targets, local_store):
    a, b = two_targets
    rows = [{"prompt_id": f"p{i}", "system": None, "user_turns": [f"question {i}"]} for i in range(3)]
    local_store.write_parquet(layout.raw_prompts("s"), pa.Table.from_pylist(rows))
    gen = GenerationConfig(max_new_tokens=16)

    def fleet(srv, spec):
        return EngineFleetConfig(target_model=spec.model_path, backoff_initial_s=0.01,
                                 endpoints=[EndpointConfig(url=srv.url, max_concurrency=2)])

    with LoopbackServer(model_path=a.model_path) as srv:
        first = regenerate_partition(local_store, "s", a, fleet(srv, a), generation=gen)
        same = regenerate_partition(local_store, "s", a, fleet(srv, a), generation=gen)
        assert srv.stats.generate_requests == 3 and same.stats.prompts_resumed == 3  # same dir: rows reused
        other = regenerate_partition(local_store, "s", b, fleet(srv, b), generation=gen)
        assert srv.stats.generate_requests == 6  # b/m: everything regenerated, nothing resumed
    assert first.config_hash == same.config_hash == gen.config_hash(a.model_path, None, a.generation_fingerprint())
    assert other.stats.prompts_resumed == 0 and other.config_hash != first.config_hash
    assert set(other.table["config_hash"].to_pylist()) == {other.config_hash}
