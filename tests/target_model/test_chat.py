"""The target's one chat object (`target_model.chat.TargetChat`, made by `TargetModelSpec.chat()`).

Its render is the tokenizer's `apply_chat_template` (tiny Qwen3.6 target and SmolLM2), its stop ids follow the
one rule (a thinking target and a plain one), and the spec's chat-template override reaches every consumer that
takes it: the engines, the completions stage, tokenization, the held-out evaluation prompts; the capture's
tokenizer hash is the one `AutoTokenizer` gives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.target_model.chat import TargetChat, encode_text, encode_texts, stop_token_ids
from dflash_assets.target_model.spec import TargetModelSpec

MARK = "OVERRIDDEN-TEMPLATE-MARK"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
     {"role": "user", "content": "tell me more about caf\u00e9s"}],
]


@pytest.fixture(scope="module")
def smollm2_dir():
    from dflash_assets.embedded.smollm2 import SmolLM2Unavailable, smollm2_target_path

    try:
        return smollm2_target_path()
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


@pytest.fixture(params=["tiny", "smollm2"])
def target_dir(request, tiny_dense_target):
    return tiny_dense_target if request.param == "tiny" else request.getfixturevalue("smollm2_dir")


def _override_spec(tmp_path: Path, target: Path) -> TargetModelSpec:
    """A spec of `target` whose chat-template override is the target's own template with a marker line first."""
    base = TargetModelSpec(model_path=str(target))
    path = tmp_path / "override.jinja"
    path.write_text(MARK + "\n" + base.load_tokenizer().chat_template, "utf-8")
    return base.model_copy(update={"chat_template_path": str(path)})


def test_render_and_ids_equal_the_tokenizers_apply_chat_template(target_dir):
    spec = TargetModelSpec(model_path=str(target_dir))
    chat = spec.chat()
    tok = chat.tokenizer
    assert chat is spec.chat() and tok is spec.load_tokenizer()  # made once, with the spec's own tokenizer
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                               **spec.chat_template_kwargs)
            assert chat.render(messages, add_generation_prompt=prompt) == expected
            assert spec.render_chat(tok, messages, add_generation_prompt=prompt) == expected
        for thinking in (True, False):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=thinking)
            assert chat.prompt(messages, enable_thinking=thinking) == text
            assert chat.prompt_ids(messages, thinking) == tok(text, add_special_tokens=False)["input_ids"]
            assert ChatTokenizer(chat).prompt_ids(messages, thinking) == ChatTokenizer(tok).prompt_ids(messages,
                                                                                                     thinking)
    assert chat.conventions == spec.chat_conventions(tok)  # read off the same template with the same kwargs


def test_encode_texts_gives_each_texts_own_ids(tiny_dense_target):
    """One batch call (the Rust backend's) or text by text (a tokenizer without one): each text's `encode_text`."""
    tok = TargetModelSpec(model_path=str(tiny_dense_target)).load_tokenizer()
    texts = ["Hello there", "", "写一首关于秋天的短诗。", "<|im_start|>user\nHi<|im_end|>\n", "x = 1\n" * 300]

    class PythonOnly:  # an HF-style tokenizer without a Rust backend
        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    expected = [encode_text(tok, t) for t in texts]
    assert encode_texts(tok, texts) == expected == encode_texts(PythonOnly(), texts)
    assert expected[3] == [tok.convert_tokens_to_ids("<|im_start|>"), *expected[3][1:]] and len(expected[4]) > 300


def test_template_kwargs_of_the_spec_reach_the_renderer(tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target))
    plain = spec.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
    messages = CONVERSATIONS[0]
    assert plain.chat() is not spec.chat() and plain.chat().tokenizer is spec.chat().tokenizer
    assert spec.chat().thinking and not plain.chat().thinking
    assert plain.chat().prompt(messages) != spec.chat().prompt(messages)
    assert plain.chat().prompt(messages, enable_thinking=True) == spec.chat().prompt(messages)  # a call overrides


def test_stop_ids_of_a_thinking_target_and_a_plain_one(tiny_dense_target, smollm2_dir):
    """One rule: <|im_end|>, <|endoftext|> and eos, those the tokenizer has (SmolLM2's <|endoftext|> is its unk
    id 0, so not a stop); engines, evaluation and the demo all take the chat object's set."""
    qwen = TargetModelSpec(model_path=str(tiny_dense_target)).chat()
    smol = TargetModelSpec(model_path=str(smollm2_dir)).chat()
    assert qwen.thinking and not smol.thinking
    assert qwen.stop_ids == {248046, 248044}  # <|im_end|> (eos), <|endoftext|>: the model's generation_config
    assert smol.stop_ids == {2}  # <|im_end|> = eos
    for chat in (qwen, smol):
        assert ChatTokenizer(chat).stop_ids == ChatTokenizer(chat.tokenizer).stop_ids == stop_token_ids(
            chat.tokenizer) == chat.stop_ids


