"""The one layer capture with the tiny dense target: `features()` and the zero-copy `.target` give HF's
`hidden_states[i + 1]` (the final norm's output for the last layer), the decoder is cut after the last captured
layer and restored on exit, and out-of-range layer ids are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_assets.target_model.layer_capture import LayerCapture, decoder_stack


@pytest.fixture(scope="module")
def model(tiny_dense_target):
    return AutoModelForCausalLM.from_pretrained(str(tiny_dense_target), dtype=torch.float32).eval()


def test_captured_layers_are_hf_hidden_states_and_the_decoder_is_restored(model):
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    n = model.config.num_hidden_layers
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True).hidden_states
    text, layers = decoder_stack(model)
    hooks_before = [len(m._forward_hooks) for m in [*layers, text.norm]]  # transformers' own, if any
    for layer_ids in ([1, 2], [0, n - 1]):
        with torch.no_grad(), LayerCapture(model, layer_ids) as cap:
            if max(layer_ids) < n - 1:
                assert len(text.layers) == max(layer_ids) + 1  # cut after the last captured layer
            text(input_ids=ids)
            got = cap.features()
        expected = torch.cat([reference[i + 1] for i in layer_ids], dim=-1)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert text.layers is layers and len(text.layers) == n and not isinstance(text.norm, torch.nn.Identity)
    assert [len(m._forward_hooks) for m in [*layers, text.norm]] == hooks_before  # ours removed


def test_the_zero_copy_target_is_filled_in_place(model):
    ids = torch.tensor([[5, 17, 99]])
    H = model.config.hidden_size
    with torch.no_grad(), LayerCapture(model, [1]) as cap:
        cap.target = torch.zeros(3, H)
        cap.text_model(input_ids=ids)
        filled = cap.target.clone()
    with torch.no_grad():
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
    torch.testing.assert_close(filled, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_ids", [[], [-1], [10_000]])
def test_layer_ids_out_of_range_are_refused(model, layer_ids):
    with pytest.raises(ValueError, match="out of range"):
        LayerCapture(model, layer_ids)
