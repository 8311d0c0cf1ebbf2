"""User turns written by the target: the template cut after the user header, and sampling from it, on SmolLM2
(the demo's target, a ChatML template with a default system prompt) and the tiny Qwen3.6-style target."""

from __future__ import annotations

import pytest

from dflash_assets.generation.self_prompts import (
    MARKER,
    SelfPromptSampling,
    UserTurnSampler,
    user_header_prefix,
)
from dflash_assets.target_model.spec import TargetModelSpec

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def smollm2_spec():
    from dflash_assets.embedded.smollm2 import SmolLM2Unavailable, smollm2_target_path

    try:
        return TargetModelSpec(model_path=str(smollm2_target_path()), dtype="float32")
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


def test_the_cut_ends_with_the_user_header(smollm2_spec, tiny_dense_target):
    smol = smollm2_spec.chat()
    assert user_header_prefix(smol, []) == SMOL_SYSTEM + "<|im_start|>user\n"  # the template's default system
    assert user_header_prefix(smol, [], "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    assert user_header_prefix(smol, history).endswith(
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n")
    tiny = TargetModelSpec(model_path=str(tiny_dense_target)).chat()
    assert user_header_prefix(tiny, []) == "<|im_start|>user\n"
    assert MARKER not in user_header_prefix(tiny, history)


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="turns"):
        SelfPromptSampling(turns=0)
    with pytest.raises(ValueError, match="temperature"):
        SelfPromptSampling(temperature=0.0)


def test_smollm2_writes_requests_that_end_their_turn_and_answers_between_turns(smollm2_spec):
    model = smollm2_spec.load_model("cpu", "float32")
    sampler = UserTurnSampler(model, smollm2_spec.chat(), SelfPromptSampling(max_new_tokens=48, turns=2,
                                                                             answer_max_new_tokens=48))
    convs = sampler.sample(list(range(16)), seed=0)
    assert [c.index for c in convs] == list(range(16))
    ended = [c for c in convs if c.ended]
    assert len(ended) >= 8  # SmolLM2 ends ~86% of its user turns after its default system prompt
    for c in convs:
        assert len(c.answers) == max(len(c.user_turns) - 1, 0)
        assert all(t and "<|im_end|>" not in t and "<|im_start|>" not in t for t in c.user_turns)
        assert 0 < c.new_tokens
    assert any(len(c.user_turns) == 2 for c in convs)  # the target answered, then wrote the next user turn
    assert all(len(c.user_turns) == 1 for c in convs if not c.ended)
    short = UserTurnSampler(model, smollm2_spec.chat(), SelfPromptSampling(max_new_tokens=16))
    again = short.sample(list(range(4)), seed=0)  # same batch, same seed: same draws
    assert [c.user_turns for c in again] == [c.user_turns for c in short.sample(list(range(4)), seed=0)]
    assert sampler.seconds > 0
