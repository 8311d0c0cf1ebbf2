"""The cost plan's arithmetic: seed numbers, FLOP scaling, the offline/online switch, the CLI."""

import json

import pytest

from dflash_assets.planning.costs import (
    DRAFTER_DEFAULTS,
    QWEN3_6_27B,
    QWEN3_8B,
    REFERENCE,
    CorpusShape,
    GenerationCost,
    TargetShape,
    plan_costs,
)

SEED = CorpusShape(conversations=914_000, tokens_per_sample=3_000)


def test_seed_cache_is_about_140_tb_and_over_a_50_tb_budget_means_online():
    plan = plan_costs(QWEN3_6_27B, SEED, budget_bytes=int(50e12))
    assert QWEN3_6_27B.bytes_per_token == 51_200  # 5 x 5120 x 2
    assert plan.hidden_bytes == 914_000 * 3_000 * 51_200  # 140.4 TB
    # ids (4 B), masks (1 B) per token, offsets and headers on top of the hidden states
    extra = 914_000 * 3_000 * 5
    assert plan.hidden_bytes + extra < plan.cache_bytes < plan.hidden_bytes + extra + 914_000 * 200
    assert 140e12 < plan.cache_bytes < 141e12
    assert plan.over_budget and plan.recommendation == "online"
    assert "exceeds the budget" in plan.reason and "online" in plan.markdown()
    meta = plan.to_metadata()
    assert meta["recommendation"] == "online" and meta["over_budget"] is True and meta["cache_tb"] == pytest.approx(140.4, abs=0.1)
    assert meta["captured_layers"] == "1,16,31,46,61" and meta["target_layers"] == 64


def test_recommendation_switches_at_the_budget():
    under = plan_costs(QWEN3_6_27B, SEED, budget_bytes=int(200e12))
    none = plan_costs(QWEN3_6_27B, SEED)
    edge = plan_costs(QWEN3_6_27B, SEED, budget_bytes=under.cache_bytes)  # exactly fits
    over = plan_costs(QWEN3_6_27B, SEED, budget_bytes=under.cache_bytes - 1)
    assert (under.recommendation, none.recommendation, edge.recommendation, over.recommendation) == (
        "offline", "offline", "offline", "online")
    assert "fits the budget" in under.reason and "no budget set" in none.reason
    # why offline: the target runs once instead of every epoch, so it costs fewer GPU-hours over several epochs
    assert under.offline_total_gpu_hours < under.online_total_gpu_hours


def test_gpu_hours_join_capture_and_training_as_the_brief_says():
    plan = plan_costs(QWEN3_8B, CorpusShape(1_000, 2_000), capture_tok_s=40_000, train_tok_s=20_000, epochs=3)
    tokens = 2_000_000
    assert plan.throughput_source == "given"
    assert plan.online_tok_s == pytest.approx(1 / (1 / 40_000 + 1 / 20_000))
    assert plan.capture_gpu_hours == pytest.approx(tokens / 40_000 / 3600)
    assert plan.offline_train_gpu_hours_per_epoch == pytest.approx(tokens / 20_000 / 3600)
    assert plan.online_train_gpu_hours_per_epoch == pytest.approx(plan.capture_gpu_hours
                                                                  + plan.offline_train_gpu_hours_per_epoch)
    assert plan.offline_total_gpu_hours == pytest.approx(plan.capture_gpu_hours + 3 * tokens / 20_000 / 3600)
    assert plan.online_total_gpu_hours == pytest.approx(3 * plan.online_train_gpu_hours_per_epoch)


def test_flops_reproduce_the_benchmarks_counts_and_scaling_returns_the_reference():
    # BENCHMARKS.md: capture runs 34 of 36 Qwen3-8B layers, 6.56 B weights; a 3072-token training sequence is
    # 71.8 TFLOP (drafter matmuls 48.2, lm_head 19.1, attention 3.5, fc 1.0)
    weights = sum(QWEN3_8B.layer_params(i) for i in range(QWEN3_8B.layers_run))
    assert QWEN3_8B.layers_run == 34 and weights / 1e9 == pytest.approx(6.56, abs=0.01)
    assert QWEN3_8B.train_flops_per_sequence(3072, 0.9 * 3072) / 1e12 == pytest.approx(71.8, rel=0.01)
    # at the reference's own shapes and lengths, scaling gives the measured figures back
    ref = plan_costs(QWEN3_8B, CorpusShape(10, REFERENCE.capture_seq_len))
    assert ref.capture_tok_s == pytest.approx(REFERENCE.capture_tok_s)
    train = plan_costs(QWEN3_8B, CorpusShape(10, 3072, supervised_per_sample=0.9 * 3072))
    assert train.train_tok_s == pytest.approx(REFERENCE.train_tok_s)
    # the 27B hybrid: ~23.5 B weights in the 62 layers a capture runs, so ~3.5x fewer tokens/s than Qwen3-8B
    big = plan_costs(QWEN3_6_27B, CorpusShape(10, 2048))
    assert QWEN3_6_27B.layers_run == 62
    assert 3.0 < REFERENCE.capture_tok_s / big.capture_tok_s < 4.0
    assert big.train_tok_s < train.train_tok_s  # a wider drafter and a 248K vocabulary
    # online at Qwen3-8B shapes, batch 2, was measured at 13,170 tok/s (0.99 of its joined rate)
    assert train.online_tok_s == pytest.approx(13_170, rel=0.03)
    assert train.online_tok_s == pytest.approx(1 / (1 / REFERENCE.online_capture_tok_s + 1 / REFERENCE.train_tok_s),
                                               rel=0.01)


