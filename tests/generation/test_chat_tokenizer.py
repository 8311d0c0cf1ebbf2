"""The chat tokenizer adapter: the generation prompt rendered, the output split into reasoning and answer on ids
as the text split does (one reasoning splitter, the target package's)."""

from __future__ import annotations

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer, strip_stop_text
from dflash_assets.generation.engines import split_reasoning_text
from tests.generation.engines.support import THINK_END, IM_END, MESSAGES
from tests.support.sglang_loopback import QWEN3_6_IDS


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


# -- pure functions ------------------------------------------------------------


@pytest.mark.parametrize("text,thinking,expected", [
    ("step one\n</think>\n\nFour.", True, ("step one", "Four.")),
    ("<think>\nstep\n</think>\n\nFour.", True, ("step", "Four.")),
    ("still thinking, cut off", True, ("still thinking, cut off", "")),
    ("Four.", False, ("", "Four.")),
    ("\n</think>\n\nFour.", True, ("", "Four.")),
    ("", True, ("", "")),
])
def test_split_reasoning_text(text, thinking, expected):
    assert split_reasoning_text(text, thinking) == expected


def test_chat_tokenizer_renders_generation_prompt_and_splits_ids(tok):
    ct = ChatTokenizer(tok)
    ids = ct.prompt_ids(MESSAGES, enable_thinking=True)
    assert ids[-2:] == [QWEN3_6_IDS["think_start"], tok.encode("\n", add_special_tokens=False)[0]]
    no_think = ct.prompt_ids(MESSAGES, enable_thinking=False)
    assert tok.decode(no_think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ct.think_end_id == THINK_END and IM_END in ct.stop_ids

    r = tok.encode("Let me add.\n", add_special_tokens=False)
    c = tok.encode("\n\nFour.", add_special_tokens=False)
    assert ct.split_output_ids(r + [THINK_END] + c + [IM_END], True) == ("Let me add.", "Four.")
    assert ct.split_output_ids(r, True) == ("Let me add.", "")  # cut inside the think block
    assert ct.split_output_ids(c + [IM_END], False) == ("", "Four.")


@pytest.mark.parametrize("output,thinking", [
    ("Let me add 2 and 2.\n</think>\n\nFour.<|im_end|>", True),  # thinking present
    ("<think>\nLet me add.\n</think>\n\nFour.<|im_end|>", True),  # the model repeats the opener
    ("<think>\n\n</think>\n\nFour.<|im_end|>", True),  # an empty think block
    ("<think>\n\n</think>\n\nFour.<|im_end|>", False),
    ("Four.<|im_end|>", False),  # no think tags
    ("Four.<|im_end|>", True),  # no think tags, thinking on: all reasoning
    ("Let me think about 2 and", True),  # cut by max_new_tokens inside the think block
    ("Let me think about 2 and", False),
    ("Call it.\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>", True),
])
def test_chat_tokenizer_id_split_matches_the_text_split(tok, output, thinking):
    """`ChatTokenizer.split_output_ids` (on ids, SGLang's native and the in-process paths) and
    `target_model.chat_template.split_reasoning_text` (on text, the OpenAI path) split one output alike."""
    ids = tok.encode(output, add_special_tokens=False)
    assert (THINK_END in ids) == ("</think>" in output)  # the real tokenizer: `</think>` is one id
    text = strip_stop_text(tok.decode(ids, skip_special_tokens=False))
    assert ChatTokenizer(tok).split_output_ids(ids, thinking) == split_reasoning_text(text, thinking)
