"""Decontamination: evaluation prompts must not appear in the prompts a drafter recipe trains on.

The evaluation side is the prompts ``drafter_eval`` would decode plus every prompt of the benchmark files
a deployment lists (``DFLASH_BENCHMARK_PROMPTS``). The training side is every user turn of every
``raw_prompts`` shard the recipe trains on.

Held-out prompts are *selected* clean: ``heldout_selection`` walks the held-out shards in order and leaves out
each first user turn that matches a training turn by the rule below (ShareGPT repeats and rephrases prompts
under new ids, so a held-out shard of real data nearly always holds a few); ``drafter_eval`` decodes the
first ``num_prompts`` of what remains. Those left out are counted (``excluded_exact``, ``excluded_near``)
with examples, not failed. What fails the recipe's check is a benchmark prompt found in training data
(the user's benchmark is what it is: the training data must change) or no held-out prompt at all.

The rule (pure Python, no extra dependency):

- text is normalized: Unicode NFKC, case-folded, every run of non-alphanumeric characters is one space;
- **exact**: the normalized evaluation prompt equals a normalized training user turn;
- **near duplicate**: the sets of word 5-grams (a text with fewer than 5 words is one "gram", itself) have a
  Jaccard similarity of at least 0.7, or, for an evaluation prompt of at least 20 words, at least 0.8 of its
  5-grams occur in one training turn (the prompt pasted into a longer one).

Matching is exact, not sampled: the evaluation prompts' 5-grams are indexed, and each training turn is
looked up gram by gram (no MinHash false negatives; cost linear in the training text).

Reads ``raw_prompts/<shard>.parquet`` through the store and benchmark files (``.txt``: one prompt a line;
``.json`` / ``.jsonl``: strings or records with a ``prompt``, ``question``, ``input``, ``instruction`` or
``text`` field, or OpenAI-style ``messages`` whose user turns count). Writes nothing.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from dflash_assets.store import layout

__all__ = [
    "NGRAM", "JACCARD_THRESHOLD", "CONTAINMENT_THRESHOLD", "CONTAINMENT_MIN_WORDS", "RULE",
    "normalize_text", "word_ngrams", "EvalText", "Match", "DecontaminationReport", "find_overlaps",
    "read_benchmark_prompts", "recipe_decontamination", "HeldOutSelection", "heldout_selection", "best_matches",
    "turn_matches",
]

NGRAM = 5
JACCARD_THRESHOLD = 0.7
CONTAINMENT_THRESHOLD = 0.8
CONTAINMENT_MIN_WORDS = 20
MAX_EXAMPLES = 5
RULE = (f"normalized text (NFKC, case-folded, non-alphanumerics collapsed to one space); exact: equal; "
        f"near duplicate: word {NGRAM}-gram Jaccard >= {JACCARD_THRESHOLD}, or >= {CONTAINMENT_THRESHOLD} "
        f"of an evaluation prompt's {NGRAM}-grams inside one training turn (prompts of >= "
        f"{CONTAINMENT_MIN_WORDS} words)")

_SEPARATORS = re.compile(r"[\s\W_]+", re.UNICODE)


def normalize_text(text: str) -> str:
    """NFKC, case-folded, every run of whitespace, punctuation or underscores one space, trimmed."""
    folded = unicodedata.normalize("NFKC", text or "").casefold()
    return _SEPARATORS.sub(" ", folded).strip()


def word_ngrams(normalized: str, n: int = NGRAM) -> frozenset[str]:
    """The word n-grams of a normalized text; a shorter non-empty text is one gram (itself)."""
    words = normalized.split()
    if not words:
        return frozenset()
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


@dataclass(frozen=True)
class EvalText:
    """One evaluation prompt: where it comes from (``heldout`` or a benchmark file) and its id there."""

    origin: str
    prompt_id: str
    text: str


@dataclass
class Match:
    kind: str  # "exact" | "near"
    origin: str
    eval_id: str
    shard: str
    train_id: str
    jaccard: float
    containment: float
    eval_text: str
    train_text: str

    def short(self) -> dict[str, Any]:
        return {**asdict(self), "eval_text": _clip(self.eval_text), "train_text": _clip(self.train_text)}


@dataclass
class DecontaminationReport:
    """Counts of contaminated evaluation prompts (each counted once: exact wins over near), examples, rule."""

    eval_prompts: int = 0
    benchmark_prompts: int = 0
    training_turns: int = 0
    training_shards: list[str] = field(default_factory=list)
    exact: int = 0
    near: int = 0
    by_origin: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    excluded_by_eval_selection: int = 0  # held-out prompts left out of evaluation: exact + near matches
    excluded_exact: int = 0
    excluded_near: int = 0
    excluded_examples: list[dict[str, Any]] = field(default_factory=list)
    held_out: bool = True  # False: the recipe trains on every shard, so drafter_eval would use training prompts
    benchmark_files: list[str] = field(default_factory=list)
    rule: str = RULE

    @property
    def contaminated(self) -> int:
        return self.exact + self.near

    @property
    def passed(self) -> bool:
        return self.held_out and self.eval_prompts > 0 and self.contaminated == 0

    def summary(self) -> str:
        if not self.held_out:
            return "no held-out shard: the recipe trains on every shard, so drafter_eval would measure training prompts"
        if self.eval_prompts == 0:
            return (f"no clean held-out prompt: all {self.excluded_by_eval_selection} held-out prompts match "
                    f"training turns")
        excluded = (f" ({self.excluded_by_eval_selection} held-out prompts left out of evaluation as duplicates of "
                    f"training turns: {self.excluded_exact} exact, {self.excluded_near} near)"
                    if self.excluded_by_eval_selection else "")
        if self.passed:
            return (f"clean: none of {self.eval_prompts} held-out and {self.benchmark_prompts} benchmark prompts "
                    f"matches any of {self.training_turns} training turns{excluded}")
        return (f"{self.contaminated} evaluation prompts appear in training data ({self.exact} exact, "
                f"{self.near} near duplicates) of {self.eval_prompts + self.benchmark_prompts}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "contaminated": self.contaminated, "summary": self.summary()}


def _clip(text: str, n: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


class _EvalIndex:
    """Evaluation prompts by normalized text and by 5-gram, for lookups of training turns."""

    def __init__(self, prompts: Sequence[EvalText]):
        self.prompts = list(prompts)
        self.grams = [word_ngrams(normalize_text(p.text)) for p in self.prompts]
        self.words = [len(normalize_text(p.text).split()) for p in self.prompts]
        self.by_text: dict[str, list[int]] = defaultdict(list)
        self.by_gram: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.prompts):
            norm = normalize_text(p.text)
            if norm:
                self.by_text[norm].append(i)
            for g in self.grams[i]:
                self.by_gram[g].append(i)

    def matches(self, text: str) -> list[tuple[int, str, float, float]]:
        """(eval index, kind, jaccard, containment) of each evaluation prompt this training turn matches."""
        norm = normalize_text(text)
        if not norm:
            return []
        found = [(i, "exact", 1.0, 1.0) for i in self.by_text.get(norm, ())]
        exact = {i for i, *_ in found}
        grams = word_ngrams(norm)
        shared: dict[int, int] = defaultdict(int)
        for g in grams:
            for i in self.by_gram.get(g, ()):
                shared[i] += 1
        for i, inter in shared.items():
            if i in exact:
                continue
            mine = len(self.grams[i])
            jaccard = inter / (mine + len(grams) - inter)
            containment = inter / mine
            if jaccard >= JACCARD_THRESHOLD or (
                    self.words[i] >= CONTAINMENT_MIN_WORDS and containment >= CONTAINMENT_THRESHOLD):
                found.append((i, "near", round(jaccard, 4), round(containment, 4)))
        return found


def best_matches(eval_prompts: Sequence[EvalText], training: Iterable[tuple[str, str, str]]
                 ) -> tuple[dict[int, Match], int]:
    """{index into ``eval_prompts``: its strongest match (exact wins, then the higher Jaccard)}, turns read."""
    index = _EvalIndex(eval_prompts)
    best: dict[int, Match] = {}
    turns = 0
    for shard, train_id, text in training:
        turns += 1
        for i, kind, jaccard, containment in index.matches(text):
            old = best.get(i)
            if old is None or (old.kind == "near" and kind == "exact") or (
                    old.kind == kind and jaccard > old.jaccard):
                p = eval_prompts[i]
                best[i] = Match(kind, p.origin, p.prompt_id, shard, train_id, jaccard, containment, p.text, text)
    return best, turns


def turn_matches(eval_prompts: Sequence[EvalText], training: Iterable[tuple[str, str, str]]) -> list[Match]:
    """Each training turn ``(shard, prompt_id, text)`` that matches an evaluation prompt, with its strongest match
    (exact wins, then the higher Jaccard), in the turns' order: how a new prompt source drops contaminated turns."""
    index = _EvalIndex(eval_prompts)
    out = []
    for shard, train_id, text in training:
        found = index.matches(text)
        if found:
            i, kind, jaccard, containment = max(found, key=lambda f: (f[1] == "exact", f[2]))
            p = eval_prompts[i]
            out.append(Match(kind, p.origin, p.prompt_id, shard, train_id, jaccard, containment, p.text, text))
    return out


