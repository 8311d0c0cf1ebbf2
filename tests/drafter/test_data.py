"""The drafter's training data (dflash_assets.drafter.data): anchors, collated and bucketed batches, the plan of
which samples each rank reads at each step (windows of parts), online samples streamed from real Parquet by row
group, the training data a recipe opens, and the loader that collates the plan's batches ahead."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.drafter.data import (BatchLoader, BatchPlan, CacheSamples, ParquetSamples, anchor_rng,
                                        open_training_data, sample_anchors)
from dflash_assets.drafter.recipe import DrafterRecipe
from tests.hidden_states.test_format import FIXTURE


def test_sample_anchors_rules():
    lm = np.zeros(40, dtype=bool)
    lm[10:] = True
    B = 8
    for seed in range(5):
        a = sample_anchors(lm, B, 12, anchor_rng(3, 0, seed))
        assert len(a) == 12 and len(set(a.tolist())) == 12 and (np.diff(a) > 0).all()
        assert lm[a].all() and a.max() <= 40 - B  # loss_mask = 1 and position <= len - B
    assert len(sample_anchors(lm, B, 512, anchor_rng(0, 0, 0))) == 40 - B + 1 - 10  # all of them
    assert np.array_equal(sample_anchors(lm, B, 5, anchor_rng(1, 2, 3)), sample_anchors(lm, B, 5, anchor_rng(1, 2, 3)))
    assert len(sample_anchors(np.ones(5, bool), B, 4, anchor_rng(0, 0, 0))) == 0  # too short


def test_bucketed_widths_are_few_and_waste_at_most_half():
    from dflash_assets.drafter.data import Sample, bucket_width, collate

    widths = [bucket_width(n, 128) for n in range(1, 4097)]
    assert all(w >= n and w % 128 == 0 for n, w in zip(range(1, 4097), widths))
    assert all(w <= max(1.5 * -(-n // 128) * 128, 256) for n, w in zip(range(1, 4097), widths))
    assert sorted(set(widths)) == [128 * k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    assert [bucket_width(n) for n in (1, 2, 3, 4, 5, 7, 9, 13)] == [1, 2, 3, 4, 6, 8, 12, 16]
    samples = [Sample(np.arange(n, dtype=np.int64), np.ones(n, dtype=bool), None) for n in (300, 140)]
    anchors = [np.arange(0, 40, 2), np.arange(3)]
    bucketed = collate(samples, anchors, seq_multiple=128, anchor_multiple=8, bucket=True)
    plain = collate(samples, anchors, seq_multiple=128, anchor_multiple=8)
    assert bucketed.input_ids.shape == (2, 384) and bucketed.anchors.shape == (2, 24)
    assert plain.input_ids.shape == (2, 384) and plain.anchors.shape == (2, 24)
    wider = collate([Sample(np.arange(700, dtype=np.int64), np.ones(700, dtype=bool), None)], anchors[:1],
                    seq_multiple=128, anchor_multiple=8, bucket=True)
    assert wider.input_ids.shape == (1, 768)  # 6 x 128, where plain rounding gives 640: one of few widths
    assert wider.num_tokens == 700 and int(wider.keep.sum()) == 20




def test_windowed_plan_reads_one_window_of_parts_at_a_time():
    r = DrafterRecipe(name="plan", batch_size=3, epochs=2, seed=5)
    groups = np.repeat(np.arange(6), 5)  # 6 parts of 5 samples
    plan = BatchPlan(len(groups), r, world=1, rank=0, groups=groups, group_bytes=np.full(6, 100), window_bytes=200)
    for epoch in range(2):
        perm = plan.permutation(epoch)
        assert sorted(perm.tolist()) == list(range(30))  # every sample once per epoch
        seen = groups[perm]
        windows = [set(seen[i:i + 10].tolist()) for i in range(0, 30, 10)]
        assert all(len(w) == 2 for w in windows) and set().union(*windows) == set(range(6))
    order = plan.sample_order(0, plan.total_steps)
    assert len(order) == plan.total_steps * 3
    assert order.tolist() == [i for s in range(plan.total_steps) for i in plan.indices(s)[1]]
    unbounded = BatchPlan(30, r, world=1, rank=0)
    assert unbounded.permutation(0).tolist() == np.random.default_rng([r.seed, 0, 7]).permutation(30).tolist()


def test_online_samples_stream_by_row_group_within_a_memory_bound(tmp_path):
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 1000, n).tolist(), (rng.random(n) > 0.3).astype(int).tolist())
            for n in rng.integers(20, 60, 40)]
    table = pa.table({"input_ids": pa.array([r[0] for r in rows], pa.list_(pa.int32())),
                      "loss_mask": pa.array([r[1] for r in rows], pa.list_(pa.int8()))})
    path = tmp_path / "samples.parquet"
    pq.write_table(table, path, row_group_size=5)  # 8 row groups
    one_group = ParquetSamples._decoded_bytes(5 * 60, 5)
    data = ParquetSamples([path], max_length=32, block_size=4, max_bytes=2 * one_group)
    assert len(data.group_bytes) == 8 and len(data) == 40
    for i in range(len(data)):
        s = data[i]
        ids, lm = rows[i]
        assert s.input_ids.dtype == np.int64 and s.input_ids.tolist() == ids[:32]
        assert s.loss_mask.tolist() == [bool(x) for x in lm[:32]]
        assert data._held <= data.max_bytes and len(data._cache) < 8  # a few row groups, never the file
        assert all(v[1].dtype == np.int32 for v in data._cache.values())  # held as int32, not int64




def test_ranks_split_each_global_batch_and_the_plan_is_the_same_on_every_call():
    r = DrafterRecipe(name="plan", batch_size=2, epochs=2, seed=3)
    ranks = [BatchPlan(10, r, world=2, rank=k) for k in range(2)]
    assert ranks[0].steps_per_epoch == 3 and ranks[0].total_steps == 6  # 10 samples, global batch 4
    for step in range(ranks[0].steps_per_epoch - 1):  # the epoch's last step wraps around
        (e0, a), (e1, b) = ranks[0].indices(step), ranks[1].indices(step)
        assert e0 == e1 == 0 and not set(a) & set(b) and len(a) == len(b) == 2
    again = BatchPlan(10, r, world=2, rank=0)
    assert [again.indices(s) for s in range(6)] == [ranks[0].indices(s) for s in range(6)]
    assert not np.array_equal(ranks[0].permutation(0), ranks[0].permutation(1))  # a new order each epoch


def test_a_recipe_opens_parquet_online_and_the_cache_otherwise_and_the_loader_collates_the_plan(tmp_path):
    table = pa.table({"input_ids": pa.array([list(range(12)), list(range(20, 30))], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0] * 4 + [1] * 8, [1] * 10], pa.list_(pa.int8()))})
    pq.write_table(table, tmp_path / "samples.parquet")
    online = DrafterRecipe(name="on", online=True, block_size=4, batch_size=2, max_anchors=3, epochs=1)
    data = open_training_data([tmp_path / "samples.parquet"], online)
    assert isinstance(data, ParquetSamples) and len(data) == 2 and data[1].input_ids.tolist() == list(range(20, 30))
    offline = DrafterRecipe(name="off", block_size=3, max_length=4)
    cache = open_training_data(sorted(FIXTURE.glob("*.safetensors")), offline)
    assert isinstance(cache, CacheSamples) and cache[0].hidden.shape == (4, 8)

    plan = BatchPlan(len(data), online, world=1, rank=0)
    loader = BatchLoader(data, plan, 0, plan.total_steps, cuda=False)
    try:
        step, batch = loader.next()
    finally:
        loader.close()
    _, idx = plan.indices(0)
    assert step == 0 and batch.input_ids.shape == (2, 12) and batch.num_tokens == 22
    for row, i in enumerate(idx):
        n = len(data[i].input_ids)
        assert batch.input_ids[row, :n].tolist() == data[i].input_ids.tolist()
        want = sample_anchors(data[i].loss_mask, 4, 3, anchor_rng(online.seed, 0, i))
        assert batch.anchors[batch.block_sample == row].tolist() == want.tolist()  # packed: one row of blocks
    assert batch.packed and bool(batch.keep.all()) and batch.context_slots == 22  # on a CPU: no padding at all
