"""The ``self_generated_prompts`` stage: prompts written by the target itself for one partition, filtered.

:func:`generate_self_prompts` samples ``samples`` conversations from the target cut after its user header
(:mod:`dflash_assets.generation.self_prompts`), a batch at a time, each batch journaled as it finishes, so a
run killed mid-partition resumes from the batches written. Then every sample goes through, in order:

- ``no_end_of_turn``: the first user turn did not end its turn within ``max_new_tokens``;
- the text filters of :mod:`dflash_assets.prompts.text_filters` (too short or long, no words, repetition loop,
  wrong language) on the first user turn; a later turn failing them ends the conversation before it;
- the ingest's normalization (:func:`dflash_assets.prompts.normalization.normalize_record`, its quarantine
  reasons), as for any source;
- ``duplicate``: the normalized first turn equals one seen before in this partition, in another
  ``self_generated_prompts`` partition, or any user turn of the prompt corpus;
- ``near_duplicate``: MinHash over word 5-grams (:mod:`dflash_assets.prompts.near_duplicates`) at or above
  ``near_duplicate_threshold`` against the same three;
- ``contaminated``: a user turn matching a benchmark prompt by the drafter's decontamination rule
  (:func:`dflash_assets.drafter.decontamination.turn_matches`).

Reads the target (spec), the committed prompt corpus's shards, the other ``self_generated_prompts/*.parquet``,
the journal and the benchmark files. Writes, through the store: the journal
``self_generated_prompts/_journal/<shard>/<config>/batch-<n>.parquet`` (deleted once published), then
``self_generated_prompts/<shard>.parquet`` (the prompt schema plus lineage columns),
``self_generated_prompts/_quarantine/<shard>.parquet`` (the ingest's quarantine schema),
``self_generated_prompts/_reports/<shard>.json`` and, once per corpus generation, the corpus's signatures
``self_generated_prompts/_index/corpus-gen-<N>-<perm>x<n>.parquet``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.drafter.decontamination import EvalText, Match, read_benchmark_prompts, turn_matches
from dflash_assets.generation.self_prompts import SampledConversation, SelfPromptSampling, UserTurnSampler
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import list_shard_keys, load_corpus_index, read_corpus_shard
from dflash_assets.prompts.near_duplicates import NGRAM, NUM_PERM, MinHashIndex, minhash, minhash_many
from dflash_assets.prompts.normalization import Prompt, normalize_record
from dflash_assets.prompts.quarantine import QUARANTINE_REASONS, QUARANTINE_SCHEMA
from dflash_assets.prompts.shards import PROMPT_SCHEMA, ShardBuilder
from dflash_assets.prompts.text_filters import TEXT_FILTER_REASONS, TextFilterConfig, text_filter_reason, text_hash

__all__ = ["SOURCE", "FILTER_REASONS", "SelfPromptsConfig", "SelfPromptsStats", "SelfPromptsResult",
           "SelfPromptsThresholds", "generate_self_prompts", "self_prompts_key", "read_self_prompts",
           "SELF_PROMPT_SCHEMA", "JOURNAL_SCHEMA", "journal_batch_key", "partition_seed",
           "self_prompts_report_key"]

SOURCE = "self_generated"
PREFIX = "self_generated_prompts"
FILTER_REASONS = {
    "no_end_of_turn": "the first user turn did not end its turn within max_new_tokens",
    **TEXT_FILTER_REASONS,
    "duplicate": "its normalized first user turn equals an earlier one of this partition, of another "
                 "self-generated partition, or a user turn of the prompt corpus",
    "near_duplicate": "MinHash (word 5-grams) Jaccard >= near_duplicate_threshold against the same",
    "contaminated": "a user turn matches a benchmark prompt (the drafter's decontamination rule)",
    **{k: f"normalization: {v}" for k, v in QUARANTINE_REASONS.items()},
}
# The prompt schema plus lineage: the sample's index, the target's answers between its user turns, the user
# tokens generated, the stage's config hash.
SELF_PROMPT_SCHEMA = (PROMPT_SCHEMA.append(pa.field("sample_index", pa.int64(), nullable=False))
                      .append(pa.field("answers", pa.list_(pa.string()), nullable=False))
                      .append(pa.field("new_tokens", pa.int32(), nullable=False))
                      .append(pa.field("config_hash", pa.string(), nullable=False)))
JOURNAL_SCHEMA = pa.schema([
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("user_turns", pa.list_(pa.string()), nullable=False),
    pa.field("answers", pa.list_(pa.string()), nullable=False),
    pa.field("ended", pa.bool_(), nullable=False),
    pa.field("new_tokens", pa.int32(), nullable=False),
])


def self_prompts_key(shard: str) -> str:
    return f"{PREFIX}/{shard}.parquet"


def _quarantine_key(shard: str) -> str:
    return f"{PREFIX}/_quarantine/{shard}.parquet"


def self_prompts_report_key(shard: str) -> str:
    return f"{PREFIX}/_reports/{shard}.json"


def _journal_prefix(shard: str, config_hash: str | None = None) -> str:
    return f"{PREFIX}/_journal/{shard}/" + (f"{config_hash}/" if config_hash else "")


def journal_batch_key(shard: str, config_hash: str, batch: int) -> str:
    """The journal object of one batch of samples (:data:`JOURNAL_SCHEMA`), written once the batch is sampled."""
    return f"{_journal_prefix(shard, config_hash)}batch-{batch:05d}.parquet"


@dataclass(frozen=True)
class SelfPromptsConfig:
    samples: int = 1024  # conversations sampled per partition (kept: those passing the filters)
    batch_size: int = 256  # rows per generate call; a batch is the unit of the journal
    seed: int = 0  # with the partition key (partition_seed): each partition draws its own conversations
    sampling: SelfPromptSampling = SelfPromptSampling()
    filters: TextFilterConfig = TextFilterConfig()
    near_duplicate_threshold: float = 0.7
    against_corpus: bool = True  # deduplicate against every user turn of the prompt corpus
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str | None = None  # None: the target spec's

    def __post_init__(self) -> None:
        if self.samples < 1 or self.batch_size < 1:
            raise ValueError("samples and batch_size must be >= 1")
        if not 0 < self.near_duplicate_threshold <= 1:
            raise ValueError("near_duplicate_threshold must be in (0, 1]")

    def config_hash(self, target_fingerprint: str | None) -> str:
        """16 hex chars over what changes the samples (not the device): journaled batches of another hash are
        not reused."""
        payload = {"samples": self.samples, "batch_size": self.batch_size, "seed": self.seed,
                   "seeded_by": "partition", "sampling": asdict(self.sampling), "dtype": self.dtype,
                   "target": target_fingerprint}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SelfPromptsStats:
    shard: str
    key: str
    samples: int
    kept: int
    ended_turn: int  # samples whose first user turn ended its turn
    distinct_ratio: float  # distinct normalized first turns / samples that ended their turn
    near_duplicate_ratio: float  # near duplicates / samples that ended their turn
    kept_ratio: float
    filtered: dict[str, int]  # reason -> samples
    later_turns_cut: int  # conversations ended early because a later user turn failed a filter
    user_turns: int
    batches: int
    batches_resumed: int
    generate_seconds: float  # in generate calls of this run (0 when every batch was resumed)
    prompts_per_s: float | None  # samples per generate second of this run
    benchmark_prompts: int
    config_hash: str
    sha256: str

    def to_metadata(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SelfPromptsThresholds:
    """The partition's check: enough distinct first turns among those that ended, enough samples kept."""

    min_distinct_ratio: float = 0.9
    min_kept_ratio: float = 0.25

    def __post_init__(self) -> None:
        if not (0 <= self.min_distinct_ratio <= 1 and 0 <= self.min_kept_ratio <= 1):
            raise ValueError("min_distinct_ratio and min_kept_ratio must be in [0, 1]")

    def description(self) -> str:
        return (f"Self-generated prompts of the partition: fails when under {self.min_distinct_ratio:.0%} of the "
                f"first user turns that ended their turn are distinct (normalized text), or under "
                f"{self.min_kept_ratio:.0%} of the samples pass every filter (end of turn, length, words, "
                "repetition, language, normalization, exact and near duplicates, decontamination). Blocking.")

    def check(self, stats: "SelfPromptsStats") -> tuple[bool, str, dict[str, Any]]:
        """(passed, a one-line description of the outcome, metadata: the ratios, thresholds and filter counts)."""
        problems = []
        if stats.distinct_ratio < self.min_distinct_ratio:
            problems.append(f"distinct ratio {stats.distinct_ratio:.1%} < {self.min_distinct_ratio:.0%}")
        if stats.kept_ratio < self.min_kept_ratio:
            problems.append(f"kept {stats.kept} of {stats.samples} ({stats.kept_ratio:.1%}) < "
                            f"{self.min_kept_ratio:.0%}")
        outcome = "; ".join(problems) or (f"kept {stats.kept} of {stats.samples}, distinct ratio "
                                          f"{stats.distinct_ratio:.1%}")
        metadata = {"distinct_ratio": stats.distinct_ratio, "min_distinct_ratio": self.min_distinct_ratio,
                    "kept_ratio": stats.kept_ratio, "min_kept_ratio": self.min_kept_ratio,
                    "filtered": stats.filtered}
        return not problems, outcome, metadata


