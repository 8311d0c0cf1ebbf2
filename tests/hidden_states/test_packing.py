"""Packed attention: samples packed into one row stay apart (a negative control shows a leak would be caught), and
a hybrid target without the linear-attention kernels is not packed, with a warning saying why."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dflash_assets.hidden_states import batching, packing
from dflash_assets.hidden_states import capture as hsc
from tests.hidden_states.support import hf_reference, make_samples


def test_leak_across_packed_samples_would_be_caught(targets):
    """Negative control: the same packed row with plain causal attention (no sample boundaries) differs."""
    _, model, ref = targets["dense"]
    samples = batching.load_samples(make_samples([30, 30]))
    ids = np.concatenate([s.input_ids for s in samples])
    pos = torch.cat([torch.arange(30), torch.arange(30)])[None]
    with torch.no_grad(), packing.packed_attention(model), hsc.LayerCapture(model, [3]) as cap:
        cap.target = torch.empty(60, 64)
        cap.text_model(input_ids=torch.from_numpy(ids).long()[None], position_ids=pos, use_cache=False)
        leaked = cap.target[30:].clone()
    expected = hf_reference(ref, samples[1].input_ids, [3])
    assert (leaked - expected).abs().max() > 1e-2


def test_hybrid_without_kernels_warns_and_refuses_packing(targets, caplog):
    _, model, _ = targets["hybrid"]
    assert packing.is_hybrid(model) and not packing.is_hybrid(targets["dense"][1])
    assert packing.linear_attention_kernels() == {"fla": False, "causal_conv1d": False}  # this machine
    with caplog.at_level(logging.WARNING, logger="dflash_assets.hidden_states.packing"):
        assert packing.resolve_packing(model, "cpu") is False
    assert "fla, causal_conv1d not importable" in caplog.text and "flash-linear-attention" in caplog.text
    with pytest.raises(ValueError, match="causal-conv1d"):
        packing.resolve_packing(model, "cpu", "packed")
