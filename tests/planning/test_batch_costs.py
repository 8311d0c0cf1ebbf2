"""The in-process engine's cost plan: a generate call's cost model, the replay of a partition's calls, and that
the replay makes the calls the engine itself makes."""

import asyncio

import pyarrow as pa
import pytest

from dflash_assets.planning.batch_costs import (
    GenerateCost,
    GenerateSample,
    InprocessEstimate,
    calibration_shapes,
    continuing,
    expected_partition,
    expected_steps,
    padded_rows,
    partition_turns,
    simulate_partition,
)

COST = GenerateCost(call_s=0.04, prefill_token_s=1e-3, prefill_attention_s=1e-7, padded_prefill_attention_s=3e-7,
                    step_s=0.02, row_step_s=4e-3, cache_read_s=5e-6, padded_cache_read_s=8e-6)
UNIT = GenerateCost(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # one second a call, whatever its shape


def clocked(rows: int, width: int, steps: int, padded: bool, cost: GenerateCost = COST,
            slow_step: int | None = None) -> GenerateSample:
    """A call as ``time_generate`` would clock it if it cost exactly ``cost`` (``slow_step``: that decode step
    took 10 times as long, as when other work takes the CPU)."""
    prefill = cost.prefill_seconds(rows, width, padded)
    times, t = [0.3 * prefill], 0.3 * prefill  # the first token comes out of the prefill
    for j in range(1, steps):
        d = cost.step_seconds(rows, width + j, padded)
        t += d * (10 if j == slow_step else 1)
        times.append(t)
    return GenerateSample(rows, width, steps, prefill + (t - times[0]), padded, tuple(times))


def test_a_generate_call_costs_each_kind_of_work_once():
    # 4 rows of 100 prompt tokens (padded), 11 new tokens: 10 decode steps after the prefill's first token
    expected = (0.04  # the call
                + 1e-3 * 4 * 100  # prefill matmuls over 400 padded tokens
                + 3e-7 * 4 * 100 ** 2  # prefill attention under a mask, quadratic in the width
                + 0.02 * 10  # decode steps
                + 4e-3 * 4 * 10  # rows x steps
                + 8e-6 * 4 * 10 * (100 + 11 / 2))  # masked cache reads at the mean cache length
    assert COST.seconds(4, 100, 11) == pytest.approx(expected) == pytest.approx(0.84576)
    # one row: no padding, the unmasked attention terms
    assert COST.seconds(1, 100, 11) == pytest.approx(0.04 + 0.1 + 1e-7 * 1e4 + 0.2 + 0.04 + 5e-6 * 10 * 105.5)
    assert COST.seconds(4, 100, 1, padded=False) == pytest.approx(0.04 + 0.4 + 0.004)  # prefill only
    # the decode steps one by one add up to the formula's cache reads
    assert sum(COST.step_seconds(4, 100 + j, True) for j in range(1, 11)) == pytest.approx(
        COST.seconds(4, 100, 11) - COST.prefill_seconds(4, 100, True))


def test_the_fit_recovers_the_coefficients_from_clocked_calls():
    shapes = [(1, 64, 24, False), (16, 64, 1, True), (16, 373, 24, True), (1, 3498, 24, False),
              (2, 2821, 24, True)]
    fitted = GenerateCost.fit([clocked(*s) for s in shapes])
    for name in ("call_s", "prefill_token_s", "prefill_attention_s", "padded_prefill_attention_s", "step_s",
                 "row_step_s", "cache_read_s", "padded_cache_read_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(COST, name), rel=1e-6), name
    assert fitted.ratios() == pytest.approx([1.0] * len(shapes))
    # one decode step ten times as slow moves a median by one step, not the model by a tenth
    burst = GenerateCost.fit([clocked(*s, slow_step=5 if s[1] == 373 else None) for s in shapes])
    assert burst.row_step_s == pytest.approx(COST.row_step_s, rel=0.02)
    assert burst.seconds(16, 373, 48) == pytest.approx(COST.seconds(16, 373, 48), rel=0.01)
    # calls that would need a negative cost per token get 0 instead
    odd = GenerateCost.fit([GenerateSample(1, 64, 1, 0.5, False), GenerateSample(1, 640, 1, 0.4, False)])
    assert odd.prefill_token_s == 0 and odd.call_s > 0
    with pytest.raises(ValueError):
        GenerateCost.fit([])


def test_steps_of_a_call_follow_its_longest_row():
    # 2 rows, half the turns cut at 48: both stop early (a quarter of the time) at the stopped turns' mean, 20
    assert expected_steps(2, 48, 0.5, 20.0) == pytest.approx(48 * 0.75 + 20 * 0.25)
    assert expected_steps(16, 48, 1.0, 20.0) == 48 and expected_steps(3, 48, 0.0, 20.0) == 20


def test_conversations_go_on_by_chance_and_the_plan_is_the_mean_replay():
    import random

    turns = [[10, 20, 30], [11, 21], [12]]
    assert continuing(turns, 0.0, random.Random(0)) == [[10], [11], [12]]
    assert continuing(turns, 1.0, random.Random(0)) == [[10, 20, 30], [11, 21], [12]]
    rng = random.Random(1)
    draws = [continuing(turns, 0.25, rng) for _ in range(4000)]
    assert all(d[0][0] == 10 and d[2] == [12] for d in draws)  # the first turn always, no turn past the last
    assert sum(len(d[1]) == 2 for d in draws) / 4000 == pytest.approx(0.25, abs=0.03)
    assert sum(len(d[0]) == 3 for d in draws) / 4000 == pytest.approx(0.25 ** 2, abs=0.02)  # on past two turns
    # one conversation of two turns, one second a call: 1 call, and a second one with chance 1/4
    one = expected_partition([[100, 200]], UNIT, share=0.25, draws=4000, seed=3, workers=4, max_rows=4,
                             max_tokens=1000, steps=lambda rows: 8.0)
    assert one.replays == 4000 and one.seconds == pytest.approx(1.25 * 1.005, rel=0.03)
    again = expected_partition([[100, 200]], UNIT, share=0.25, draws=4000, seed=3, workers=4, max_rows=4,
                               max_tokens=1000, steps=lambda rows: 8.0)
    assert again.seconds == one.seconds  # seeded: the same inputs, the same plan
    certain = expected_partition([[100, 200]], UNIT, share=0.0, workers=4, max_rows=4, max_tokens=1000,
                                 steps=lambda rows: 8.0)
    assert certain.replays == 1 and certain.seconds == pytest.approx(1.005)


def test_a_partition_replays_the_engines_batching_rule():
    turns = [[100], [110], [3000], [120, 400]]
    sim = simulate_partition(turns, UNIT, workers=32, max_rows=32, max_tokens=1000, steps=lambda rows: 8.0)
    # the oldest (100) and the closest in length while 3 x 120 fits 1000 tokens; 3000 alone; then the second turn
    assert [(r, w) for r, w, _, _ in sim.calls] == [(3, 120), (1, 3000), (1, 400)]
    assert sim.seconds == pytest.approx(3 * (1.0 + 0.005))
    # two workers: the third conversation starts only when a call ends
    two = simulate_partition(turns, UNIT, workers=2, max_rows=32, max_tokens=1000, steps=lambda rows: 8.0)
    assert [(r, w) for r, w, _, _ in two.calls] == [(2, 110), (1, 3000), (1, 120), (1, 400)]
    priced = simulate_partition([[100], [110]], COST, workers=32, max_rows=32, max_tokens=1000,
                                steps=lambda rows: 11.0)
    assert priced.seconds == pytest.approx(COST.seconds(2, 110, 11, padded=True) + 0.005)
    even = simulate_partition([[100], [100]], COST, workers=32, max_rows=32, max_tokens=1000, steps=lambda rows: 11.0)
    assert even.seconds == pytest.approx(COST.seconds(2, 100, 11, padded=False) + 0.005)  # no padding, no mask


def test_calibration_spans_the_runs_shapes_padded_as_the_run_pads():
    shapes = calibration_shapes(3498, (16, 373), 2821, steps=24, max_tokens=8192)
    assert shapes == [(1, 64, 24), (16, 64, 1), (16, 373, 24), (1, 3498, 24), (2, 2821, 24)]
    # a prompt longer than a call's token budget is calibrated at the budget; rows x width stays within it
    assert calibration_shapes(20_000, (32, 400), 6000, steps=16, max_tokens=8192)[2:] == [
        (32, 256, 16), (1, 8192, 16), (2, 4096, 16)]
    assert calibration_shapes(500, (1, 500), None, steps=8) == [(1, 64, 8), (1, 64, 1), (1, 500, 8)]  # one row
    rows = padded_rows([1, 2, 3], 5, 20)
    assert [len(r) for r in rows] == [20, 18, 15, 13, 10] and rows[0][:4] == [1, 2, 3, 1]
    assert padded_rows([7], 1, 4) == [[7, 7, 7, 7]]


def test_the_estimate_adds_the_partitions_fixed_cost_to_the_calls():
    from dflash_assets.planning.costs import GenerationCost
    from dflash_assets.planning.measurements import PilotMeasure

    estimate = InprocessEstimate("engine", COST, partitions=3, simulated=3, calls_s=60.0, calls=9, fixed_s=0.5,
                                 continue_share=0.2, at_cap_share=0.8, answer_tokens=40.0, pilot_modelled_s=2.0,
                                 pilot_dispatch_s=2.2)
    assert estimate.wall_s == pytest.approx(60.0 + 3 * 0.5)
    pilot = PilotMeasure(prompts=4, done=4, failed=0, turns=5, completion_tokens=200, prompt_tokens=400, wall_s=3.0,
                         dispatch_s=2.5, concurrency=32)
    g = GenerationCost.from_inprocess(estimate, pilot, prompts=48, endpoint="inprocess://m")
    assert g.wall_s == pytest.approx(61.5) and g.output_tokens == pytest.approx(48 * 50)
    assert g.tokens_per_s == pytest.approx(48 * 50 / 61.5) and g.source == "pilot + engine model"
    meta = estimate.to_metadata()
    assert meta["engine_calls_s"] == 60.0 and meta["engine_fixed_s_per_partition"] == 0.5
    assert meta["generation_engine"] == "engine" and meta["engine_cost_padded_cache_read_s"] == 8e-6


def test_the_replay_makes_the_calls_the_in_process_engine_makes(tiny_dense_target, tmp_path):
    """Real prompts of several lengths through the completions stage on the in-process engine: the calls the plan
    replays from the prompts' rendered lengths are the calls the engine made, row for row and width for width."""
    from transformers import AutoTokenizer

    from dflash_assets.generation.chat_tokenizer import ChatTokenizer
    from dflash_assets.generation.completions import aregenerate_shard
    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, build_engine
    from dflash_assets.store.backends import LocalStore

    tok = AutoTokenizer.from_pretrained(str(tiny_dense_target))
    rows = [{"prompt_id": f"p{i}", "system": "Be brief." if i % 3 == 0 else None,
             "user_turns": [("word " * (3 + 9 * ((i * 7) % 10))).strip()], "num_user_turns": 1} for i in range(10)]
    ep = EndpointConfig(url="inprocess://tiny", kind="transformers", max_concurrency=16, max_batch_rows=4,
                        max_batch_tokens=300)
    fleet = EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[ep])
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, max_turns=1, enable_thinking=False)
    engine = build_engine(ep, fleet, tok)
    asyncio.run(aregenerate_shard(pa.Table.from_pylist(rows), shard="s", store=LocalStore(tmp_path), fleet=fleet,
                                  generation=gen, tokenizer=tok, engines=[engine]))
    turns = partition_turns(rows, ChatTokenizer(tok), max_turns=1, enable_thinking=False, answer_tokens=0.0)
    sim = simulate_partition(turns, UNIT, workers=16, max_rows=4, max_tokens=300,
                             steps=lambda n: 3.0)
    assert len(engine.batch_shapes) >= 3  # the limits split the ten prompts
    assert [(r, w) for r, w, _, _ in sim.calls] == engine.batch_shapes


