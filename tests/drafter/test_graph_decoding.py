"""Speculative decoding over static caches (`graph_decoding`), run eagerly on CPU: the target's own greedy tokens
(stop tokens and the length budget included), the eager `SpeculativeDecoder`'s acceptance lengths, a drafter
that always agrees reaching the block size, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_assets.drafter.decoding import EvalPrompt, SpeculativeDecoder, greedy_generate, load_target
from dflash_assets.drafter.graph_decoding import GraphSpeculativeDecoder, GraphTargetDecoder, graph_decode_speed
from tests.drafter.test_decoding import untrained_drafter

B = 8
MAX_LEN = 48


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 248000, (length + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def dense(tiny_dense_target):
    torch.set_num_threads(1)
    return load_target(tiny_dense_target, "cpu")


@pytest.fixture(scope="module")
def decoders(dense, tiny_dense_target):
    drafter = untrained_drafter(tiny_dense_target, block_size=B, seed=0)
    return (GraphTargetDecoder(dense, MAX_LEN), GraphSpeculativeDecoder(dense, drafter, MAX_LEN),
            SpeculativeDecoder(dense, drafter))


def test_tokens_and_acceptance_equal_the_eager_decoders(dense, decoders):
    base, spec, eager = decoders
    assert not spec.core.graphs.enabled and not base.core.graphs.enabled  # CPU: the same steps, eagerly
    for p in _prompts(3, 9, seed=5):
        ref = greedy_generate(dense, p, 20)
        assert base.generate(p, 20) == ref
        out = spec.generate(p, 20)
        assert out.output_ids == ref
        assert out.acceptance_lengths == eager.generate(p, 20).acceptance_lengths
        assert sum(out.acceptance_lengths) == len(ref) - 1  # the prefill's token, then each verification's


def test_a_stop_token_cuts_a_round_short(dense, decoders):
    base, spec, eager = decoders
    # a round that accepted a draft token: stopping at its first token cuts it to one. An untrained drafter
    # agrees in about half of these prompts somewhere; which ones depends on the CPU's kernels, so look far enough
    for p in (q for seed in range(11, 19) for q in _prompts(4, 7, seed)):  # 32 prompts, 7-10 tokens: all fit
        free = eager.generate(p, 24)
        starts = [1 + sum(free.acceptance_lengths[:r]) for r in range(len(free.acceptance_lengths))]
        hits = [s for s, n in zip(starts, free.acceptance_lengths)
                if n >= 2 and free.output_ids[s] not in free.output_ids[:s]]
        if hits:
            break
    assert hits, "no prompt accepted a draft token"
    stop = [free.output_ids[hits[0]], 248046]
    ref = greedy_generate(dense, p, 24, stop)
    assert ref == free.output_ids[:hits[0] + 1]
    assert base.generate(p, 24, stop) == ref
    out = spec.generate(p, 24, stop)
    assert out.output_ids == ref and out.acceptance_lengths == eager.generate(p, 24, stop).acceptance_lengths
    assert out.acceptance_lengths[-1] == 1


def test_a_drafter_that_always_agrees_reaches_the_block_size(dense, tiny_dense_target):
    # a target whose final norm is zero has zero logits: its greedy token is always 0; a drafter whose final norm
    # is zero drafts 0 everywhere; every draft token is accepted, and the budget cuts the last round
    target = copy.deepcopy(dense)
    torch.nn.init.zeros_(target.model.norm.weight)
    drafter = untrained_drafter(tiny_dense_target, block_size=B, seed=1)
    torch.nn.init.zeros_(drafter.norm.weight)
    spec = GraphSpeculativeDecoder(target, drafter, MAX_LEN)
    p = _prompts(1, 6, seed=3)[0]
    out = spec.generate(p, 1 + 2 * B + 3)
    assert out.output_ids == greedy_generate(target, p, 1 + 2 * B + 3) == [0] * (1 + 2 * B + 3)
    assert out.acceptance_lengths == [B, B, 3]
    assert out.acceptance_lengths == SpeculativeDecoder(target, drafter).generate(p, 1 + 2 * B + 3).acceptance_lengths


def test_the_static_cache_refuses_what_does_not_fit(decoders):
    base, spec, _ = decoders
    p = list(range(1, 31))
    with pytest.raises(ValueError, match="do not fit the static cache of 48 positions"):
        spec.generate(p, MAX_LEN - len(p) + 1)
    with pytest.raises(ValueError, match="do not fit the static cache of 48 positions"):
        base.generate(p, MAX_LEN - len(p) + 1)
    assert len(spec.generate(p, MAX_LEN - len(p)).output_ids) == MAX_LEN - len(p)  # exactly full is fine
    with pytest.raises(ValueError, match="CUDA graphs need a target on a CUDA device"):
        GraphTargetDecoder(spec.core.target, MAX_LEN, graphs=True)


def test_targets_without_full_attention_everywhere_are_refused():
    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="needs full attention in every layer"):
        GraphTargetDecoder(Qwen3ForCausalLM(config).eval(), 32)


def test_graph_decode_speed_times_both_paths_on_the_same_prompts(dense, tiny_dense_target):
    ps = [EvalPrompt(tuple(p), "chat", f"p{i}") for i, p in enumerate(_prompts(2, 8, seed=2))]
    speed = graph_decode_speed(dense, untrained_drafter(tiny_dense_target, block_size=B), ps, max_new_tokens=8)
    assert speed["num_prompts"] == 2 and speed["outputs_equal"] == 2
    assert speed["graphs"] is False and speed["dtype"] == "float32" and speed["device"] == "cpu"
    assert speed["target_tokens"] == speed["speculative_tokens"] == 16
    assert speed["target_tokens_per_s"] > 0 and speed["speculative_tokens_per_s"] > 0
    assert 1.0 <= speed["tau"] <= B
