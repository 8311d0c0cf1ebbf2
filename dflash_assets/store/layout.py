"""The store's key layout: where each asset's objects live under the store root, in one place.

Every stage, the Dagster assets and the tests name keys through these
functions, so the layout is read and changed here only. Keys are relative to
the store root (a directory or ``s3://bucket/prefix``). Writes nothing; the
``list_*`` helpers list one prefix of a store, and the helpers of multi-file
outputs read their manifest (``store.manifest``).

    prompt_corpus/commits/gen-<N>.json           generation N of the corpus index, created once (the commit)
    prompt_corpus/index.json                     a copy of the newest commit (readers roll forward from it)
    prompt_corpus/staged/gen-<N>-<run>/<shard>.parquet  staged shards of ingest run <run> for generation N
    prompt_corpus/manifest/gen-<N>-<run>.parquet prompt -> shard manifest of that run
    prompt_corpus/quarantine/<source>.parquet    rejected records with a reason each
    prompt_corpus/reports/<source>.json          the ingest report
    raw_prompts/<shard>.parquet
    completions/<shard>.parquet                  + _failed/<shard>.parquet, _journal/<shard>/...
    tokenized_samples/<shard>.parquet            + <shard>.quality.json (the quality gate)
    hidden_state_cache/<shard>.manifest.json     the partition's parts (readers trust only this list)
    hidden_state_cache/<shard>/<version>/<shard>[-NNNNN-of-NNNNN].safetensors
    hidden_state_cache/<shard>[-NNNNN-of-NNNNN].safetensors   (before manifests; read when no manifest)
    drafter_recipes/<recipe>.json
    drafter_checkpoint/<recipe>/manifest.json    the checkpoint's files (readers trust only this list)
    drafter_checkpoint/<recipe>/<version>/<file> (before manifests: drafter_checkpoint/<recipe>/<file>)
    drafter_eval/<recipe>.json
    drafter_promoted/<family>/manifest.json      the promoted checkpoint of a recipe family (serving reads it)
    drafter_promoted/<family>/<version>/<file>   its own copy of that checkpoint's files
"""

from __future__ import annotations

import re
from typing import Any

PROMPT_CORPUS = "prompt_corpus"
RAW_PROMPTS = "raw_prompts"
COMPLETIONS = "completions"
TOKENIZED_SAMPLES = "tokenized_samples"
HIDDEN_STATE_CACHE = "hidden_state_cache"
DRAFTER_RECIPES = "drafter_recipes"
DRAFTER_CHECKPOINT = "drafter_checkpoint"
DRAFTER_EVAL = "drafter_eval"
DRAFTER_PROMOTED = "drafter_promoted"

_CACHE_PART = re.compile(r"(?P<shard>.+?)(?:-(?P<part>\d{5})-of-(?P<parts>\d{5}))?\.safetensors")


# --- prompt_corpus ------------------------------------------------------------------

def corpus_index() -> str:
    return f"{PROMPT_CORPUS}/index.json"


def corpus_staged_prefix() -> str:
    return f"{PROMPT_CORPUS}/staged"


def corpus_staged_shard(generation: int, shard: str, run: str) -> str:
    """A shard staged by ingest run ``run`` for generation ``generation`` (unique per run: runs never share one)."""
    return f"{corpus_staged_prefix()}/gen-{generation:06d}-{run}/{shard}.parquet"


def corpus_manifest_prefix() -> str:
    return f"{PROMPT_CORPUS}/manifest"


def corpus_manifest(generation: int, run: str) -> str:
    return f"{corpus_manifest_prefix()}/gen-{generation:06d}-{run}.parquet"


def corpus_commits_prefix() -> str:
    return f"{PROMPT_CORPUS}/commits"


def corpus_commit(generation: int) -> str:
    """Generation ``generation`` of the corpus index; created once, never overwritten."""
    return f"{corpus_commits_prefix()}/gen-{generation:06d}.json"


_CORPUS_GENERATION = re.compile(r"/gen-(\d{6,})(?:-[0-9a-z]+)?(?:/|\.)")


def corpus_key_generation(key: str) -> int | None:
    """The generation a staged shard, manifest or commit key belongs to (None for other keys)."""
    m = _CORPUS_GENERATION.search(key)
    return int(m.group(1)) if m else None


def corpus_quarantine(source: str) -> str:
    return f"{PROMPT_CORPUS}/quarantine/{source}.parquet"


def corpus_report(source: str) -> str:
    return f"{PROMPT_CORPUS}/reports/{source}.json"


# --- per-shard assets -----------------------------------------------------------------

def raw_prompts(shard: str) -> str:
    return f"{RAW_PROMPTS}/{shard}.parquet"


def completions(shard: str) -> str:
    return f"{COMPLETIONS}/{shard}.parquet"


def completions_failed(shard: str) -> str:
    return f"{COMPLETIONS}/_failed/{shard}.parquet"


def completions_journal(shard: str) -> str:
    return f"{COMPLETIONS}/_journal/{shard}"


def tokenized_samples(shard: str) -> str:
    return f"{TOKENIZED_SAMPLES}/{shard}.parquet"


def quality_gate(shard: str) -> str:
    return f"{TOKENIZED_SAMPLES}/{shard}.quality.json"


