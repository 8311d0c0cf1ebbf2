"""``bench/smollm2_product.py --resample NAME``: the kept shards' prompts generated again as new partitions.

One store keeps one generation config per partition, so sampled answers to the prompts that already have kept greedy
answers go into copies of their raw_prompts shards (``resample-NAME-<shard>``). These tests check that a copy holds
the same prompts under its own partition name, that the held-out shard stays the last ``shard-*`` one whatever copies
exist, that the evaluation's held-out selection still finds it, and that a second generate stage adds its shards to
those the first published instead of replacing them. Reads and writes a local store of the embedded ShareGPT prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_assets.drafter.decontamination import heldout_selection
from dflash_assets.store import layout
from dflash_assets.store.backends import LocalStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def store(bench, tmp_path):
    store = LocalStore(tmp_path / "store")
    assert bench.build_raw_prompts(store, 12, 4) == ["shard-00000", "shard-00001", "shard-00002"]
    return store


def test_a_copy_holds_the_same_prompts_under_its_own_partition(bench, store):
    copy = bench.copy_prompt_shard(store, "shard-00000", bench.resample_shard_name("shard-00000", "t07"))
    assert copy == "resample-t07-shard-00000"
    original = store.read_parquet(layout.raw_prompts("shard-00000"))
    copied = store.read_parquet(layout.raw_prompts(copy))
    assert copied.schema == original.schema
    assert set(copied.column("shard").to_pylist()) == {copy}
    assert copied.drop(["shard"]).equals(original.drop(["shard"]))


def test_the_held_out_shard_stays_the_last_one_beside_copies(bench, store):
    for shard in ("shard-00000", "shard-00001"):
        bench.copy_prompt_shard(store, shard, bench.resample_shard_name(shard, "t07"))
    listed = layout.list_raw_prompt_shards(store)
    assert listed[-1] == "shard-00002" and len(listed) == 5
    # the evaluation holds out what the recipe did not train on: originals and copies trained, the last shard not
    trained = [s for s in listed if s != "shard-00002"]
    selection = heldout_selection(store, trained, 4)
    assert selection.held_out
    heldout_ids = set(store.read_parquet(layout.raw_prompts("shard-00002")).column("prompt_id").to_pylist())
    assert selection.ids and selection.ids <= heldout_ids


def test_a_second_generate_stage_adds_to_the_published_shards(bench, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    assert bench.published_shards(work, ["shard-00000"]) == ["shard-00000"]  # no earlier stage: its own only
    (work / "trained_shards.json").write_text(json.dumps(["shard-00000", "shard-00001"]))
    assert bench.published_shards(work, ["resample-t07-shard-00000", "shard-00001"]) == [
        "shard-00000", "shard-00001", "resample-t07-shard-00000"]


def test_the_flag_reaches_the_generate_stage(bench):
    args = bench.build_parser().parse_args(["--stage", "generate", "--gguf", "g", "--store", "s",
                                            "--resample", "t07", "--temperature", "0.7"])
    assert args.resample == "t07" and args.temperature == 0.7
    assert bench.build_parser().parse_args(["--stage", "generate"]).resample is None


SAMPLED = REPO / "bench" / "data" / "smollm2-sampled"


def documented_resample_args(bench):
    """The generation-relevant flags of the GPU chain's resample stage (RESAMPLE=t07, its default flags)."""
    return bench.build_parser().parse_args(["--stage", "generate", "--gguf", "unused", "--store", "unused",
                                            "--max-turns", "2", "--resample", "t07", "--temperature", "0.7",
                                            "--import-completions", str(SAMPLED)])


def test_the_kept_sampled_shards_carry_the_hash_of_the_chains_resample_stage(bench):
    import pyarrow.parquet as pq

    manifest = json.loads((SAMPLED / "MANIFEST.json").read_text())
    generation = bench.generation_config(documented_resample_args(bench), thinking=False)
    dump, kept = generation.model_dump(mode="json"), manifest["generation_config"]
    assert {k: dump[k] for k in kept} == kept
    assert all(v is None for k, v in dump.items() if k not in kept)  # fields added since: unset, so not hashed
    # a seed the in-process engine cannot make reproducible is hashed as such (the completions stage probes it)
    assert generation.config_hash(bench.STABLE_TARGET, seed_honoured=False) == manifest["config_hash"]
    chain = (REPO / "bench" / "smollm2_gpu_chain.sh").read_text()
    assert "--import-completions bench/data/smollm2-sampled" in chain and '"--temperature 0.7"' in chain
    files = sorted((SAMPLED / "completions").glob("*.parquet"))
    assert [f.stem for f in files] == sorted(manifest["shards"])
    for f in files:
        assert f.stem.startswith(f"{bench.RESAMPLE_PREFIX}{manifest['resample']}-shard-")
        table = pq.read_table(f, columns=["config_hash", "completion_tokens_total"])
        assert set(table.column("config_hash").to_pylist()) == {manifest["config_hash"]}
        assert table.num_rows == manifest["shards"][f.stem]["conversations"]
        assert sum(table.column("completion_tokens_total").to_pylist()) == manifest["shards"][f.stem]["completion_tokens"]


def test_the_kept_sampled_rows_are_reused_under_the_copied_partition(bench, tmp_path):
    """Imported, then generated again through ``--resample``'s copy of shard-00000: every row reused, nothing asked
    of the in-process SmolLM2 engine (on the CPU), the seed probed as not honoured like on the GPU."""
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.generation.completions import regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig

    store = LocalStore(tmp_path / "store")
    bench.build_raw_prompts(store, num_prompts=24000, shard_size=2000)
    target = bench.stable_target_link(smollm2_target_path())
    spec = bench.target_spec(target)
    args = documented_resample_args(bench)
    generation = bench.generation_config(args, thinking=spec.thinking())
    imported = bench.import_completions(args.import_completions, store, generation.config_hash(str(target), False))
    assert [i["shard"] for i in imported] == ["resample-t07-shard-00000"] and imported[0]["reused"]

    copy = bench.copy_prompt_shard(store, "shard-00000", bench.resample_shard_name("shard-00000", args.resample))
    prompts = store.read_parquet(layout.raw_prompts(copy)).slice(0, 8)
    fleet = EngineFleetConfig(target_model=str(target), endpoints=[EndpointConfig(
        url="inprocess://smollm2", kind="transformers", device="cpu", max_concurrency=4)])
    result = regenerate_shard(prompts, shard=copy, store=store, fleet=fleet, generation=generation,
                              tokenizer=spec.load_tokenizer())
    assert result.stats.seed_effect == "ignored"
    assert result.stats.prompts_resumed_published == 8
    assert (result.stats.prompts_generated, result.stats.requests, result.stats.completion_tokens) == (0, 0, 0)