@dataclass
class SelfPromptsResult:
    table: pa.Table
    stats: SelfPromptsStats
    quarantine: pa.Table
    examples: list[dict[str, Any]] = field(default_factory=list)


def read_self_prompts(store: Any, shard: str) -> pa.Table:
    """``self_generated_prompts/<shard>.parquet``; a clear error when the partition was never generated."""
    key = self_prompts_key(shard)
    if not store.exists(key):
        raise FileNotFoundError(f"{key} does not exist: materialize self_generated_prompts for {shard} first")
    return store.read_parquet(key)


# -- the journal ----------------------------------------------------------------------------------------------


def _journaled(store: Any, shard: str, config_hash: str) -> dict[int, pa.Table]:
    out = {}
    for key in store.list(_journal_prefix(shard, config_hash)):
        name = key.rsplit("/", 1)[-1]
        if name.startswith("batch-") and name.endswith(".parquet"):
            out[int(name[6:-8])] = store.read_parquet(key)
    return out


def _batch_table(convs: Sequence[SampledConversation]) -> pa.Table:
    return pa.table({"sample_index": [c.index for c in convs], "user_turns": [c.user_turns for c in convs],
                     "answers": [c.answers for c in convs], "ended": [c.ended for c in convs],
                     "new_tokens": [c.new_tokens for c in convs]}, schema=JOURNAL_SCHEMA)


