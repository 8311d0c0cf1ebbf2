"""The SmolLM2 completions kept in ``bench/data/smollm2`` stay reusable by the next GPU session.

Generating them took about 16 minutes of an H200 (shards 0-5 in session 33, 6-7 in session 35);
``bench/smollm2_product.py --stage generate`` imports them by default, and the completions stage reuses a row only
under the same ``config_hash`` and prompt_id. These tests fail when a change would make the next session generate them
again without saying so: the bench's generation settings or the target's hashed name drifting from the kept hash, or
the prompt shards no longer holding their prompt ids. Reads the kept Parquet files, the embedded ShareGPT prompts and
the converted SmolLM2.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_assets.generation.config import normalize_model_id

REPO = Path(__file__).resolve().parents[2]
KEPT = REPO / "bench" / "data" / "smollm2"
MANIFEST = json.loads((KEPT / "MANIFEST.json").read_text())


def documented_generate_args(bench):
    """The generation-relevant flags of BENCHMARKS.md's generate command (engine flags change no row)."""
    return bench.build_parser().parse_args(["--stage", "generate", "--gguf", "unused", "--store", "unused",
                                            "--gen-dtype", "bfloat16", "--gen-cache", "static", "--max-turns", "2"])


def kept_files() -> list[Path]:
    return sorted((KEPT / "completions").glob("shard-*.parquet"))


def test_kept_shards_carry_the_hash_of_the_documented_generate_command(bench):
    args = documented_generate_args(bench)
    assert args.import_completions == [str(KEPT)]  # imported unless the user says otherwise
    generation = bench.generation_config(args, thinking=False)  # SmolLM2's template has no thinking mode
    dump, kept = generation.model_dump(mode="json"), MANIFEST["generation_config"]
    assert {k: dump[k] for k in kept} == kept
    assert all(v is None for k, v in dump.items() if k not in kept)  # fields added since: unset, so not hashed
    assert generation.config_hash(bench.STABLE_TARGET) == MANIFEST["config_hash"]
    assert [f.stem for f in kept_files()] == sorted(MANIFEST["shards"])
    for f in kept_files():
        table = pq.read_table(f, columns=["config_hash", "completion_tokens_total"])
        assert set(table.column("config_hash").to_pylist()) == {MANIFEST["config_hash"]}, f.name
        assert table.num_rows == MANIFEST["shards"][f.stem]["conversations"], f.name
        assert sum(table.column("completion_tokens_total").to_pylist()) == \
            MANIFEST["shards"][f.stem]["completion_tokens"], f.name


def test_stable_target_link_names_the_target_whatever_its_cache_key(bench, tmp_path):
    first, second = tmp_path / "smollm2-135m-instruct-0123456789abcdef", tmp_path / "smollm2-135m-instruct-fedcba"
    first.mkdir()
    second.mkdir()
    link = bench.stable_target_link(first)
    assert link.resolve() == first.resolve()
    assert bench.stable_target_link(second) == link and link.resolve() == second.resolve()  # replaced in place
    assert normalize_model_id(str(link)) == normalize_model_id(bench.STABLE_TARGET) == "smollm2-135m-instruct"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary link left


@pytest.fixture(scope="module")
def prompt_store(bench, tmp_path_factory) -> Path:
    """The raw_prompts store ``--prepare`` carries to the GPU host (t/store)."""
    from dflash_assets.store.backends import LocalStore

    path = tmp_path_factory.mktemp("prepared") / "store"
    bench.build_raw_prompts(LocalStore(path), num_prompts=24000, shard_size=2000)
    return path


