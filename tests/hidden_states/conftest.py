"""The tiny dense and hybrid targets, each as a capture model and an independent HF reference, loaded once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_assets.hidden_states import capture as hsc


@pytest.fixture(scope="session")
def targets(tiny_dense_target, tiny_hybrid_target):
    """Per kind: (path, capture model, independent HF reference model), float32 on CPU."""
    out = {}
    for kind, path in (("dense", tiny_dense_target), ("hybrid", tiny_hybrid_target)):
        model = hsc.load_target(path, "cpu", "float32")
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # plain sdpa
        out[kind] = (path, model, ref)
    return out