def find_overlaps(eval_prompts: Sequence[EvalText], training: Iterable[tuple[str, str, str]],
                  report: DecontaminationReport | None = None) -> DecontaminationReport:
    """Match ``eval_prompts`` against training turns ``(shard, prompt_id, text)``; fills and returns ``report``.

    Each evaluation prompt is counted once, as exact if any training turn equals it, else near."""
    report = report if report is not None else DecontaminationReport(eval_prompts=len(eval_prompts))
    best, turns = best_matches(eval_prompts, training)
    report.training_turns += turns
    report.exact = sum(m.kind == "exact" for m in best.values())
    report.near = sum(m.kind == "near" for m in best.values())
    by_origin: dict[str, int] = defaultdict(int)
    for m in best.values():
        by_origin[m.origin] += 1
    report.by_origin = dict(sorted(by_origin.items()))
    ordered = sorted(best.values(), key=lambda m: (m.kind != "exact", m.origin, m.eval_id))
    report.examples = [m.short() for m in ordered[:MAX_EXAMPLES]]
    return report


# ----------------------------------------------------------------------------------------------
# Benchmark prompt files

_PROMPT_FIELDS = ("prompt", "question", "input", "instruction", "text")


def _prompt_of(record: Any) -> list[str]:
    if isinstance(record, str):
        return [record]
    if isinstance(record, dict):
        for key in _PROMPT_FIELDS:
            if isinstance(record.get(key), str):
                return [record[key]]
        messages = record.get("messages") or record.get("conversations")
        if isinstance(messages, list):
            return [m.get("content") or m.get("value") for m in messages if isinstance(m, dict)
                    and m.get("role", m.get("from")) in ("user", "human")
                    and isinstance(m.get("content") or m.get("value"), str)]
    return []