def test_the_template_override_reaches_every_consumer(tmp_path, tiny_dense_target):
    """A spec with another template renders differently through the engines, the completions stage's tokenizer,
    tokenization and the held-out evaluation prompts; the default spec does not carry the marker anywhere."""
    import asyncio

    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import heldout_prompts
    from dflash_assets.generation.completions import _resolve_tokenizer
    from dflash_assets.generation.engines import SGLangEngine, TransformersEngine
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.tokenization.samples import COMPLETIONS_MESSAGES_TYPE, TokenizeConfig, tokenize_completions
    from dflash_assets.tokenization.stage import target_encoder

    plain = TargetModelSpec(model_path=str(tiny_dense_target))
    over = _override_spec(tmp_path, tiny_dense_target)
    messages = CONVERSATIONS[1]
    assert over.chat().tokenizer is not plain.chat().tokenizer
    assert over.chat().render(messages).startswith(MARK) and MARK not in plain.chat().render(messages)

    def decoded(chat_or_tok, ids) -> str:
        tok = chat_or_tok.tokenizer if isinstance(chat_or_tok, TargetChat) else chat_or_tok
        return tok.decode(list(ids))

    # engines: SGLang's native client and the in-process engine render prompt ids through the chat object
    for spec, marked in ((over, True), (plain, False)):
        chat = spec.chat()
        ids = SGLangEngine("http://127.0.0.1:1", chat).tok.prompt_ids(messages, True)
        assert (MARK in decoded(chat, ids)) is marked
        engine = TransformersEngine(tiny_dense_target, tokenizer=chat)
        asyncio.run(engine.open())
        assert engine.tok.chat is chat and (MARK in engine.tok.render(messages, True)) is marked
    bare = TransformersEngine(tiny_dense_target)  # no chat object: the directory's own, through the target package
    asyncio.run(bare.open())
    assert bare.tok.chat is plain.model_copy(update={"allow_download": True}).chat()
    assert bare.tok.render(messages, True) == plain.chat().prompt(messages, True)

    # the completions stage hands the chat object on; without one it takes the target directory's
    fleet = EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[EndpointConfig(url="http://x:1")])
    assert _resolve_tokenizer(over.chat(), fleet) is over.chat()
    assert isinstance(_resolve_tokenizer(None, fleet), TargetChat)

    # tokenization: the stage's renderer and tokenize_completions given the chat object
    table = pa.table({"prompt_id": pa.array(["p0"], pa.string()), "messages": pa.array(
        [[{"role": "user", "content": "hi"},
          {"role": "assistant", "content": "Hello there, friend.", "reasoning_content": "be kind"}]],
        COMPLETIONS_MESSAGES_TYPE)})
    for spec, marked in ((over, True), (plain, False)):
        encoder, renderer = target_encoder(spec)
        assert renderer is spec.chat().renderer and (MARK in renderer(messages)) is marked
        conventions = spec.chat().conventions
        config = TokenizeConfig(max_length=1024, assistant_header=conventions.assistant_header,
                                end_of_turn=conventions.end_of_turn)
        samples, _ = tokenize_completions(table, encoder, config, template=spec.chat())
        row = samples.to_pylist()[0]
        assert (MARK in encoder.decode(np.array(row["input_ids"]))) is marked

    # evaluation: the held-out prompts are rendered and encoded by the chat object
    store = LocalStore(tmp_path / "store")
    for shard, pid, system, turn in (("shard-00000", "a", None, "write a poem"),
                                     ("shard-00001", "b", "You are terse.", "Name a prime.")):
        store.write_parquet(layout.raw_prompts(shard), pa.Table.from_pylist(
            [{"prompt_id": pid, "system": system, "user_turns": [turn], "category": None}]))
    recipe = DrafterRecipe(name="r", partitions=("shard-00000",), online=True)
    for spec, marked in ((over, True), (plain, False)):
        (prompt,), _ = heldout_prompts(store, recipe, spec, 4)
        assert list(prompt.input_ids) == spec.chat().prompt_ids(messages)[-1024:]
        assert (MARK in decoded(spec.chat(), prompt.input_ids)) is marked


def test_capture_tokenizer_hash_is_the_chat_objects_and_autotokenizers(tiny_dense_target):
    from transformers import AutoTokenizer

    from dflash_assets.hidden_states.capture import _tokenizer_hash
    from dflash_assets.target_model.tokenizer import tokenizer_hash

    chat = TargetModelSpec(model_path=str(tiny_dense_target)).chat()
    assert _tokenizer_hash(str(tiny_dense_target)) == chat.tokenizer_hash == tokenizer_hash(
        AutoTokenizer.from_pretrained(str(tiny_dense_target)))
