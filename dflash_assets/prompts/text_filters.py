"""Text filters for prompts a model wrote: each says why a user turn is not kept, or nothing.

:func:`text_filter_reason` applies, in order: too short, too long, no words, a repetition loop, not the
requested language; it returns the first reason that applies (a code of :data:`TEXT_FILTER_REASONS`) with a
detail, or None. :func:`normalized_text` and :func:`text_hash` are the exact-duplicate key (the rule of the
drafter's decontamination: NFKC, case-folded, every run of non-alphanumerics one space). Pure functions over
strings; reads and writes nothing.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

__all__ = ["TEXT_FILTER_REASONS", "TextFilterConfig", "normalized_text", "text_hash", "text_filter_reason",
           "repetition_loop", "language_problem", "SUPPORTED_LANGUAGES"]

TEXT_FILTER_REASONS = {
    "too_short": "fewer than min_words words or min_chars characters",
    "too_long": "more than max_chars characters",
    "no_words": "no word of two letters or more",
    "repetition_loop": "a span repeated back to back (max_repeats times or more), or too few distinct word "
                       "3-grams (under min_distinct_trigrams of a text of 20 words or more)",
    "wrong_language": "letters mostly outside the requested language's script, or (English) too few of its "
                      "common words",
}

_SEPARATORS = re.compile(r"[\s\W_]+", re.UNICODE)
_WORD = re.compile(r"[^\W\d_]{2,}", re.UNICODE)


def normalized_text(text: str) -> str:
    """NFKC, case-folded, every run of whitespace, punctuation or underscores one space, trimmed."""
    folded = unicodedata.normalize("NFKC", text or "").casefold()
    return _SEPARATORS.sub(" ", folded).strip()


def text_hash(text: str) -> str:
    """16 hex chars of the sha256 of :func:`normalized_text`: the exact-duplicate key."""
    return hashlib.sha256(normalized_text(text).encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class TextFilterConfig:
    min_words: int = 3
    min_chars: int = 10
    max_chars: int = 8000
    max_repeats: int = 4  # a span of >= 4 chars seen this many times back to back is a loop
    min_distinct_trigrams: float = 0.5  # distinct word 3-grams / all, for texts of >= 20 words
    language: str | None = "en"  # None: any language
    min_script_share: float = 0.8  # letters in the language's script / all letters
    min_common_word_share: float = 0.08  # English: words of the common-word list / all words (texts of >= 6 words)

    def __post_init__(self) -> None:
        if self.min_words < 0 or self.min_chars < 0 or self.max_chars < 1:
            raise ValueError("min_words and min_chars must be >= 0, max_chars >= 1")
        if self.max_repeats < 2:
            raise ValueError("max_repeats must be >= 2")
        if self.language is not None and self.language not in SUPPORTED_LANGUAGES:
            raise ValueError(f"language {self.language!r} is not supported: one of {sorted(SUPPORTED_LANGUAGES)}")


# Unicode script of each supported language, by the letters' character names.
SUPPORTED_LANGUAGES = {
    "en": "LATIN", "fr": "LATIN", "de": "LATIN", "es": "LATIN", "it": "LATIN", "pt": "LATIN", "nl": "LATIN",
    "ru": "CYRILLIC", "uk": "CYRILLIC", "el": "GREEK", "ar": "ARABIC", "he": "HEBREW", "hi": "DEVANAGARI",
    "zh": "CJK", "ja": "CJK", "ko": "HANGUL",
}
_JAPANESE_KANA = ("HIRAGANA", "KATAKANA")
_ENGLISH_COMMON = frozenset(
    "a an the and or but if of to in on at by for with from about as into over after before under between "
    "is are was were be been being am do does did have has had can could will would should may might must "
    "i you he she it we they me him her us them my your his its our their this that these those what which "
    "who whom whose when where why how not no yes all any some more most other such than then there here "
    "so very just also only please help need want like know make write give tell explain create use get "
    "one two new good best".split())


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    if name.startswith("CJK") or name.startswith(_JAPANESE_KANA):
        return "CJK"
    return name.split(" ", 1)[0]


def language_problem(text: str, language: str, *, min_script_share: float = 0.8,
                     min_common_word_share: float = 0.08) -> str | None:
    """Why ``text`` does not read as ``language`` (a detail), or None. Script share of its letters; for English,
    also the share of common English words (a run of identifiers or another Latin-script language falls short)."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return None  # no_words decides
    want = SUPPORTED_LANGUAGES[language]
    share = sum(_script(ch) == want for ch in letters) / len(letters)
    if share < min_script_share:
        return f"{share:.0%} of letters in the {want} script (< {min_script_share:.0%})"
    if language == "en":
        words = [w.casefold() for w in _WORD.findall(text)]
        if len(words) >= 6:
            common = sum(w in _ENGLISH_COMMON for w in words) / len(words)
            if common < min_common_word_share:
                return f"{common:.0%} common English words (< {min_common_word_share:.0%})"
    return None


_LOOP = re.compile(r"(.{4,}?)\1+", re.DOTALL)


def repetition_loop(text: str, *, max_repeats: int = 4, min_distinct_trigrams: float = 0.5) -> str | None:
    """A detail when ``text`` loops: a span of >= 4 characters (or a single character) repeated ``max_repeats``
    times back to back, or few distinct word 3-grams in a long text; else None."""
    for m in _LOOP.finditer(text):
        span = m.group(1)
        if len(m.group(0)) // len(span) >= max_repeats and span.strip():
            return f"{span[:40]!r} repeated {len(m.group(0)) // len(span)} times"
    run = re.search(r"(\S)\1{%d,}" % (4 * max_repeats - 1), text)
    if run:
        return f"{run.group(1)!r} repeated {len(run.group(0))} times"
    words = normalized_text(text).split()
    if len(words) >= 20:
        grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
        distinct = len(set(grams)) / len(grams)
        if distinct < min_distinct_trigrams:
            return f"{distinct:.0%} distinct word 3-grams (< {min_distinct_trigrams:.0%})"
    return None


def text_filter_reason(text: str, config: TextFilterConfig = TextFilterConfig()) -> tuple[str, str] | None:
    """The first filter ``text`` fails, as (reason, detail), or None when it passes them all."""
    stripped = (text or "").strip()
    words = stripped.split()
    if len(words) < config.min_words or len(stripped) < config.min_chars:
        return "too_short", f"{len(words)} words, {len(stripped)} chars"
    if len(stripped) > config.max_chars:
        return "too_long", f"{len(stripped)} chars (> {config.max_chars})"
    if not _WORD.search(stripped):
        return "no_words", "no word of two letters or more"
    loop = repetition_loop(stripped, max_repeats=config.max_repeats,
                           min_distinct_trigrams=config.min_distinct_trigrams)
    if loop:
        return "repetition_loop", loop
    if config.language is not None:
        problem = language_problem(stripped, config.language, min_script_share=config.min_script_share,
                                   min_common_word_share=config.min_common_word_share)
        if problem:
            return "wrong_language", problem
    return None
