"""Capture batching: tokenized samples normalized from Arrow or dicts (bad ones refused with the sample named),
forwards of at most a token budget with no padding, and parts under a byte budget."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dflash_assets.hidden_states.batching import load_samples, plan_batches, plan_parts


def test_samples_from_arrow_and_from_dicts_agree():
    table = pa.table({"prompt_id": ["a", "b"], "input_ids": [[1, 2, 3], [4]], "loss_mask": [[0, 1, 1], [1]],
                      "num_tokens": [3, 1]})
    from_arrow = load_samples(table)
    from_dicts = load_samples(table.to_pylist())
    for x, y in zip(from_arrow, from_dicts):
        assert x.prompt_id == y.prompt_id and np.array_equal(x.input_ids, y.input_ids)
        assert np.array_equal(x.loss_mask, y.loss_mask) and x.loss_mask.dtype == np.uint8


@pytest.mark.parametrize("row,message", [
    ({"prompt_id": "a", "input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 tokens"),
    ({"prompt_id": "a", "input_ids": [1, 2], "num_tokens": 3}, "num_tokens=3"),
    ({"prompt_id": "a", "input_ids": []}, "has no tokens"),
])
def test_bad_samples_are_refused_naming_the_sample(row, message):
    with pytest.raises(ValueError, match=message):
        load_samples([row])


def test_packed_batches_are_contiguous_within_the_budget_and_a_long_sample_runs_alone():
    batches = plan_batches([3, 4, 2, 10, 1], tokens_per_batch=8)
    assert [b.indices for b in batches] == [(0, 1), (2,), (3,), (4,)]
    assert all(b.packed for b in batches) and batches[2].num_tokens == 10


def test_unpacked_batches_stack_only_samples_of_one_length():
    batches = plan_batches([4, 2, 4, 4, 2], tokens_per_batch=8, packed=False)
    assert [(b.indices, b.lengths) for b in batches] == [((0, 2), (4, 4)), ((1, 4), (2, 2)), ((3,), (4,))]
    with pytest.raises(ValueError):
        plan_batches([1], tokens_per_batch=0)


def test_parts_stay_under_the_byte_budget_in_order():
    parts = plan_parts([2, 2, 2, 5], row_bytes=10, max_part_bytes=40)
    assert parts[0] == (0, 2) and parts[-1][1] == 4
    assert all(start < stop for start, stop in parts)