def hidden_state_part(shard: str, part: int | None = None, parts: int | None = None) -> str:
    """One part of a partition's cache as written before manifests: ``<shard>[-00001-of-00003].safetensors``."""
    suffix = "" if parts is None else f"-{part:05d}-of-{parts:05d}"
    return f"{HIDDEN_STATE_CACHE}/{shard}{suffix}.safetensors"


def hidden_state_manifest(shard: str) -> str:
    """The manifest naming a partition's current parts (see ``store.manifest``)."""
    return f"{HIDDEN_STATE_CACHE}/{shard}.manifest.json"


def hidden_state_versions(shard: str) -> str:
    """The prefix under which each publication of a partition's parts gets its own ``<version>/``."""
    return f"{HIDDEN_STATE_CACHE}/{shard}"


# --- drafter ------------------------------------------------------------------------

def drafter_recipe(name: str) -> str:
    return f"{DRAFTER_RECIPES}/{name}.json"


def drafter_checkpoint_prefix(name: str) -> str:
    return f"{DRAFTER_CHECKPOINT}/{name}"


def drafter_checkpoint_file(name: str, file_name: str) -> str:
    """A checkpoint file as written before manifests (read when the recipe has no manifest)."""
    return f"{drafter_checkpoint_prefix(name)}/{file_name}"


def drafter_checkpoint_manifest(name: str) -> str:
    """The manifest naming the recipe's current checkpoint files; they live under ``<prefix>/<version>/``."""
    return f"{drafter_checkpoint_prefix(name)}/manifest.json"


def drafter_checkpoint_files(store: Any, name: str, file_names: tuple[str, ...] = ()) -> dict[str, str]:
    """File name -> key of the recipe's current checkpoint: from its manifest, else the pre-manifest keys."""
    from dflash_assets.store.manifest import manifest_files, read_manifest

    manifest = read_manifest(store, drafter_checkpoint_manifest(name))
    if manifest is not None:
        return manifest_files(manifest)
    return {f: drafter_checkpoint_file(name, f) for f in file_names if store.exists(drafter_checkpoint_file(name, f))}


def drafter_eval(name: str) -> str:
    return f"{DRAFTER_EVAL}/{name}.json"


def drafter_promoted_prefix(family: str) -> str:
    """Where a recipe family's promoted checkpoint keeps its own copy: ``<prefix>/<version>/<file>``."""
    if not family or "/" in family:
        raise ValueError(f"recipe family must be a non-empty name without '/': {family!r}")
    return f"{DRAFTER_PROMOTED}/{family}"


def drafter_promoted_manifest(family: str) -> str:
    """The promoted checkpoint of a recipe family (``promotion.write_promoted``): keys, tau per slice."""
    return f"{drafter_promoted_prefix(family)}/manifest.json"


# --- listing ------------------------------------------------------------------------

def _shards_of(store: Any, prefix: str, suffix: str) -> list[str]:
    """Shard names of the direct ``<prefix>/<shard><suffix>`` objects (nothing under ``_failed/`` etc.)."""
    out = set()
    for key in store.list(prefix):
        name = key[len(prefix) + 1:]
        if "/" not in name and name.endswith(suffix) and not name.endswith(".quality.json"):
            out.add(name[: -len(suffix)])
    return sorted(out)


def list_raw_prompt_shards(store: Any) -> list[str]:
    return _shards_of(store, RAW_PROMPTS, ".parquet")


def list_completion_shards(store: Any) -> list[str]:
    return _shards_of(store, COMPLETIONS, ".parquet")


def list_sample_shards(store: Any) -> list[str]:
    return _shards_of(store, TOKENIZED_SAMPLES, ".parquet")


def list_hidden_state_entries(store: Any) -> dict[str, list[dict[str, Any]]]:
    """Every cached partition and its parts in order, each ``{"key", "bytes"}``, from one listing of the cache
    prefix plus one read per manifest. A partition with a manifest has exactly the parts it names (parts of
    unfinished or older publications are ignored); one without (written before manifests) has its direct
    ``<shard>[-NNNNN-of-NNNNN].safetensors`` objects, ``bytes`` None."""
    from dflash_assets.store.manifest import read_manifest

    legacy: dict[str, list[str]] = {}
    manifests: list[str] = []
    for key in store.list(HIDDEN_STATE_CACHE):
        name = key[len(HIDDEN_STATE_CACHE) + 1:]
        if "/" in name:
            continue  # a version directory: only a manifest makes its files visible
        if name.endswith(".manifest.json"):
            manifests.append(name[: -len(".manifest.json")])
        elif (m := _CACHE_PART.fullmatch(name)) is not None:
            legacy.setdefault(m.group("shard"), []).append(key)
    out: dict[str, list[dict[str, Any]]] = {s: [{"key": k, "bytes": None} for k in sorted(keys)]
                                            for s, keys in legacy.items()}
    for shard in manifests:
        manifest = read_manifest(store, hidden_state_manifest(shard))
        if manifest is not None:
            out[shard] = [{"key": e["key"], "bytes": e.get("bytes")} for e in manifest["files"]]
    return dict(sorted(out.items()))


def list_hidden_state_parts(store: Any) -> dict[str, list[str]]:
    """Every cached partition and its part keys in part order (see :func:`list_hidden_state_entries`)."""
    return {shard: [e["key"] for e in entries] for shard, entries in list_hidden_state_entries(store).items()}


def hidden_state_parts(store: Any, shard: str) -> list[str]:
    """The part keys of one partition's cache (one key unless it was split by size)."""
    return list_hidden_state_parts(store).get(shard, [])