def partition_seed(seed: int, shard: str) -> int:
    """The sampling seed of ``shard``'s batches: ``seed`` and the partition key hashed to 32 bits. Without the key
    every partition would draw the same conversations, and each after the first would be filtered whole as
    duplicates of it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{shard}".encode()).digest()[:4], "big")


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sample(store: Any, shard: str, spec: Any, config: SelfPromptsConfig, config_hash: str,
            on_batch: Callable[[int], None] | None, log: Callable[[str], None]
            ) -> tuple[pa.Table, int, int, int, float]:
    """Every sample of the partition: journaled batches reused, the others generated and journaled.
    Returns (samples table, batches, batches resumed, samples generated now, generate seconds)."""
    n_batches = -(-config.samples // config.batch_size)
    done = _journaled(store, shard, config_hash)
    resumed = len([b for b in done if b < n_batches])
    seconds, generated = 0.0, 0
    missing = [b for b in range(n_batches) if b not in done]
    if missing:
        model = spec.load_model(_device(config.device), config.dtype)
        sampler = UserTurnSampler(model, spec.chat(), config.sampling)
        for b in missing:
            indices = list(range(b * config.batch_size, min((b + 1) * config.batch_size, config.samples)))
            table = _batch_table(sampler.sample(indices, partition_seed(config.seed, shard)))
            store.write_parquet(journal_batch_key(shard, config_hash, b), table)
            done[b] = table
            generated += table.num_rows
            log(f"{shard}: batch {b + 1}/{n_batches} sampled ({len(indices)} conversations, "
                f"{sampler.seconds:.1f} s in generate so far)")
            if on_batch is not None:
                on_batch(b)
        seconds = sampler.seconds
    return pa.concat_tables([done[b] for b in range(n_batches)]), n_batches, resumed, generated, seconds


# -- the filters ----------------------------------------------------------------------------------------------


def _corpus_signatures(store: Any) -> pa.Table:
    """(where, text hash, MinHash signature) of every distinct user turn of the committed corpus, cached per
    corpus generation at ``self_generated_prompts/_index/corpus-gen-<N>.parquet`` (built by the first partition
    that needs it; the same bytes whoever builds it)."""
    index = load_corpus_index(store)
    key = f"{PREFIX}/_index/corpus-gen-{index.generation}-{NUM_PERM}x{NGRAM}.parquet"
    if store.exists(key):
        return store.read_parquet(key)
    wheres, hashes, texts, seen = [], [], [], set()
    for corpus_shard in sorted(index.shards):
        table = read_corpus_shard(store, corpus_shard, columns=["prompt_id", "user_turns"])
        for pid, turns in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            for text in turns or ():
                h = text_hash(text)
                if h not in seen:
                    seen.add(h)
                    wheres.append(f"corpus:{corpus_shard}/{pid}")
                    hashes.append(h)
                    texts.append(text)
    signatures = minhash_many(texts).reshape(-1)
    table = pa.table({"where": wheres, "text_hash": hashes, "signature": pa.FixedSizeListArray.from_arrays(
        pa.array(signatures, pa.uint32()), NUM_PERM)})
    store.write_parquet(key, table)
    return table


def _dedup_sources(store: Any, shard: str, threshold: float, against_corpus: bool
                   ) -> tuple[dict[str, str], MinHashIndex]:
    """Hashes (normalized text -> where) and a MinHash index of the other sources' user turns: the corpus's (all
    turns) and the other self-generated partitions' (first turns)."""
    hashes: dict[str, str] = {}
    index = MinHashIndex(threshold)

    def add(wheres: list[str], text_hashes: list[str], signatures: np.ndarray) -> None:
        fresh = [i for i, h in enumerate(text_hashes) if h not in hashes]
        for i in fresh:
            hashes[text_hashes[i]] = wheres[i]
        index.add_many([wheres[i] for i in fresh], signatures[fresh])

    if against_corpus and list_shard_keys(store):
        corpus = _corpus_signatures(store)
        flat = corpus.column("signature").combine_chunks().flatten().to_numpy()
        add(corpus.column("where").to_pylist(), corpus.column("text_hash").to_pylist(), flat.reshape(-1, NUM_PERM))
    wheres, texts = [], []
    for key in sorted(store.list(f"{PREFIX}/")):
        other = key[len(PREFIX) + 1:-len(".parquet")]
        if "/" in other or not key.endswith(".parquet") or other == shard:
            continue
        table = store.read_parquet(key, columns=["prompt_id", "user_turns"])
        for pid, turns in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            wheres.append(f"{SOURCE}:{other}/{pid}")
            texts.append(turns[0])
    if texts:
        add(wheres, [text_hash(t) for t in texts], minhash_many(texts))
    return hashes, index