def test_kept_rows_are_reused_by_the_completions_stage(bench, prompt_store, tmp_path):
    """--prepare's prompt shards hold every kept prompt id, and ``regenerate_shard`` over the imported shard
    generates nothing (an in-process SmolLM2 engine on the CPU stands ready and is not asked)."""
    import shutil

    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.generation.completions import regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    shutil.copytree(prompt_store, tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    shards = layout.list_raw_prompt_shards(store)
    for f in kept_files():
        assert f.stem in shards
        raw_ids = set(store.read_parquet(layout.raw_prompts(f.stem)).column("prompt_id").to_pylist())
        kept_ids = pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()
        assert set(kept_ids) <= raw_ids, f"{f.name}: kept prompt ids missing from the prompt shard"

    target = bench.stable_target_link(smollm2_target_path())
    spec = bench.target_spec(target)
    generation = bench.generation_config(documented_generate_args(bench), thinking=spec.thinking())
    imported = bench.import_completions([str(KEPT)], store, generation.config_hash(str(target)))
    assert [i["shard"] for i in imported] == sorted(MANIFEST["shards"]) and all(i["reused"] for i in imported)

    prompts = store.read_parquet(layout.raw_prompts("shard-00000")).slice(0, 12)
    fleet = EngineFleetConfig(target_model=str(target), endpoints=[EndpointConfig(
        url="inprocess://smollm2", kind="transformers", device="cpu", max_concurrency=4)])
    result = regenerate_shard(prompts, shard="shard-00000", store=store, fleet=fleet, generation=generation,
                              tokenizer=spec.load_tokenizer())
    assert result.stats.prompts_resumed_published == 12  # every row taken from the kept shard
    assert (result.stats.prompts_generated, result.stats.requests, result.stats.completion_tokens) == (0, 0, 0)


def test_generate_stage_publishes_and_exports_shard_by_shard(bench, prompt_store, tmp_path):
    """``--stage generate`` on the CPU with the kept shards imported: shard-00000's rows all reused (0 tokens),
    its samples published through the gate, and, before the stage moves on, ``trained_shards.json`` (what a
    ``--stage train`` started meanwhile reads). A shard taken whole from the kept ones is not exported again (every
    poll brings the exports back; the chain's test sees a generated shard exported)."""
    from dflash_assets.embedded.smollm2 import smollm2_gguf_path, smollm2_target_path

    work = tmp_path / "work"
    work.mkdir()
    (work / "targets").symlink_to(smollm2_target_path().parent)  # the converted SmolLM2, not converted again
    args = bench.build_parser().parse_args([
        "--stage", "generate", "--gguf", str(smollm2_gguf_path()), "--store", str(prompt_store), "--work", str(work),
        "--device", "cpu", "--max-turns", "2", "--gen-budget-s", "1", "--export-completions", str(tmp_path / "exp")])
    report = {"stage_wall_s": {}}
    engines_log = logging.getLogger("dflash_assets.generation.engines")
    level = engines_log.level
    try:
        bench.generate_stage(args, report)
    finally:
        engines_log.setLevel(level)  # the stage turns the engine's per-call log on for the process

    assert [i["shard"] for i in report["imported"]] == sorted(MANIFEST["shards"])
    assert all(i["reused"] for i in report["imported"])
    [row] = report["generation"]["shards"]  # the 1 s budget stops after the first shard
    assert row["shard"] == "shard-00000" and row["completions"]["completion_tokens"] == 0
    assert row["samples"]["samples"] > 2000 and all(row["gate"].values())
    assert json.loads((work / "trained_shards.json").read_text()) == ["shard-00000"]
    assert "exported" not in report and not (tmp_path / "exp" / "completions" / "shard-00000.parquet").exists()
    assert Path((work / "target_dir").read_text()).name == bench.STABLE_TARGET


def test_a_train_stage_beside_generation_waits_for_the_published_shards(bench, tmp_path):
    import threading

    path = tmp_path / "trained_shards.json"
    assert bench.wait_for_shards(path, 0, timeout_s=0) == []  # nothing generated yet, and not asked to wait
    writer = threading.Timer(0.3, lambda: bench.write_atomic(path, json.dumps(["shard-00000", "shard-00001"])))
    bench.write_atomic(path, json.dumps(["shard-00000"]))
    writer.start()
    try:
        assert bench.wait_for_shards(path, 2, timeout_s=30, poll_s=0.05) == ["shard-00000", "shard-00001"]
    finally:
        writer.join()
    with pytest.raises(SystemExit, match="lists 2 shards after 0 s, not 3"):
        bench.wait_for_shards(path, 3, timeout_s=0.2, poll_s=0.05)
