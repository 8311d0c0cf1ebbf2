"""Hidden-state capture: captured states equal HF ``output_hidden_states``, the cut model restored, the GPU path's
imports (packing: test_packing.py; a partition through the store: test_stage.py; the format: test_format.py).

Runs the tiny dense and hybrid targets on CPU in float32, so "equal" means
equal to float32 rounding, and a leak across packed samples shows up as a
difference of order one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_assets.hidden_states import batching, packing
from dflash_assets.hidden_states import capture as hsc
from dflash_assets.hidden_states.format import FORMAT_NAME
from tests.hidden_states.support import BUDGET, LENGTHS, ROOT, hf_reference, make_samples, samples_table


# ---------------------------------------------------------------------------
# Correctness against Transformers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_captured_states_equal_hf_output_hidden_states(kind, targets):
    path, model, ref = targets[kind]
    n_layers = model.config.num_hidden_layers
    layer_ids = [0, 2, n_layers - 3, n_layers - 1]  # the last one: HF returns it after the final norm
    samples = make_samples()
    packed = packing.resolve_packing(model, "cpu")
    batches = batching.plan_batches(LENGTHS, BUDGET, packed=packed)
    assert packed == (kind == "dense")
    assert any(len(b.indices) > 1 for b in batches), "the test must share forwards between samples"

    got = hsc.capture_hidden_states(model, samples, layer_ids, tokens_per_batch=BUDGET)

    for s, g in zip(samples, got):
        expected = hf_reference(ref, s["input_ids"], layer_ids)
        assert g.shape == (len(s["input_ids"]), len(layer_ids) * 64) and g.dtype == torch.float32
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=2e-5)


def test_capture_cuts_the_model_and_restores_it(targets):
    _, model, _ = targets["dense"]
    text, layers = hsc.decoder_stack(model)
    original_layers, original_norm = text.layers, text.norm
    calls = {"layer1": 0, "layer2": 0, "norm": 0, "lm_head": 0}

    def counter(name):
        def hook(*_):
            calls[name] += 1
        return hook

    handles = [layers[1].register_forward_hook(counter("layer1")), layers[2].register_forward_hook(counter("layer2")),
               text.norm.register_forward_hook(counter("norm")), model.lm_head.register_forward_hook(counter("lm_head"))]
    try:
        model.config._attn_implementation = "sdpa"
        hsc.capture_hidden_states(model, make_samples([5, 6]), [1], tokens_per_batch=BUDGET)
        assert calls == {"layer1": 1, "layer2": 0, "norm": 0, "lm_head": 0}
        bad = [{"prompt_id": "x", "input_ids": np.array([10**9], np.int64), "loss_mask": [1]}]
        with pytest.raises(IndexError):  # token id past the embedding: the forward raises mid-capture
            hsc.capture_hidden_states(model, bad, [1])
    finally:
        for h in handles:
            h.remove()
    assert text.layers is original_layers and len(text.layers) == model.config.num_hidden_layers
    assert text.norm is original_norm
    assert all(not layer._forward_hooks for layer in layers) and not text.norm._forward_hooks
    assert model.config._attn_implementation == "sdpa"  # switched for the capture only
    model.config._attn_implementation = packing.ATTN_IMPLEMENTATION


# ---------------------------------------------------------------------------
# Samples and planning
# ---------------------------------------------------------------------------


def test_load_samples_from_sliced_arrow_table_and_lists():
    samples = make_samples()
    table = samples_table(samples).slice(2, 4)  # offsets into shared buffers
    got = batching.load_samples(table)
    assert [s.prompt_id for s in got] == ["p002", "p003", "p004", "p005"]
    for g, s in zip(got, samples[2:6]):
        assert g.input_ids.dtype == np.int32 and g.input_ids.tolist() == s["input_ids"].tolist()
        assert g.loss_mask.dtype == np.uint8 and g.loss_mask.tolist() == s["loss_mask"].tolist()
    assert [s.num_tokens for s in batching.load_samples(samples)] == LENGTHS
    with pytest.raises(ValueError, match="num_tokens"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [1, 2], "loss_mask": [0, 1], "num_tokens": 3}])
    with pytest.raises(ValueError, match="no tokens"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [], "loss_mask": []}])
    with pytest.raises(ValueError, match="loss_mask"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [1, 2], "loss_mask": [1]}])


@pytest.mark.parametrize("lengths,budget", [(LENGTHS, 64), (LENGTHS, 30), ([100, 3, 3, 100, 7], 50), ([5] * 9, 10)])
@pytest.mark.parametrize("packed", [True, False])
def test_plan_batches(lengths, budget, packed):
    batches = batching.plan_batches(lengths, budget, packed=packed)
    flat = [i for b in batches for i in b.indices]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert b.lengths == tuple(lengths[i] for i in b.indices) and b.packed == packed
        assert b.num_tokens <= budget or len(b.indices) == 1
        if packed:
            assert list(b.indices) == list(range(b.indices[0], b.indices[-1] + 1))  # contiguous in the shard
        else:
            assert len(set(b.lengths)) == 1
    if packed:
        assert flat == list(range(len(lengths)))
        # greedy: no two neighbouring batches could have been merged
        assert all(a.num_tokens + b.lengths[0] > budget for a, b in zip(batches, batches[1:]))


def test_plan_parts_splits_by_bytes():
    assert batching.plan_parts([10, 10, 10, 10], 1, 25) == [(0, 2), (2, 4)]
    assert batching.plan_parts([50, 1], 1, 25) == [(0, 1), (1, 2)]  # an oversized sample gets its own part
    assert batching.plan_parts([1, 2, 3], 8, 1 << 30) == [(0, 3)]


# ---------------------------------------------------------------------------
# Import hygiene and the benchmark
# ---------------------------------------------------------------------------


def test_gpu_path_imports_with_only_torch_transformers_safetensors_numpy():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pyarrow', 'polars', 'dagster', 'pydantic', 'boto3', 'tiktoken'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dflash_assets.hidden_states.capture as h, dflash_assets.hidden_states.format as f\n"
        "import dflash_assets.hidden_states.stage, dflash_assets.drafter.training\n"
        "print(h.ATTN_IMPLEMENTATION, f.FORMAT_NAME)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["packed_causal", FORMAT_NAME]


@pytest.mark.slow
def test_benchmark_quick_runs_every_section(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/hidden_state_capture.py", "--quick", "--iters", "1",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("peak", "a_naive", "b_hooks_cut", "c_end_to_end", "e_two_gpus", "d_hybrid"):
        assert "error" not in res[name], res[name]
    b = res["b_hooks_cut"]
    assert b["packed_varlen_vs_naive"]["max_abs"] < 1e-4 and b["stacked_sdpa_vs_naive"]["max_abs"] < 1e-4
    assert res["c_end_to_end"]["tokens"] > 0 and res["d_hybrid"]["stacked"]["tok_per_s"] > 0