def _record(shard: str, index: int, system: str | None, turns: Sequence[str], answers: Sequence[str]) -> dict:
    """The sample as a ShareGPT record, for the ingest's normalization."""
    conv = [{"from": "system", "value": system}] if system is not None else []
    for k, text in enumerate(turns):
        conv.append({"from": "human", "value": text})
        if k < len(answers):
            conv.append({"from": "gpt", "value": answers[k]})
    return {"id": f"{shard}#{index}", "conversations": conv, "category": SOURCE}


class _Filter:
    """The filters of one partition, applied sample by sample in index order (the first occurrence is kept)."""

    def __init__(self, store: Any, shard: str, config: SelfPromptsConfig, samples: pa.Table,
                 eval_prompts: Sequence[EvalText]):
        self.shard, self.config = shard, config
        rows = samples.select(["sample_index", "user_turns"]).to_pylist()
        self.contaminated: dict[int, Match] = {}  # sample index -> its first turn matching a benchmark prompt
        for m in turn_matches(eval_prompts, ((shard, str(r["sample_index"]), t) for r in rows
                                             for t in r["user_turns"])) if eval_prompts else ():
            self.contaminated.setdefault(int(m.train_id), m)
        self.hashes, self.index = _dedup_sources(store, shard, config.near_duplicate_threshold,
                                                 config.against_corpus)
        self.ingest = IngestConfig()
        self.later_turns_cut = 0
        self.ended = 0
        self.first_hashes: set[str] = set()

    def __call__(self, row: dict) -> tuple[Prompt, list[str]] | tuple[str, str]:
        """The kept prompt and answers, or (reason, detail)."""
        turns, answers = list(row["user_turns"]), list(row["answers"])
        if not row["ended"]:
            return "no_end_of_turn", f"{row['new_tokens']} tokens without an end of turn"
        self.ended += 1
        first_hash = text_hash(turns[0])
        self.first_hashes.add(first_hash)
        failed = text_filter_reason(turns[0], self.config.filters)
        if failed:
            return failed
        for k in range(1, len(turns)):
            if text_filter_reason(turns[k], self.config.filters):
                turns, answers = turns[:k], answers[:k - 1]
                self.later_turns_cut += 1
                break
        prompt = normalize_record(_record(self.shard, row["sample_index"], self.config.sampling.system_prompt,
                                          turns, answers), self.ingest, index=row["sample_index"])
        if not isinstance(prompt, Prompt):
            return prompt.reason, prompt.detail
        where = self.hashes.get(first_hash)
        if where is not None:
            return "duplicate", f"equals {where}"
        signature = minhash(turns[0])
        near = self.index.query(signature)
        if near is not None:
            return "near_duplicate", f"Jaccard {near.jaccard:.2f} with {near.key}"
        m = self.contaminated.get(row["sample_index"])
        if m is not None and m.train_text in turns:
            return "contaminated", f"{m.kind} match of {m.origin} prompt {m.eval_id}"
        where = f"{SOURCE}:{self.shard}/{prompt.prompt_id}"
        self.hashes[first_hash] = where
        self.index.add(where, signature)
        return prompt, answers


