"""The tiktoken-backed encoder equals the Hugging Face Qwen3.6 tokenizer, or falls back to it."""

from __future__ import annotations

import logging
import random
import unicodedata

import numpy as np
import pytest

from dflash_assets.tokenization.encoder import (
    BACKEND_HF,
    BACKEND_TIKTOKEN,
    GPT2_PAT_STR,
    ParityError,
    TiktokenParts,
    build_encoder,
    derive_tiktoken_parts,
    qwen3_6_encoder,
)
from dflash_assets.prompts.sources import sharegpt_records


@pytest.fixture(scope="module")
def tok():
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

    return build_qwen3_6_tokenizer()


@pytest.fixture(scope="module")
def enc(tok):
    return qwen3_6_encoder(tok, strict=True)


@pytest.fixture(scope="module")
def sharegpt_texts():
    """~600 real messages: ShareGPT turns, a few wrapped in ChatML specials."""
    texts = [m["value"] for r in sharegpt_records(150) for m in r["conversations"] if m["value"]]
    wrapped = [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" for t in texts[:50]]
    return texts + wrapped


def hf_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_qwen_encoder_uses_tiktoken_after_parity(enc):
    assert enc.backend == BACKEND_TIKTOKEN
    assert enc.parity is not None and enc.parity.ok
    assert enc.parity.num_texts >= 10 and enc.parity.num_boundaries > 10
    meta = enc.describe()
    assert meta["encoder_backend"] == "tiktoken" and meta["parity_mismatched"] == 0


def test_parts_derived_from_tokenizer_json_equal_qwen_parts(tok):
    derived = build_encoder(tok, strict=True)  # no parts given: derived from tokenizer.json, then verified
    assert derived.backend == BACKEND_TIKTOKEN and derived.parity.ok
    parts, ref = derived.tiktoken_parts, TiktokenParts.qwen3_6()
    assert parts.normalization == "NFC"
    assert parts.pat_str == ref.pat_str
    assert parts.special_tokens == ref.special_tokens
    assert parts.mergeable_ranks == ref.mergeable_ranks


def test_ids_equal_hf_on_real_sharegpt_messages(tok, enc, sharegpt_texts):
    batch = enc.encode_batch(sharegpt_texts)
    ref = tok(sharegpt_texts, add_special_tokens=False)["input_ids"]
    mismatched = [i for i, r in enumerate(ref) if batch.text_ids(i).tolist() != r]
    assert len(sharegpt_texts) > 500
    assert mismatched == []
    assert batch.ids.dtype == np.int32 and batch.offsets[-1] == len(batch.ids)


def test_special_tokens_are_atomic_and_nfc_applied(tok, enc):
    text = "<|im_start|>user\nCafe\u0301<|im_end|>\n<|MASK|><think>x</think>"
    ids = enc.encode(text)
    assert ids == hf_ids(tok, text)
    assert ids[0] == 248045 and 248046 in ids and 248077 in ids and 248068 in ids and 248069 in ids
    assert enc.encode("Cafe\u0301") == enc.encode("Caf\u00e9")  # NFC composes e + combining acute
    assert enc.decode(ids) == unicodedata.normalize("NFC", text)


def test_boundaries_follow_the_prefix_encoding_rule(tok, enc, sharegpt_texts):
    rng = random.Random(0)
    texts = sharegpt_texts[-50:] + ["a\u0301b\u0301 c", "\n\n\n   x", "<think>\n\n</think>\n\nOK.<|im_end|>\n"]
    bounds = [sorted({0, len(t), *(rng.randrange(len(t) + 1) for _ in range(6))}) for t in texts]
    bounds[-3] += [1, 2]  # inside a combining sequence
    bounds[-1] = [0, 1, 7, 8, 9, 10, 13, len(texts[-1])]  # inside "<think>" and around "\n\n"
    batch = enc.encode_batch(texts, bounds)
    want = [len(hf_ids(tok, t[:c])) for t, b in zip(texts, bounds) for c in b]
    assert batch.boundaries.tolist() == want


def test_parity_mismatch_falls_back_to_hf(tok, caplog):
    ref = TiktokenParts.qwen3_6()
    wrong = TiktokenParts(ref.mergeable_ranks, GPT2_PAT_STR, ref.special_tokens, "NFC")  # digits split differently
    with caplog.at_level(logging.WARNING, logger="dflash_assets.tokenization.encoder"):
        fallback = build_encoder(tok, parts=wrong)
    assert fallback.backend == BACKEND_HF
    assert fallback.parity.num_mismatched > 0 and not fallback.parity.ok
    assert fallback.fallback_reason.startswith("parity")
    assert any("falling back" in r.message for r in caplog.records)
    text = "pi is 3.14159265358979 and 2**64 = 18446744073709551616"
    assert fallback.encode(text) == hf_ids(tok, text)
    with pytest.raises(ParityError):
        build_encoder(tok, parts=wrong, strict=True)


def test_missing_normalization_is_caught_by_parity(tok):
    ref = TiktokenParts.qwen3_6()
    no_nfc = TiktokenParts(ref.mergeable_ranks, ref.pat_str, ref.special_tokens, None)
    encoder = build_encoder(tok, parts=no_nfc)
    assert encoder.backend == BACKEND_HF


def test_special_token_table_mismatch_is_caught(tok):
    no_mask = TiktokenParts.qwen3_6(include_mask=False)  # the HF tokenizer has <|MASK|>
    encoder = build_encoder(tok, parts=no_mask)
    assert encoder.backend == BACKEND_HF
    assert "special tokens differ" in encoder.parity.first_mismatch


def test_non_byte_level_tokenizer_uses_hf_backend():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<sep>": 3, "!": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    parts, why = derive_tiktoken_parts(tok)
    assert parts is None and "BPE" in why
    encoder = build_encoder(tok)
    assert encoder.backend == BACKEND_HF and "BPE" in encoder.fallback_reason
    text = "hello world<sep>hello !"
    batch = encoder.encode_batch([text], [[0, 5, 11, 16, len(text)]])
    assert batch.text_ids(0).tolist() == [1, 2, 3, 1, 4]
    assert batch.boundaries.tolist() == [len(tok(text[:c], add_special_tokens=False)["input_ids"]) for c in [0, 5, 11, 16, len(text)]]


def test_unverified_encoder_without_tokenizer_still_encodes_like_hf(tok):
    bare = qwen3_6_encoder(verify=False)
    assert bare.backend == BACKEND_TIKTOKEN and bare.parity is None and bare.tokenizer is None
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\nDone.<|im_end|>\n"
    assert bare.encode(text) == hf_ids(tok, text)
