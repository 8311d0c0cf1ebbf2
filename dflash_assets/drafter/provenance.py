"""A checkpoint's provenance: what data, target, settings and code made it (``provenance.json``).

``build_provenance`` is the one function that writes the record; ``train_recipe`` calls it and publishes
``provenance.json`` beside ``config.json`` and ``model.safetensors`` in the same manifest (so a reader never
sees a provenance of another run), and a later step (promotion) can call it again or copy the file.
The record (``FORMAT`` 1) holds:

- ``prompt_sources``: the prompt corpus generation (``prompt_corpus/index.json`` rolled forward through
  newer commits), its sources (URIs and counts as ingest recorded them) and each trained shard's staged
  object and sha256;
- ``partitions``: the shards trained on, and ``online`` (samples) or offline (hidden-state cache);
- ``target``: model path, sha256 of its ``config.json``, tokenizer path and hash, chat template hash and
  path, template kwargs, thinking mode, DFlash layer ids, mask token id, dtype, the spec's fingerprint;
- ``completions``: per trained shard, each ``config_hash`` found in ``completions/<shard>.parquet`` with its
  rows, served models and endpoints (the engine identity), and the sampling settings it hashes when one of
  the settings the caller knows (``generation_settings``) reproduces it (else ``settings: null``);
- ``recipe`` (and its fingerprint), ``objective`` (the training objective and its knob: dflash's gamma, dpace's
  alpha), ``code`` (module digests of the trainer and the versions of torch,
  transformers, safetensors and this package, plus the Dagster code versions the caller passes),
  ``checkpoint_files`` (sha256 of each published file), ``decontamination`` (``decontamination.py``'s report,
  as the caller ran it before training).

Reads the store (corpus index, completions Parquet) and the target's config and tokenizer; ``write_provenance``
writes one JSON file atomically (temp file, fsync, rename). ``read_provenance`` reads it from a checkpoint
directory or a store; ``format_provenance`` renders it for ``dflash inspect``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from dflash_assets.atomic_write import write_atomic
from dflash_assets.store import layout

__all__ = ["PROVENANCE_FILE", "FORMAT", "build_provenance", "target_identity", "prompt_sources",
           "completions_identity", "code_versions", "write_provenance", "read_provenance", "format_provenance",
           "provenance_summary"]

PROVENANCE_FILE = "provenance.json"
FORMAT = 1
TRAINER_MODULES = ("dflash_assets.drafter.training", "dflash_assets.drafter.model", "dflash_assets.drafter.loss",
                   "dflash_assets.drafter.data")
PACKAGES = ("torch", "transformers", "safetensors", "dflash-assets")


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def target_identity(spec: Any) -> dict[str, Any]:
    """The target a drafter was trained for (a ``TargetModelSpec``): loads its config and tokenizer."""
    facts = spec.validate()
    config_file = Path(spec.model_path) / "config.json"
    return {
        "model_path": spec.model_path,
        "config_sha256": file_sha256(config_file) if config_file.is_file() else None,
        "tokenizer_path": spec.resolved_tokenizer_path,
        "tokenizer_hash": facts.tokenizer_hash,
        "chat_template_hash": facts.template_hash,
        "chat_template_path": spec.chat_template_path,
        "chat_template_kwargs": dict(spec.chat_template_kwargs),
        "thinking": bool(facts.chat.thinking) if facts.chat is not None else False,
        "model_type": facts.model_type,
        "num_layers": facts.num_layers,
        "hidden_size": facts.hidden_size,
        "layer_ids": list(facts.layer_ids),
        "mask_token_id": facts.mask_token_id,
        "dtype": facts.dtype,
        "fingerprint": spec.config_fingerprint(),
        "generation_fingerprint": spec.generation_fingerprint(),  # in the completions' config_hash
    }


def prompt_sources(store: Any, shards: Sequence[str]) -> dict[str, Any]:
    """The corpus generation and its sources, and each trained shard's entry in it (None: not in the index)."""
    try:
        index = store.read_json(layout.corpus_index())
    except FileNotFoundError:
        return {"generation": None, "sources": {}, "shards": {s: None for s in shards},
                "note": "no prompt corpus index in the store (prompts not ingested through prompt_corpus)"}
    while True:  # the index copy can lag its commits (see prompts.corpus.load_corpus_index): roll forward
        try:
            index = store.read_json(layout.corpus_commit(int(index.get("generation", 0)) + 1))
        except FileNotFoundError:
            break
    entries = index.get("shards") or {}
    return {"generation": index.get("generation"), "run": index.get("run"),
            "sources": index.get("sources") or {},
            "shards": {s: entries.get(s) for s in shards}}