# -- the stage ------------------------------------------------------------------------------------------------


def generate_self_prompts(store: Any, shard: str, spec: Any, config: SelfPromptsConfig = SelfPromptsConfig(), *,
                          benchmark_files: Sequence[str] = (), on_batch: Callable[[int], None] | None = None,
                          log: Callable[[str], None] | None = None) -> SelfPromptsResult:
    """Sample, journal, filter and publish the self-generated prompts of ``shard`` (see the module docstring).

    ``spec``: the target's ``TargetModelSpec``. ``on_batch(b)`` is called after batch ``b`` is journaled.
    """
    log = log or (lambda message: None)
    config_hash = config.config_hash(spec.generation_fingerprint())
    samples, n_batches, resumed, generated, seconds = _sample(store, shard, spec, config, config_hash, on_batch, log)
    eval_prompts = [p for f in benchmark_files for p in read_benchmark_prompts(f)]
    keep = _Filter(store, shard, config, samples, eval_prompts)
    builder = ShardBuilder(shard, None, config.samples)
    lineage: dict[str, list] = {"sample_index": [], "answers": [], "new_tokens": [], "config_hash": []}
    rejected: dict[str, list] = {f.name: [] for f in QUARANTINE_SCHEMA}
    reasons: Counter[str] = Counter()
    examples: list[dict[str, Any]] = []
    for row in samples.to_pylist():
        outcome = keep(row)
        if isinstance(outcome[0], Prompt):
            prompt, answers = outcome
            builder.add(prompt, SOURCE, row["sample_index"], 0)
            for name, value in (("sample_index", row["sample_index"]), ("answers", answers),
                                ("new_tokens", row["new_tokens"]), ("config_hash", config_hash)):
                lineage[name].append(value)
            continue
        reason, detail = outcome
        reasons[reason] += 1
        if len(examples) < 4:
            examples.append({"outcome": reason, "detail": detail, "text": (row["user_turns"] or [""])[0][:200]})
        raw = json.dumps({"user_turns": row["user_turns"], "answers": row["answers"]}, ensure_ascii=False)
        for name, value in (("source", SOURCE), ("source_index", row["sample_index"]),
                            ("source_id", f"{shard}#{row['sample_index']}"), ("reason", reason), ("detail", detail),
                            ("byte_offset", None), ("raw_chars", len(raw)), ("raw", raw[:4096])):
            rejected[name].append(value)
    base = builder.table().cast(PROMPT_SCHEMA)
    table = pa.Table.from_arrays([*base.columns, *(pa.array(lineage[f.name], f.type) for f in
                                                   SELF_PROMPT_SCHEMA if f.name in lineage)],
                                 schema=SELF_PROMPT_SCHEMA)
    quarantine = pa.table(rejected, schema=QUARANTINE_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    ended = keep.ended
    stats = SelfPromptsStats(
        shard=shard, key=self_prompts_key(shard), samples=samples.num_rows, kept=table.num_rows, ended_turn=ended,
        distinct_ratio=round(len(keep.first_hashes) / ended, 4) if ended else 0.0,
        near_duplicate_ratio=round(reasons["near_duplicate"] / ended, 4) if ended else 0.0,
        kept_ratio=round(table.num_rows / samples.num_rows, 4) if samples.num_rows else 0.0,
        filtered=dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        later_turns_cut=keep.later_turns_cut, user_turns=sum(len(t) for t in table.column("user_turns").to_pylist()),
        batches=n_batches, batches_resumed=resumed, generate_seconds=round(seconds, 2),
        prompts_per_s=round(generated / seconds, 2) if seconds > 0 else None,
        benchmark_prompts=len(eval_prompts), config_hash=config_hash, sha256=hashlib.sha256(data).hexdigest())
    store.write_parquet(_quarantine_key(shard), quarantine)
    reasons_named = {k: FILTER_REASONS.get(k, k) for k in reasons}
    store.write_json(self_prompts_report_key(shard), {**stats.to_metadata(), "reasons": reasons_named})
    store.write_bytes(self_prompts_key(shard), data)
    for key in store.list(_journal_prefix(shard)):
        store.delete(key)
    log(f"{shard}: kept {stats.kept} of {stats.samples} self-generated prompts; filtered {stats.filtered or 'none'}")
    kept = [{"outcome": "kept", "detail": "", "text": turns[0][:200]}
            for turns in table.column("user_turns").to_pylist()[:4]]
    return SelfPromptsResult(table, stats, quarantine, kept + examples)
