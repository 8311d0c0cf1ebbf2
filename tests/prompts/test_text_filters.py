"""The text filters of self-generated prompts: each reason on a text made to fail it, requests that pass them all."""

from __future__ import annotations

import pytest

from dflash_assets.drafter.decontamination import normalize_text
from dflash_assets.prompts.text_filters import (
    TEXT_FILTER_REASONS,
    TextFilterConfig,
    language_problem,
    normalized_text,
    repetition_loop,
    text_filter_reason,
    text_hash,
)

REQUESTS = [
    "Can you help me plan a three-day trip to Lisbon on a small budget?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the difference between a virus and a bacterium?",
    "I'm feeling anxious about returning to work after a long break. How could I manage it?",
]


@pytest.mark.parametrize("text", REQUESTS)
def test_requests_pass_every_filter(text):
    assert text_filter_reason(text) is None


@pytest.mark.parametrize(("text", "reason"), [
    ("", "too_short"),
    ("Hi there", "too_short"),
    ("word " * 2000, "too_long"),
    ("1234 5678 9012 3456 7890 !!!", "no_words"),
    ("Tell me a story. " + "and then and then " * 8, "repetition_loop"),
    ("Please help me with this!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!", "repetition_loop"),
    ("Wie kann ich meinen Garten im Winter vor Frost schützen, ohne teure Geräte zu kaufen?", "wrong_language"),
    ("Как мне подготовиться к собеседованию на должность программиста?", "wrong_language"),
    ("foo_bar baz_qux lorem ipsum dolor sit amet consectetur adipiscing elit", "wrong_language"),
])
def test_each_reason_on_a_text_made_to_fail_it(text, reason):
    got = text_filter_reason(text)
    assert got is not None and got[0] == reason, got
    assert reason in TEXT_FILTER_REASONS


def test_language_is_the_requested_one_or_none():
    russian = "Как мне подготовиться к собеседованию на должность программиста?"
    assert text_filter_reason(russian, TextFilterConfig(language="ru")) is None
    assert text_filter_reason(russian, TextFilterConfig(language=None)) is None
    assert language_problem(REQUESTS[0], "ru") is not None
    with pytest.raises(ValueError, match="not supported"):
        TextFilterConfig(language="xx")


def test_a_loop_of_words_is_found_by_its_few_distinct_trigrams():
    text = " ".join(["the cat sat on the mat"] * 6)
    assert "3-grams" in repetition_loop(text, max_repeats=50)
    assert repetition_loop(REQUESTS[3]) is None


@pytest.mark.parametrize("text", REQUESTS + ["Ünïcödé — TEXT_with_underscores", "  spaced\tout\n"])
def test_normalization_is_the_decontamination_rule(text):
    assert normalized_text(text) == normalize_text(text)


def test_the_exact_key_ignores_case_and_punctuation_only():
    assert text_hash("What is AI?") == text_hash("what is ai")
    assert text_hash("What is AI?") != text_hash("What is ML?")
