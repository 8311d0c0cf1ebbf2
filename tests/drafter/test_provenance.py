"""Provenance in every checkpoint and `dflash inspect`.

`build_provenance` on a store filled by the real ingest, with completions Parquet in the real schema whose
`config_hash` comes from `GenerationConfig.config_hash`; `dflash inspect` prints it from a directory and from the
store. The demo graph's own provenance (the session's tiny demo) is read in tests/test_end_to_end.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import dagster as dg
import pyarrow as pa
import pytest

from dflash_assets.cli import main as cli_main
from dflash_assets.drafter.provenance import (
    PROVENANCE_FILE,
    build_provenance,
    format_provenance,
    provenance_summary,
    read_provenance,
    write_provenance,
)
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.generation.completions import output_schema
from dflash_assets.generation.engines import GenerationConfig
from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.shards import materialize_prompt_shard
from dflash_assets.store import layout
from dflash_assets.store.manifest import publish_files
from dflash_assets.target_model.spec import TargetModelSpec


def completions_table(prompt_ids: list[str], config_hash: str, served_model: str, endpoint: str) -> pa.Table:
    now = datetime.now(timezone.utc)
    rows = [{"prompt_id": pid, "messages": [{"role": "user", "content": "q", "reasoning_content": None},
                                            {"role": "assistant", "content": "a", "reasoning_content": "r"}],
             "num_turns": 1, "finish_reasons": ["stop"], "prompt_tokens": [3], "completion_tokens": [4],
             "completion_tokens_total": 4, "turn_endpoints": [endpoint], "endpoint": endpoint,
             "served_model": served_model, "turn_latency_s": [0.1], "started_at": now, "finished_at": now,
             "generation_s": 0.1, "attempts": 1, "config_hash": config_hash} for pid in prompt_ids]
    return pa.Table.from_pylist(rows, schema=output_schema())


@pytest.fixture
def trained_store(local_store, tmp_path, tiny_dense_target):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Question {i} about tea?"}]})
                              + "\n" for i in range(6)))
    report = ingest_prompt_source(str(source), local_store, IngestConfig(max_prompts_per_shard=3))
    shards = sorted(report.shard_keys)
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    used = GenerationConfig(max_new_tokens=64, temperature=0.7, top_k=20, enable_thinking=True)
    for shard, (h, model) in zip(shards, [(used.config_hash(spec.model_path), "tiny"),
                                          ("feedfacefeedface", "other-model")]):
        table, _ = materialize_prompt_shard(local_store, shard)
        local_store.write_parquet(layout.completions(shard), completions_table(
            table.column("prompt_id").to_pylist(), h, model, "http://127.0.0.1:30000"))
    return local_store, shards, spec, used


def test_build_provenance_records_every_input(trained_store, tmp_path):
    store, shards, spec, used = trained_store
    recipe = DrafterRecipe(name="tea-v1", partitions=tuple(shards))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    doc = build_provenance(store, recipe, shards, spec,
                           checkpoint_files={"model.safetensors": tmp_path / "model.safetensors",
                                             "config.json": tmp_path / "config.json"},
                           generation_settings=[GenerationConfig().model_dump(mode="json"),
                                                used.model_dump(mode="json")],
                           decontamination={"passed": True, "summary": "clean"},
                           dagster_code_versions={"drafter_checkpoint": "1-abc"})
    assert doc["format"] == 1 and doc["recipe_name"] == "tea-v1" and list(doc["recipe"]["partitions"]) == shards
    assert doc["partitions"] == {"shards": shards, "source": "hidden_state_cache"}
    facts = spec.validate()
    t = doc["target"]
    assert (t["model_path"], t["tokenizer_hash"], t["chat_template_hash"]) == (
        spec.model_path, facts.tokenizer_hash, facts.template_hash)
    assert t["thinking"] is True and t["layer_ids"] == [1, 2, 3, 4, 5] and t["fingerprint"] == spec.config_fingerprint()
    assert len(t["config_sha256"]) == 64
    ps = doc["prompt_sources"]
    assert ps["generation"] == 1 and list(ps["shards"]) == shards and all(ps["shards"].values())
    assert [s["uri"] for s in ps["sources"].values()][0].endswith("prompts.jsonl")
    first, second = (doc["completions"][s] for s in shards)
    (h1, g1), = first["config_hashes"].items()
    assert h1 == used.config_hash(spec.model_path) and g1["rows"] == 3 and g1["served_models"] == ["tiny"]
    assert g1["settings"]["temperature"] == 0.7 and g1["settings"]["max_new_tokens"] == 64  # what the hash hashes
    assert second["config_hashes"]["feedfacefeedface"]["settings"] is None  # no known settings reproduce it
    import hashlib

    assert doc["checkpoint_files"]["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()
    assert doc["code"]["packages"]["torch"] and "dflash_assets.drafter.training" in doc["code"]["modules"]
    assert doc["code"]["dagster_code_versions"] == {"drafter_checkpoint": "1-abc"}
    assert doc["decontamination"]["passed"] is True
    summary = provenance_summary(doc)
    assert summary["completions_config_hashes"] == ", ".join(sorted([h1, "feedfacefeedface"]))  # sorted, as shown
    assert summary["partitions_trained"] == 2

    # written atomically (nothing else left in the directory), read back, printed
    out = tmp_path / "ckpt"
    out.mkdir()
    write_provenance(out / PROVENANCE_FILE, doc)
    assert [p.name for p in out.iterdir()] == [PROVENANCE_FILE]
    assert read_provenance(out) == json.loads(json.dumps(doc, default=str))
    text = format_provenance(doc)
    assert f"hash {facts.template_hash}" in text and "temperature=0.7" in text
    assert "settings unknown (not the deployment's)" in text and "decontamination: passed - clean" in text


def test_dflash_inspect_prints_a_directory_or_a_store_recipe(trained_store, tmp_path, capsys):
    store, shards, spec, _ = trained_store
    doc = build_provenance(store, DrafterRecipe(name="tea-v1"), shards, spec)
    path = write_provenance(tmp_path / PROVENANCE_FILE, doc)
    assert cli_main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recipe tea-v1") and f"trained on 2 partitions (hidden_state_cache): {shards[0]}" in out
    assert "decontamination: not run" in out

    publish_files(store, layout.drafter_checkpoint_manifest("tea-v1"), layout.drafter_checkpoint_prefix("tea-v1"),
                  {PROVENANCE_FILE: path})
    assert cli_main(["inspect", store.uri, "--recipe", "tea-v1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"]["model_path"] == spec.model_path

    assert cli_main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "no provenance.json" in capsys.readouterr().err
    assert cli_main(["inspect", store.uri, "--recipe", "never-trained"]) == 2
    assert "has no published provenance.json" in capsys.readouterr().err
