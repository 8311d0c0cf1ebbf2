"""The ratio checks decide on evidence: the rule itself, then the real checks on real samples.

The rule (`dflash_assets.quality_gates`): a ceiling check fails when the lower
bound of the 95% Wilson score interval of count/n exceeds its threshold, a
floor check when the upper bound is below its floor, and 0 samples fail.
The first half tests the interval and the rule in both directions; the
second runs `empty_response_ratio`, `thinking_ratio` and `truncation_ratio`
on samples tokenized with the real Qwen3.6 tokenizer and template, and the
quality gate the GPU stages obey.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pyarrow as pa
import pytest

from dflash_assets.quality_gates import CEILING, FLOOR, Z_95, ratio_gate, rule_in_words, wilson_interval
from dflash_assets.store import layout
from dflash_assets.tokenization.encoder import qwen3_6_encoder
from dflash_assets.tokenization.quality import (
    QualityGateFailed,
    QualityThresholds,
    evaluate_quality,
    publish_samples,
    require_quality_gate,
)
from dflash_assets.tokenization.samples import COMPLETIONS_MESSAGES_TYPE, TokenizeConfig, tokenize_completions

# -- the interval ----------------------------------------------------------------------------------------------


def test_z_is_the_two_sided_95_percent_quantile_of_the_normal():
    assert Z_95 == pytest.approx(NormalDist().inv_cdf(0.975), abs=1e-12)


@pytest.mark.parametrize("count,n", [(1, 23), (2, 23), (20, 23), (1, 2), (4, 5), (13, 100), (30, 1024), (1, 100000)])
def test_wilson_bounds_are_the_roots_of_the_score_equation(count, n):
    """Each bound p solves (count/n - p)^2 = z^2 p (1 - p) / n: the definition, checked without the formula."""
    lower, upper = wilson_interval(count, n)
    share = count / n
    assert 0.0 < lower < share < upper < 1.0
    for p in (lower, upper):
        assert (share - p) ** 2 == pytest.approx(Z_95 ** 2 * p * (1 - p) / n, rel=1e-9)


def test_wilson_interval_is_exact_at_the_ends_and_narrows_with_more_samples():
    assert wilson_interval(0, 23)[0] == 0.0 and wilson_interval(23, 23)[1] == 1.0  # no float residue
    widths = [(lambda lo, hi: hi - lo)(*wilson_interval(n // 10, n)) for n in (10, 100, 1000, 10000)]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 0.015


@pytest.mark.parametrize("count,n", [(0, 0), (1, 0), (-1, 5), (6, 5)])
def test_wilson_interval_refuses_impossible_counts(count, n):
    with pytest.raises(ValueError):
        wilson_interval(count, n)


# -- the rule, both directions ---------------------------------------------------------------------------------


def test_one_empty_answer_in_23_passes_and_two_fail():
    """1 of 23 (4.35%) against 2% is not evidence of a rate over 2%."""
    one = ratio_gate(1, 23, 0.02, CEILING)
    assert one.passed and one.ratio > 0.02 and one.bound < 0.02
    two = ratio_gate(2, 23, 0.02, CEILING)
    assert not two.passed and two.bound > 0.02


def test_87_percent_stubs_fail_at_every_shard_size_from_2_samples_up():
    """floor(0.87 n) stubs (the fewest an 87% rate gives) fail the 2% ceiling for every n from 2 on; at n = 1
    that is 0 stubs, so 2 is the smallest size. round() (1 stub of 1) fails too."""
    sizes = range(2, 20001)
    passed = [n for n in sizes if ratio_gate(math.floor(0.87 * n), n, 0.02).passed]
    assert passed == []
    assert ratio_gate(math.floor(0.87 * 1), 1, 0.02).passed  # 0 stubs of 1: nothing to fail on
    assert not ratio_gate(round(0.87 * 1), 1, 0.02).passed


def test_a_single_empty_answer_fails_only_a_tiny_shard():
    """With 1 empty answer the 95% lower bound is over 2% up to 8 samples and under it from 9 on: below 9
    samples one empty answer is itself a share of at least 11%."""
    fails = [n for n in range(1, 1000) if not ratio_gate(1, n, 0.02).passed]
    assert fails == list(range(1, 9))


def test_floor_checks_fail_when_the_upper_bound_is_below_the_floor():
    assert ratio_gate(18, 23, 0.9, FLOOR).passed  # 78% observed, but 23 samples do not show it is under 90%
    assert not ratio_gate(17, 23, 0.9, FLOOR).passed
    # the 87%-stub shard has reasoning in 13%: under a 90% floor from 3 samples up
    assert [n for n in range(1, 5001) if ratio_gate(n - math.floor(0.87 * n), n, 0.9, FLOOR).passed] == [1, 2]


def test_the_rule_decides_on_the_bound_not_on_the_observed_share():
    """At every (count, n) up to 200, a ceiling passes iff lower <= threshold and a floor iff upper >= floor;
    both directions occur where the observed share alone would decide otherwise."""
    flips = {"ceiling passes above": 0, "floor passes below": 0}
    for n in range(1, 201):
        for count in range(n + 1):
            lower, upper = wilson_interval(count, n)
            high, low = ratio_gate(count, n, 0.05, CEILING), ratio_gate(count, n, 0.9, FLOOR)
            assert high.passed == (lower <= 0.05) and low.passed == (upper >= 0.9)
            flips["ceiling passes above"] += high.passed and count / n > 0.05
            flips["floor passes below"] += low.passed and count / n < 0.9
    assert all(flips.values()), flips


def test_thresholds_at_the_ends():
    assert ratio_gate(0, 10, 0.0).passed and not ratio_gate(1, 100000, 0.0).passed  # 0: any count fails
    assert ratio_gate(50, 50, 1.0, FLOOR).passed and not ratio_gate(9999, 10000, 1.0, FLOOR).passed
    with pytest.raises(ValueError):
        ratio_gate(1, 10, 1.5)
    with pytest.raises(ValueError):
        ratio_gate(1, 10, 0.1, "at_most")


def test_zero_samples_fail_clearly():
    for kind in (CEILING, FLOOR):
        gate = ratio_gate(0, 0, 0.5, kind)
        assert not gate.passed and gate.ratio is None and gate.bound is None
        meta = gate.metadata()
        assert meta["n"] == 0 and meta["count"] == 0 and "ratio" not in meta and gate.bound_name not in meta
        assert gate.verdict().startswith("no samples to check")


def test_metadata_shows_the_evidence_and_the_rule():
    ceiling = ratio_gate(1, 23, 0.02).metadata()
    assert ceiling == {"n": 23, "count": 1, "ratio": round(1 / 23, 6),
                       "wilson_lower_95": round(wilson_interval(1, 23)[0], 6), "threshold": 0.02,
                       "rule": rule_in_words(CEILING, 0.02)}
    assert "lower bound of the 95% Wilson score interval" in ceiling["rule"] and "2.00%" in ceiling["rule"]
    floor = ratio_gate(17, 23, 0.9, FLOOR).metadata()
    assert floor["wilson_upper_95"] == round(wilson_interval(17, 23)[1], 6) and "wilson_lower_95" not in floor
    assert "upper bound" in floor["rule"] and "below the floor 90.00%" in floor["rule"]


def test_the_check_descriptions_examples_hold():
    """The Dagster check descriptions quote examples at the default thresholds; they follow from the rule."""
    from dagster_project.assets.tokenization import CHECK_DESCRIPTIONS

    assert "1 empty in 23 passes, 2 in 23 fail" in CHECK_DESCRIPTIONS["empty_response_ratio"]
    assert ratio_gate(1, 23, 0.02).passed and not ratio_gate(2, 23, 0.02).passed
    assert "87% stubs fail from 2 samples up" in CHECK_DESCRIPTIONS["empty_response_ratio"]
    assert "18 of 23 with reasoning passes, 17 of 23 fails" in CHECK_DESCRIPTIONS["thinking_ratio"]
    assert ratio_gate(18, 23, 0.9, FLOOR).passed and not ratio_gate(17, 23, 0.9, FLOOR).passed
    assert "3 cut in 23 pass, 4 in 23 fail" in CHECK_DESCRIPTIONS["truncation_ratio"]
    assert ratio_gate(3, 23, 0.05).passed and not ratio_gate(4, 23, 0.05).passed
    defaults = QualityThresholds()
    assert (defaults.max_empty_ratio, defaults.thinking_floor, defaults.truncation_ceiling) == (0.02, 0.9, 0.05)


# -- the real checks on real tokenized samples -----------------------------------------------------------------

REASONING = "Let me think about this step by step, carefully, and check the numbers twice before answering."
ANSWER = "Here is a complete answer with enough words in it to count as a real response to the question."


@pytest.fixture(scope="module")
def enc():
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

    return qwen3_6_encoder(build_qwen3_6_tokenizer(), strict=True)


def samples(enc, n: int, stubs: int = 0, without_reasoning: int = 0, long: int = 0) -> pa.Table:
    """n samples through the real tokenizer and template: the first `stubs` answer "OK." with no reasoning
    (a 6-token span), the next `without_reasoning` answer fully without reasoning, and the last `long` have
    an answer long enough to be cut at max_length 96."""
    convs = []
    for i in range(n):
        if i < stubs:
            reply = {"role": "assistant", "content": "OK.", "reasoning_content": ""}
        elif i < stubs + without_reasoning:
            reply = {"role": "assistant", "content": f"{ANSWER} ({i})", "reasoning_content": ""}
        else:
            content = f"{ANSWER} ({i}) " + (ANSWER * 4 if i >= n - long else "")
            reply = {"role": "assistant", "content": content, "reasoning_content": REASONING}
        convs.append([{"role": "user", "content": f"Question number {i}?", "reasoning_content": None}, reply])
    table = pa.table({"prompt_id": pa.array([f"p{i}" for i in range(n)]),
                      "messages": pa.array(convs, COMPLETIONS_MESSAGES_TYPE)})
    out, stats = tokenize_completions(table, enc, TokenizeConfig(max_length=96))
    assert out.num_rows == n and not stats.dropped
    return out


def test_one_stub_in_23_real_samples_passes_the_blocking_check_and_reaches_the_gpu(enc, local_store):
    table = samples(enc, 23, stubs=1)
    assert table.column("num_loss_tokens").to_pylist()[0] == 6  # `</think>\n\nOK.<|im_end|>\n`-like stub
    published = publish_samples(local_store, "shard-00001", table)
    empty = published.outcomes["empty_response_ratio"]
    assert empty.passed and empty.metadata["count"] == 1 and empty.metadata["n"] == 23
    assert empty.metadata["ratio"] > empty.metadata["threshold"] > empty.metadata["wilson_lower_95"]
    assert empty.description == ("1/23 samples (4.35%) have < 16 supervised tokens or an empty answer; not shown "
                                 "to be over the 2.00% threshold (95% lower bound 0.77%)")
    assert all(o.passed for o in published.outcomes.values())
    assert require_quality_gate(local_store, "shard-00001", published.sha256)["checks"]["empty_response_ratio"]["passed"]


@pytest.mark.parametrize("n,stubs", [(2, 1), (5, 4), (23, 20), (23, 2)])
def test_stub_shards_fail_the_blocking_check_and_the_gate_refuses_them(enc, local_store, n, stubs):
    """87% stubs at the smallest failing size (1 of 2), a handful (4 of 5), the demo's size (20 of 23); and
    2 of 23, the fewest that show a rate over 2% at that size."""
    shard = f"shard-{n:03d}-{stubs:03d}"
    published = publish_samples(local_store, shard, samples(enc, n, stubs=stubs))
    empty = published.outcomes["empty_response_ratio"]
    assert not empty.passed and empty.metadata["count"] == stubs and empty.metadata["wilson_lower_95"] > 0.02
    assert f"{stubs}/{n} samples" in empty.description and "over the 2.00% threshold with 95% confidence" in \
        empty.description
    with pytest.raises(QualityGateFailed, match="blocking checks failed \\(empty_response_ratio\\)"):
        require_quality_gate(local_store, shard)


def test_thinking_ratio_on_real_samples_both_directions(enc):
    passing = evaluate_quality(samples(enc, 23, without_reasoning=5))["thinking_ratio"]
    assert passing.passed and passing.metadata["count"] == 18 and passing.metadata["wilson_upper_95"] >= 0.9
    assert "not shown to be under the 90.00% floor" in passing.description
    failing = evaluate_quality(samples(enc, 23, without_reasoning=6))["thinking_ratio"]
    assert not failing.passed and failing.metadata["count"] == 17 and failing.metadata["wilson_upper_95"] < 0.9
    assert failing.description.startswith("17/23 samples (73.91%) have non-empty reasoning; under the 90.00% floor")
    stub_shard = evaluate_quality(samples(enc, 3, stubs=2))["thinking_ratio"]  # 87% stubs, 3 samples
    assert not stub_shard.passed


def test_truncation_ratio_on_real_samples_both_directions(enc):
    passing = evaluate_quality(samples(enc, 23, long=3))["truncation_ratio"]
    assert passing.passed and passing.metadata["count"] == 3 and passing.metadata["max_num_tokens"] == 96
    failing = evaluate_quality(samples(enc, 23, long=4))["truncation_ratio"]
    assert not failing.passed and failing.metadata["count"] == 4 and failing.metadata["wilson_lower_95"] > 0.05
    assert failing.metadata["examples"] == ["p19", "p20", "p21", "p22"]


def test_an_empty_partition_fails_every_ratio_check_and_says_so(enc, local_store):
    empty_table = samples(enc, 3).slice(0, 0)
    published = publish_samples(local_store, "shard-empty", empty_table)
    for name in ("empty_response_ratio", "thinking_ratio", "truncation_ratio"):
        outcome = published.outcomes[name]
        assert not outcome.passed and outcome.metadata["n"] == 0 and "ratio" not in outcome.metadata, name
        assert outcome.description.startswith("no samples to check"), name
    assert published.outcomes["schema"].passed
    with pytest.raises(QualityGateFailed, match="no samples to check"):
        require_quality_gate(local_store, "shard-empty")
    assert local_store.exists(layout.tokenized_samples("shard-empty"))  # kept for inspection
