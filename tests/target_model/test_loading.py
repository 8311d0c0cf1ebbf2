"""Model loads are serialized: Transformers' from_pretrained swaps a class attribute while it runs.

Eight bare concurrent from_pretrained calls left `tie_weights` a no-op in 20 of 20 rounds (transformers 5.24);
that is how a fresh-clone CI run loaded SmolLM2 with its lm_head on the meta device."""

import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import PreTrainedModel

from dflash_assets.target_model.loading import ModelLoadError, load_causal_lm


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A tiny Llama whose lm_head is its embedding: the checkpoint holds only the embedding."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tied")
    LlamaForCausalLM(config).save_pretrained(d)
    assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))
    return d


def _load_on_threads(load, path, n=8):
    barrier = threading.Barrier(n)
    errors = []

    def run():
        barrier.wait()
        try:
            load(path)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_loads_leave_weight_tying_working(tied_model_dir):
    original = PreTrainedModel.tie_weights
    assert _load_on_threads(load_causal_lm, tied_model_dir) == []
    assert PreTrainedModel.tie_weights is original
    model = load_causal_lm(tied_model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_tied_head_left_unset_is_a_clear_error(tied_model_dir, monkeypatch):
    """What a clobbered tie_weights (a load outside the lock, on another thread) leaves behind is named."""
    monkeypatch.setattr(PreTrainedModel, "tie_weights", lambda *a, **k: None)
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight.*another thread"):
        load_causal_lm(tied_model_dir)