def read_benchmark_prompts(path: str | Path) -> list[EvalText]:
    """The prompts of one benchmark file (see the module docstring for the formats); a clear error otherwise."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"benchmark prompt file {str(path)!r} does not exist (DFLASH_BENCHMARK_PROMPTS)")
    text = p.read_text("utf-8")
    if p.suffix == ".txt":
        records: list[Any] = [line for line in text.splitlines() if line.strip()]
    elif p.suffix == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"benchmark file {p}: line {n} is not JSON: {e}") from e
    elif p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark file {p} is not JSON: {e}") from e
        records = data if isinstance(data, list) else [data]
    else:
        raise ValueError(f"benchmark file {p}: use .txt (one prompt a line), .json or .jsonl")
    out = []
    for n, record in enumerate(records):
        for k, prompt in enumerate(_prompt_of(record)):
            out.append(EvalText(f"benchmark:{p.name}", f"{n}" if k == 0 else f"{n}.{k}", prompt))
    if not out:
        raise ValueError(f"benchmark file {p} holds no prompts (fields looked for: {', '.join(_PROMPT_FIELDS)}, "
                         f"messages)")
    return out


# ----------------------------------------------------------------------------------------------
# A recipe's check


@dataclass
class HeldOutSelection:
    """The held-out prompts ``drafter_eval`` decodes, in its order, and those left out as training duplicates."""

    prompts: list[EvalText]
    excluded: list[Match]  # exact or near matches of a training turn, in shard order
    held_out: bool  # False: the recipe trains on every shard

    @property
    def ids(self) -> set[str]:
        return {p.prompt_id for p in self.prompts}


def heldout_selection(store: Any, trained: Sequence[str], limit: int) -> HeldOutSelection:
    """The first ``limit`` held-out first user turns (shards the recipe does not train on, in order) that match
    no user turn of a trained shard, exactly or nearly (the module's rule); what was left out on the way."""
    shards = layout.list_raw_prompt_shards(store)
    trained_set = set(trained)
    held = [s for s in shards if s not in trained_set]
    if not held:
        return HeldOutSelection([], [], False)
    trained_shards = [s for s in shards if s in trained_set]

    def candidates() -> Iterable[EvalText]:
        for shard in held:
            table = store.read_parquet(layout.raw_prompts(shard), columns=["prompt_id", "user_turns"])
            for row in table.to_pylist():
                yield EvalText("heldout", row["prompt_id"], (row["user_turns"] or [""])[0])

    pending = iter(candidates())
    chosen: list[EvalText] = []
    excluded: list[Match] = []
    while len(chosen) < limit:  # a round reads the trained shards once; one round unless many are duplicates
        want = limit - len(chosen)
        batch = [p for _, p in zip(range(want + want // 4 + 16), pending)]
        if not batch:
            break
        best, _ = best_matches(batch, training_turns(store, trained_shards))
        for i, prompt in enumerate(batch):
            if len(chosen) >= limit:
                break
            if i in best:
                excluded.append(best[i])
            else:
                chosen.append(prompt)
    return HeldOutSelection(chosen, excluded, True)


def training_turns(store: Any, shards: Sequence[str]) -> Iterable[tuple[str, str, str]]:
    """Every user turn of the trained shards: (shard, prompt_id, text)."""
    for shard in shards:
        table = store.read_parquet(layout.raw_prompts(shard), columns=["prompt_id", "user_turns"])
        for pid, turns in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            for text in turns or ():
                yield shard, pid, text


def recipe_decontamination(store: Any, trained_shards: Sequence[str], *, benchmark_files: Sequence[str] = (),
                           max_eval_prompts: int = 4096) -> DecontaminationReport:
    """The decontamination report of a recipe that trains on ``trained_shards`` (see the module docstring).

    ``max_eval_prompts``: how many held-out prompts are checked, in ``drafter_eval``'s order (it decodes the
    first ``num_prompts`` of them, 16 by default)."""
    selection = heldout_selection(store, trained_shards, max_eval_prompts)
    benchmark = [p for f in benchmark_files for p in read_benchmark_prompts(f)]
    excluded = selection.excluded
    report = DecontaminationReport(
        eval_prompts=len(selection.prompts), benchmark_prompts=len(benchmark), training_shards=list(trained_shards),
        excluded_by_eval_selection=len(excluded), excluded_exact=sum(m.kind == "exact" for m in excluded),
        excluded_near=sum(m.kind == "near" for m in excluded), excluded_examples=[m.short() for m in
                                                                                  excluded[:MAX_EXAMPLES]],
        held_out=selection.held_out, benchmark_files=[str(f) for f in benchmark_files])
    # the held-out prompts are clean by selection; they stay in the match so a rule change cannot hide one
    return find_overlaps([*selection.prompts, *benchmark], training_turns(store, trained_shards), report)