def test_from_config_reads_a_transformers_config():
    from transformers import Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    dense = TargetShape.from_config(Qwen3Config(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                vocab_size=151_936))
    assert (dense.captured_layers, dense.layer_params(0)) == (QWEN3_8B.captured_layers, QWEN3_8B.layer_params(0))
    hybrid = TargetShape.from_config(Qwen3_5TextConfig(
        num_hidden_layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, vocab_size=248_320, linear_num_value_heads=48), name="Qwen3.6-27B")
    assert hybrid.captured_layers == QWEN3_6_27B.captured_layers and hybrid.layer_types == QWEN3_6_27B.layer_types
    assert hybrid.attn_output_gate
    assert [hybrid.layer_params(i) for i in (0, 3)] == [QWEN3_6_27B.layer_params(i) for i in (0, 3)]
    # ~26-27 B: 64 layers + embedding and lm_head
    total = sum(QWEN3_6_27B.layer_params(i) for i in range(64)) + 2 * 5120 * 248_320
    assert 25e9 < total < 28e9
    explicit = TargetShape.from_config({"text_config": {"num_hidden_layers": 8, "hidden_size": 64,
                                                        "intermediate_size": 128, "num_attention_heads": 4,
                                                        "vocab_size": 1000}}, [2, 5])
    assert explicit.captured_layers == (2, 5) and explicit.head_dim == 16 and explicit.bytes_per_token == 2 * 64 * 2


def test_generation_cost_from_a_pilot_and_a_throughput():
    from dflash_assets.planning.measurements import PilotMeasure

    pilot = PilotMeasure(prompts=4, done=4, failed=0, turns=8, completion_tokens=800, prompt_tokens=400,
                         wall_s=12.0, dispatch_s=8.0, concurrency=2, sample_tokens=1_200,
                         endpoint_tokens=(("http://a", 600), ("http://b", 200)))
    g = GenerationCost.from_pilot(pilot, prompts=40, partitions=2)
    assert g.wall_s == pytest.approx(40 * 8.0 / 4 + 2 * 4.0)  # the pilot's rate, plus its fixed cost per partition
    assert g.output_tokens == pytest.approx(40 * 200) and g.source == "pilot"
    assert [round(e.share, 2) for e in g.endpoints] == [0.75, 0.25]
    assert g.endpoints[0].tokens_per_s == pytest.approx(0.75 * g.tokens_per_s)
    plan = plan_costs(QWEN3_8B, CorpusShape(40, pilot.tokens_per_sample, 2.0, 100.0), generation=g)
    meta = plan.to_metadata()
    assert meta["generation_wall_s"] == round(g.wall_s, 1) and meta["tokens_per_sample"] == 300.0
    assert meta["generation_tokens_per_s[http://a]"] > meta["generation_tokens_per_s[http://b]"]
    given = GenerationCost.from_throughput(1_000.0, 914_000 * 3_000)
    assert given.wall_s == pytest.approx(2_742_000)


def test_drafter_defaults_follow_the_recipe():
    from dflash_assets.drafter.recipe import DrafterRecipe

    r = DrafterRecipe(name="x")
    assert DRAFTER_DEFAULTS == {"num_layers": r.num_layers, "block_size": r.block_size,
                                "max_anchors": r.max_anchors, "epochs": r.epochs}