def test_plan_corpus_on_an_in_process_engine_replays_and_prices_its_calls(tiny_dense_target, tmp_path):
    """A fleet of one in-process engine: the plan's wall time is the replayed calls priced by the timed model plus
    the pilot's per-partition cost outside its calls, and the metadata names the engine and how it was measured."""
    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.planning.stage import plan_corpus
    from dflash_assets.prompts.ingest import ingest_prompt_source, materialize_prompt_shard
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"messages": [{{"role": "user", "content": "Prompt {i} {"long " * (i * 20)}"}}]}}\n'
                              for i in range(6)))
    store = LocalStore(tmp_path / "store")
    (shard,) = ingest_prompt_source(str(source), store).shard_keys
    materialize_prompt_shard(store, shard)
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    fleet = EngineFleetConfig(target_model=spec.model_path, endpoints=[
        EndpointConfig(url="inprocess://tiny", kind="transformers", max_concurrency=8, max_batch_tokens=256)])
    generation = GenerationConfig(max_new_tokens=4, enable_thinking=spec.thinking())
    meta = plan_corpus(store, spec, fleet, generation=generation, pilot_prompts=2).metadata
    assert meta["generation_source"] == "pilot + engine model"
    assert meta["generation_engine"].startswith("transformers in-process") and "256 padded" in meta["generation_engine"]
    assert meta["engine_partitions_replayed"] == 1 and meta["engine_generate_calls"] >= 2  # 256 tokens split them
    # the calibration calls, each with its modelled/timed ratio, the calls of several rows padded
    assert meta["engine_cost_calls"].count(" s (model ") >= 4 and " padded: " in meta["engine_cost_calls"]
    assert meta["generation_wall_s"] == pytest.approx(
        meta["engine_calls_s"] + meta["engine_fixed_s_per_partition"], abs=0.11)


def test_time_generate_clocks_every_step_of_a_call_without_stop_ids(tiny_dense_target):
    from transformers import AutoTokenizer

    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.engines import TransformersEngine

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=AutoTokenizer.from_pretrained(
                str(tiny_dense_target))) as engine:
            return await engine.time_generate(padded_rows([5, 6, 7], 3, 40), GenerationConfig(max_new_tokens=6)), \
                engine.batch_shapes

    (seconds, steps, times), shapes = asyncio.run(go())
    assert steps == 6 and len(times) == 6 and shapes == [(3, 40)]  # no stop id: every step runs
    assert all(b > a for a, b in zip(times, times[1:])) and 0 < times[0] and times[-1] < seconds
    sample = GenerateSample(3, 40, steps, seconds, True, tuple(times))
    assert sample.prefill_s == pytest.approx(seconds - (times[-1] - times[0]))
    # decode steps 1-2 over caches of 41-42 positions, steps 3-5 over 43-45: one median per half
    assert [round(c, 1) for c, _ in sample.step_points()] == [41.5, 44.0]
