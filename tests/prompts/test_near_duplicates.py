"""MinHash near duplicates: an edited copy is found, an unrelated text is not; the estimate tracks the Jaccard."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_assets.drafter.decontamination import word_ngrams, normalize_text
from dflash_assets.prompts.near_duplicates import (
    MinHashIndex,
    estimated_jaccard,
    jaccard,
    minhash,
    shingles,
)

WORDS = ("apple river stone cloud market engine garden window silver planet music yellow quiet forest bridge "
         "number teacher ocean letter winter doctor summer castle pencil rocket").split()


def _text(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(n))


def _edit(rng: random.Random, text: str, edits: int) -> str:
    words = text.split()
    for _ in range(edits):
        words[rng.randrange(len(words))] = "edited"
    return " ".join(words)


@pytest.mark.parametrize("seed", range(8))
def test_an_edited_copy_is_found_and_an_unrelated_text_is_not(seed):
    rng = random.Random(seed)
    base, other = _text(rng), _text(rng)
    index = MinHashIndex(threshold=0.7)
    index.add("base", minhash(base))
    copy = _edit(rng, base, 1)  # one word of 60 changed: Jaccard ~0.9
    assert jaccard(shingles(base), shingles(copy)) >= 0.8
    found = index.query(minhash(copy))
    assert found is not None and found.key == "base"
    assert index.query(minhash(other)) is None


@pytest.mark.parametrize("seed", range(5))
def test_the_estimate_is_close_to_the_exact_jaccard(seed):
    rng = random.Random(100 + seed)
    a = _text(rng)
    b = _edit(rng, a, rng.randrange(1, 12))
    exact = jaccard(shingles(a), shingles(b))
    assert abs(estimated_jaccard(minhash(a), minhash(b)) - exact) < 0.15


def test_shingles_are_the_decontamination_grams():
    text = "Can you help me write a cover letter for a job in data science?"
    assert shingles(text) == word_ngrams(normalize_text(text))
    assert shingles("Hi there") == frozenset(["hi there"])
    assert shingles("!!!") == frozenset()


def test_the_most_similar_match_wins_and_the_index_checks_its_input():
    rng = random.Random(7)
    base = _text(rng)
    index = MinHashIndex(threshold=0.5)
    index.add("far", minhash(_edit(rng, base, 6)))
    index.add("near", minhash(_edit(rng, base, 1)))
    assert index.query(minhash(base)).key == "near"
    assert len(index) == 2
    with pytest.raises(ValueError, match="shape"):
        index.add("bad", np.zeros(5, dtype=np.uint32))
    with pytest.raises(ValueError, match="divide"):
        MinHashIndex(bands=7)


def test_signatures_are_deterministic():
    assert np.array_equal(minhash("the same text, twice over here"), minhash("The same text twice over here!"))
