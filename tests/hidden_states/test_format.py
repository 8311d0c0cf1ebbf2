"""The hidden-state cache format: bytes per token and the budget checks, the streaming safetensors writer (out of
order, refusing bad writes, no partial file left), and the one reader over files of the previous layout
(`tests/data/hidden_state_cache_v1`), which refuses parts that do not tile their partition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_assets.hidden_states.format import (
    HiddenStateCacheReader,
    HiddenStateShard,
    SafetensorsStreamWriter,
    ShardMetadata,
    StorageBudgetExceeded,
    TensorSpec,
    bytes_per_token,
    check_budget,
    partition_gb,
    projected_corpus_bytes,
    shard_tensor_specs,
)

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "hidden_state_cache_v1"


@pytest.mark.parametrize("n_layers,hidden,dtype,expected", [
    (5, 5120, "bfloat16", 51_200),  # Qwen3.6-27B
    (5, 4096, "bfloat16", 40_960),  # Qwen3-8B
    (5, 4096, "float32", 81_920),
    (1, 64, torch.float16, 128),
])
def test_bytes_per_token(n_layers, hidden, dtype, expected):
    assert bytes_per_token(n_layers, hidden, dtype) == expected


def test_projections_and_budget_errors():
    corpus = projected_corpus_bytes(914_000, 3_000, 5, 5120, "bfloat16")
    assert 139e12 < corpus < 141e12  # ~140 TB for Qwen3.6-27B
    assert partition_gb(1024 * 3000, 1024, 5, 5120) == pytest.approx(1024 * 3000 * 51_205 / 1e9, rel=1e-3)
    check_budget(100, 1000, used_bytes=900)
    with pytest.raises(StorageBudgetExceeded, match="short by"):
        check_budget(101, 1000, used_bytes=900)
    with pytest.raises(StorageBudgetExceeded, match="free"):
        check_budget(100, None, free_bytes=99)


def test_stream_writer_fills_out_of_order_and_safetensors_loads_it(tmp_path):
    torch.manual_seed(0)
    hidden = torch.randn(37, 24).to(torch.bfloat16)
    cu = np.array([0, 10, 37], np.int64)
    meta = ShardMetadata("t", (1, 2, 3), "bfloat16", 8, prompt_ids=("a", "b"), extra={"note": "x"})
    path = tmp_path / "s.safetensors"
    with SafetensorsStreamWriter(path, shard_tensor_specs(37, 2, 3, 8, "bfloat16"), meta.to_header()) as w:
        w.write("hidden", hidden[20:], row=20)  # random access (another worker)
        w.write("cu_seqlens", cu)
        w.write("hidden", hidden[:5])  # sequential appends
        w.write("hidden", hidden[5:20])
        w.write("input_ids", np.arange(37, dtype=np.int32))
        w.write("loss_mask", np.ones(37, np.uint8))
        assert w.data_start % 8 == 0
    tensors = load_file(str(path))
    assert torch.equal(tensors["hidden"], hidden) and tensors["cu_seqlens"].tolist() == cu.tolist()
    assert tensors["input_ids"].dtype == torch.int32 and tensors["loss_mask"].dtype == torch.uint8
    with safe_open(str(path), "pt") as f:
        back = ShardMetadata.from_header(f.metadata())
    assert back == meta and back.extra == {"note": "x"}
    with HiddenStateShard(path) as shard:
        assert torch.equal(shard[1].hidden, hidden[10:37]) and torch.equal(shard.hidden(0), hidden[:10])
        with pytest.raises(IndexError):
            shard[2]


def test_stream_writer_refuses_bad_writes_and_removes_partial_files(tmp_path):
    specs = {"x": TensorSpec(torch.float32, (4, 2))}
    path = tmp_path / "p.safetensors"
    with pytest.raises(ValueError, match="not fully written"):
        with SafetensorsStreamWriter(path, specs) as w:
            w.write("x", np.zeros((3, 2), np.float32))
    assert not path.exists()
    with SafetensorsStreamWriter(path, specs) as w:
        with pytest.raises(ValueError, match="overflows"):
            w.write("x", np.zeros((2, 2), np.float32), row=3)
        with pytest.raises(TypeError):
            w.write("x", np.zeros((4, 2), np.float64))
        with pytest.raises(ValueError, match="whole number of rows"):
            w.write("x", np.zeros(3, np.float32))
        w.write("x", np.ones((4, 2), np.float32))
    assert load_file(str(path))["x"].sum() == 8
    with pytest.raises(ValueError, match="not a hidden-state shard"):
        HiddenStateShard(path)


def test_files_written_by_the_previous_layout_read_through_the_one_reader():
    """Two parts of one partition in the v1 file layout (``tests/data/hidden_state_cache_v1``), read through the
    one reader: lengths 5, 3, 4; hidden = arange, input_ids = 100 + token index, loss_mask = token index % 2."""
    from dflash_assets.drafter.data import CacheSamples

    parts = sorted(str(p) for p in FIXTURE.glob("*.safetensors"))
    with HiddenStateCacheReader(parts) as reader:
        assert len(reader) == 3 and reader.prompt_ids == ["p0", "p1", "p2"] and reader.layer_ids == [1, 3]
        s = reader[2]  # first sample of the second part: tokens 8..11
        assert s.input_ids.tolist() == [108, 109, 110, 111] and s.loss_mask.tolist() == [0, 1, 0, 1]
        assert torch.equal(s.hidden, torch.arange(8 * 8, 12 * 8, dtype=torch.float32).view(4, 8))
        assert [p.num_samples for p in reader.parts] == [2, 1] and reader.parts[0].nbytes == Path(parts[0]).stat().st_size
    # training's view: cut to 4 tokens, samples without an anchor position (block 3) dropped
    data = CacheSamples(parts, max_length=4, block_size=3)
    assert len(data) == 3 and data.groups.tolist() == [0, 0, 1] and data.layer_ids == [1, 3]
    first = data[0]
    assert first.input_ids.dtype == np.int64 and first.input_ids.tolist() == [100, 101, 102, 103]
    assert first.loss_mask.tolist() == [False, True, False, True] and first.hidden.shape == (4, 8)
    cut = CacheSamples(parts, max_length=1, block_size=1)  # first tokens 0, 5, 8: only token 5 is in the loss
    assert len(cut) == 1 and cut[0].input_ids.tolist() == [105]
    online = CacheSamples(parts, max_length=8, block_size=3, need_hidden=False)
    assert online[1].hidden is None and online[1].input_ids.tolist() == [105, 106, 107]


def test_reader_refuses_parts_that_do_not_tile_their_partition():
    parts = sorted(str(p) for p in FIXTURE.glob("*.safetensors"))
    with pytest.raises(ValueError, match="do not tile"):
        HiddenStateCacheReader(parts[1:])  # part 2 of 2 without part 1
    with pytest.raises(ValueError, match="rest of that partition is missing"):
        HiddenStateCacheReader(parts[:1])
    with pytest.raises(ValueError, match="do not tile"):
        HiddenStateCacheReader(parts[::-1])