def test_cli_prints_the_seed_plan(capsys):
    from dflash_assets.cli import main

    assert main(["plan", "--conversations", "914000", "--tokens-per-sample", "3000", "--target", "qwen3.6-27b",
                 "--budget-tb", "50", "--output-tokens-per-prompt", "3000", "--generation-tok-s", "2000"]) == 0
    out = capsys.readouterr().out
    assert "online training" in out and "140.4 TB" in out and "15.9 days" in out  # 2.742e9 tokens / 2,000 tok/s
    assert main(["plan", "--conversations", "1000", "--tokens-per-sample", "500", "--target", "qwen3-8b",
                 "--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["recommendation"] == "offline" and meta["corpus_tokens"] == 500_000
    with pytest.raises(SystemExit, match="needs the generated tokens"):
        main(["plan", "--conversations", "10", "--tokens-per-sample", "5", "--generation-tok-s", "9"])


def test_generation_plan_asset_shows_the_whole_cost_plan_from_a_pilot(tmp_path, tiny_dense_target):
    """Before any completions: a pilot of real prompts gives turns, lengths, tokens per sample and the wall time;
    the target's shapes come from its config; the budget switches the recommendation."""
    import dagster as dg
    from transformers import AutoConfig

    from dagster_project.definitions import defs
    from dagster_project.resources import EngineFleetResource, StoreResource
    from dflash_assets.embedded.defaults import default_target_spec
    from dflash_assets.hidden_states.format import estimate_partition_bytes
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from tests.support.sglang_loopback import LoopbackServer

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": f"Follow-up {i}"}]}) + "\n" for i in range(6)))
    plan_config = {"pilot_prompts": 4, "probe_requests": 4, "probe_max_new_tokens": 8,
                   "completions": {"max_new_tokens": 16, "max_turns": 2}}
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine:
        resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")),
                     "engines": EngineFleetResource(endpoints=[f"sglang:{engine.url}"], max_concurrency=2)}
        with dg.instance_for_test() as instance:
            dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                           run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
            (shard,) = instance.get_dynamic_partitions("prompt_shards")  # no raw_prompts run: the pilot reads the
            # committed corpus's shard
            runs = {}
            for name, budget in (("over", 1e-6), ("none", None)):
                result = dg.materialize(defs.assets, selection=["generation_plan"], instance=instance,
                                        resources=resources, run_config={"ops": {"generation_plan": {"config": {
                                            **plan_config, "cache_budget_gb": budget}}}})
                runs[name] = {k: v.value for k, v in
                              result.asset_materializations_for_node("generation_plan")[0].metadata.items()}
            assert engine.stats.last_body["sampling_params"]["max_new_tokens"] == 16  # the completions' config
    store = LocalStore(tmp_path / "store")
    assert not store.exists(layout.completions(shard)) and not store.list("completions")  # the pilot's is scratch
    assert not store.exists(layout.raw_prompts(shard))
    meta = runs["over"]
    assert meta["pilot_prompts"] == 4 and meta["pilot_done"] == 4
    assert (meta["generation_source"], meta["turns_source"], meta["output_tokens_source"],
            meta["tokens_per_sample_source"]) == ("pilot", "pilot", "pilot", "pilot + the corpus's prompt lengths")
    assert meta["turns_per_prompt"] == meta["pilot_turns_per_prompt"] and 1.0 <= meta["turns_per_prompt"] <= 2.0
    # the loopback answers at once: the pilot takes a few hundredths of a second, which the 0.1 s rounding of the
    # estimate can make 0.0 on a fast or warm run
    assert meta["estimated_wall_s"] == meta["generation_wall_s"] >= 0 and meta["pilot_wall_s"] > 0
    spec = default_target_spec()
    config = AutoConfig.from_pretrained(spec.model_path)
    assert (meta["target_layers"], meta["target_hidden"], meta["target_intermediate"], meta["target_vocab"]) == (
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size)
    assert meta["captured_layers"] == ",".join(map(str, spec.layer_ids()))
    assert meta["conversations"] == 6
    per_sample = meta["tokens_per_sample"]
    assert 16 < per_sample < 16 * 2 + 200  # the last turn's prompt (history re-sent) + its completion
    assert meta["bytes_per_token"] == len(spec.layer_ids()) * config.hidden_size * 4  # float32 on CPU
    assert meta["cache_bytes"] == pytest.approx(estimate_partition_bytes(
        round(6 * per_sample), 6, len(spec.layer_ids()), config.hidden_size, "float32"), rel=5e-3)  # per_sample is rounded
    assert meta["recommendation"] == "online" and meta["over_budget"] is True and meta["budget_gb"] == 0.0
    assert "exceeds the budget" in meta["plan"] and "| captured layers |" in meta["plan"]
    assert runs["none"]["recommendation"] == "offline" and "budget_gb" not in runs["none"]
    assert meta["capture_gpu_hours"] > 0 and meta["online_train_gpu_hours_per_epoch"] > meta["capture_gpu_hours"]