def completions_identity(store: Any, shards: Sequence[str], target_model: str,
                         generation_settings: Sequence[Mapping[str, Any]] = (),
                         target_fingerprint: str | None = None) -> dict[str, Any]:
    """Per shard: each ``config_hash`` of its completions with rows, served models, endpoints and (when one of
    ``generation_settings`` (``GenerationConfig`` fields) hashes to it for ``target_model``, with
    ``target_fingerprint`` or by the name alone, as rows of a remote engine are) the settings."""
    from dflash_assets.generation.engines import GenerationConfig

    known: dict[str, dict[str, Any]] = {}
    for settings in generation_settings:
        gen = GenerationConfig(**settings)
        for honoured in ((None,) if gen.seed is None else (True, False)):
            for fingerprint in {None, target_fingerprint}:
                known[gen.config_hash(target_model, honoured, fingerprint)] = {
                    **gen.model_dump(mode="json"), **({} if honoured is None else {"seed_honoured": honoured})}
    out: dict[str, Any] = {}
    for shard in shards:
        key = layout.completions(shard)
        if not store.exists(key):
            out[shard] = None
            continue
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = store.read_bytes(key)  # only the three identity columns are decoded, not the messages
        present = pq.read_schema(pa.BufferReader(data)).names
        rows = pq.read_table(pa.BufferReader(data), columns=[c for c in ("config_hash", "served_model", "endpoint")
                                                             if c in present]).to_pylist()
        groups: dict[str, dict[str, Any]] = {}
        for row in rows:
            h = row.get("config_hash") or "unknown"
            g = groups.setdefault(h, {"rows": 0, "served_models": set(), "endpoints": set()})
            g["rows"] += 1
            if row.get("served_model"):
                g["served_models"].add(row["served_model"])
            if row.get("endpoint"):
                g["endpoints"].add(row["endpoint"])
        out[shard] = {"rows": len(rows), "config_hashes": {
            h: {"rows": g["rows"], "served_models": sorted(g["served_models"]), "endpoints": sorted(g["endpoints"]),
                "settings": known.get(h)} for h, g in sorted(groups.items())}}
    return out


