"""What the hidden-state tests share: tokenized samples of known lengths (`make_samples`, as a samples table too) and
HF's own hidden states to compare with (`hf_reference`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch


ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [7, 23, 1, 23, 40, 5, 23, 16]  # three of 23 tokens: the hybrid stacks those in one forward
BUDGET = 64  # tokens per forward: several samples share each one


def make_samples(lengths=LENGTHS, seed=0, vocab=248_000):
    rng = np.random.default_rng(seed)
    return [{"prompt_id": f"p{i:03d}", "input_ids": rng.integers(0, vocab, n).astype(np.int32),
             "loss_mask": (rng.random(n) > 0.4).astype(np.uint8)} for i, n in enumerate(lengths)]


def samples_table(samples):
    return pa.table({
        "prompt_id": [s["prompt_id"] for s in samples],
        "input_ids": pa.array([s["input_ids"].tolist() for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s["loss_mask"].astype(np.int8).tolist() for s in samples], pa.list_(pa.int8())),
        "num_tokens": [len(s["input_ids"]) for s in samples],
    })


def hf_reference(ref, input_ids, layer_ids):
    with torch.no_grad():
        hs = ref(input_ids=torch.as_tensor(input_ids).long()[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