def code_versions(dagster: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Digests of the trainer's modules (and their project imports) and the package versions that made it."""
    from dflash_assets.cache_keys import build_fingerprint

    fp = build_fingerprint(modules=list(TRAINER_MODULES), packages=list(PACKAGES))
    return {"trainer": fp.digest, "modules": fp.inputs["modules"], "packages": fp.inputs["packages"],
            **({"dagster_code_versions": dict(dagster)} if dagster else {})}


def build_provenance(store: Any, recipe: Any, shards: Sequence[str], target: Any, *,
                     checkpoint_files: Mapping[str, str | os.PathLike] = (),
                     generation_settings: Sequence[Mapping[str, Any]] = (),
                     decontamination: Mapping[str, Any] | None = None,
                     dagster_code_versions: Mapping[str, Any] | None = None,
                     training: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of a checkpoint trained by ``recipe`` (a ``DrafterRecipe``) on ``shards`` against
    ``target`` (a ``TargetModelSpec``); ``checkpoint_files``: name -> local path of the files it describes."""
    return {
        "format": FORMAT,
        "recipe_name": recipe.name,
        "recipe": recipe.to_dict(),
        "recipe_fingerprint": recipe.fingerprint(),
        "objective": {"name": getattr(recipe, "objective", "dflash"),
                      **({"alpha": recipe.dpace_alpha} if getattr(recipe, "objective", "dflash") == "dpace"
                         else {"gamma": recipe.loss_gamma})},
        "partitions": {"shards": list(shards), "source": "tokenized_samples" if recipe.online else "hidden_state_cache"},
        "prompt_sources": prompt_sources(store, shards),
        "target": target_identity(target),
        "completions": completions_identity(store, shards, target.model_path, generation_settings,
                                            target.generation_fingerprint()),
        "code": code_versions(dagster_code_versions),
        "checkpoint_files": {name: file_sha256(path) for name, path in dict(checkpoint_files).items()},
        "training": dict(training or {}),
        "decontamination": dict(decontamination) if decontamination is not None else {
            "passed": None, "summary": "not run: the caller passed no decontamination result"},
    }


def write_provenance(path: str | os.PathLike, doc: Mapping[str, Any]) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    return write_atomic(path, json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")


def read_provenance(checkpoint: str | os.PathLike | None = None, *, store: Any = None,
                    recipe: str | None = None) -> dict[str, Any]:
    """``provenance.json`` of a checkpoint directory, or of a recipe's published checkpoint in ``store``."""
    if checkpoint is not None:
        path = Path(checkpoint)
        path = path / PROVENANCE_FILE if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no {PROVENANCE_FILE} in {checkpoint} (a checkpoint published before "
                                    f"provenance was recorded, or not a checkpoint directory)")
        return json.loads(path.read_text("utf-8"))
    if store is None or not recipe:
        raise ValueError("give a checkpoint directory, or a store and a recipe name")
    files = layout.drafter_checkpoint_files(store, recipe, (PROVENANCE_FILE,))
    if PROVENANCE_FILE not in files:
        raise FileNotFoundError(f"recipe {recipe!r} in {getattr(store, 'uri', store)} has no published "
                                f"{PROVENANCE_FILE} (not trained yet, or trained before provenance was recorded)")
    return json.loads(store.read_bytes(files[PROVENANCE_FILE]))


def provenance_summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Flat fields for asset metadata (the whole record is in the checkpoint's provenance.json)."""
    target = doc.get("target") or {}
    hashes = sorted({h for shard in (doc.get("completions") or {}).values() if shard
                     for h in shard.get("config_hashes", {})})
    decon = doc.get("decontamination") or {}
    return {
        "target_model": target.get("model_path"),
        "target_config_sha256": (target.get("config_sha256") or "")[:16],
        "tokenizer_hash": target.get("tokenizer_hash"),
        "chat_template_hash": target.get("chat_template_hash"),
        "thinking": target.get("thinking"),
        "corpus_generation": (doc.get("prompt_sources") or {}).get("generation"),
        "partitions_trained": len((doc.get("partitions") or {}).get("shards") or []),
        "completions_config_hashes": ", ".join(hashes),
        "trainer_code": (doc.get("code") or {}).get("trainer"),
        "objective": _objective_text(doc),
        "decontamination": decon.get("summary"),
    }


def _objective_text(doc: Mapping[str, Any]) -> str:
    """"dflash (gamma 7)" or "dpace (alpha 0.5)"; a record written before objectives were recorded trained dflash."""
    o = doc.get("objective") or {"name": "dflash", "gamma": (doc.get("recipe") or {}).get("gamma")}
    knob = "alpha" if o.get("name") == "dpace" else "gamma"
    return f"{o.get('name')} ({knob} {o.get(knob)})" if o.get(knob) is not None else str(o.get("name"))


def format_provenance(doc: Mapping[str, Any]) -> str:
    """A readable rendering of a provenance record (``dflash inspect``)."""
    lines = [f"recipe {doc.get('recipe_name')} (fingerprint {doc.get('recipe_fingerprint')}), "
             f"provenance format {doc.get('format')}"]
    t = doc.get("target") or {}
    lines += ["", "target:",
              f"  model        {t.get('model_path')}  (config.json sha256 {str(t.get('config_sha256'))[:16]})",
              f"  tokenizer    {t.get('tokenizer_path')}  (hash {t.get('tokenizer_hash')})",
              f"  template     hash {t.get('chat_template_hash')}  path {t.get('chat_template_path')}  "
              f"kwargs {json.dumps(t.get('chat_template_kwargs'))}",
              f"  thinking     {t.get('thinking')}",
              f"  layers       {t.get('layer_ids')} of {t.get('num_layers')}, hidden {t.get('hidden_size')}, "
              f"mask id {t.get('mask_token_id')}, dtype {t.get('dtype')}"]
    ps = doc.get("prompt_sources") or {}
    lines += ["", f"prompt corpus: generation {ps.get('generation')} (run {ps.get('run')})"]
    for name, src in sorted((ps.get("sources") or {}).items()):
        uri = src.get("uri") if isinstance(src, Mapping) else src
        lines.append(f"  source {name}: {uri}")
    parts = doc.get("partitions") or {}
    lines += ["", f"trained on {len(parts.get('shards') or [])} partitions ({parts.get('source')}): "
                  f"{', '.join(parts.get('shards') or [])}"]
    lines += ["", "completions (engine and sampling per config_hash):"]
    for shard, info in (doc.get("completions") or {}).items():
        if not info:
            lines.append(f"  {shard}: no completions file")
            continue
        for h, g in info.get("config_hashes", {}).items():
            settings = g.get("settings")
            said = (", ".join(f"{k}={v}" for k, v in settings.items() if k in (
                "temperature", "top_p", "top_k", "max_new_tokens", "enable_thinking", "seed"))
                    if settings else "settings unknown (not the deployment's)")
            lines.append(f"  {shard}: {h} x{g.get('rows')} by {', '.join(g.get('served_models') or ['?'])} "
                         f"at {', '.join(g.get('endpoints') or ['?'])}; {said}")
    r = doc.get("recipe") or {}
    lines += ["", "recipe: " + ", ".join(f"{k}={r[k]}" for k in (
        "version", "block_size", "num_layers", "epochs", "lr", "max_length", "seed", "online", "checkpoint_dtype")
        if k in r)] + [f"objective: {_objective_text(doc)}"]
    code = doc.get("code") or {}
    lines += [f"code: trainer {code.get('trainer')}; "
              + ", ".join(f"{k} {v}" for k, v in (code.get("packages") or {}).items())]
    for k, v in (code.get("dagster_code_versions") or {}).items():
        lines.append(f"  dagster {k}: {v}")
    lines += ["", "files:"] + [f"  {n}  sha256 {h}" for n, h in (doc.get("checkpoint_files") or {}).items()]
    d = doc.get("decontamination") or {}
    lines += ["", f"decontamination: {'passed' if d.get('passed') else 'FAILED' if d.get('passed') is False else 'not run'}"
                  f" - {d.get('summary')}"]
    for ex in d.get("examples") or []:
        lines.append(f"  {ex.get('kind')}: {ex.get('origin')} {ex.get('eval_id')} ~ {ex.get('shard')} "
                     f"{ex.get('train_id')}: {ex.get('eval_text')!r}")
    return "\n".join(lines)
