"""The demo's "plan vs run" lines: a comparison only where the run measured what the plan priced."""

from dflash_assets.demo import plan_checks

PLAN = {"generation_wall_s": 100.0}


def _completions(**per_shard):
    return {shard: {"wall_s": wall, "prompts_generated": generated, "prompts_resumed": resumed}
            for shard, (wall, generated, resumed) in per_shard.items()}


def test_a_run_that_generated_every_shard_is_compared(local_store):
    (check,) = plan_checks(PLAN, _completions(a=(30.0, 16, 0), b=(20.0, 16, 0)), local_store)
    assert check.ratio == 2.0
    assert check.line() == "  plan vs run: completions wall time predicted 100.0 s, measured 50.0 s (predicted/measured 2.00)"


def test_a_shard_skipped_after_a_failed_check_is_named(local_store):
    completions = {**_completions(a=(30.0, 16, 0)), "b": {}}
    (check,) = plan_checks(PLAN, completions, local_store)
    assert check.missing == ["b"] and "not measured: b (skipped after a failed check)" in check.line()


def test_a_second_run_that_reused_the_completions_is_not_compared(local_store):
    # a second `make demo`: every shard read back from the published table in a fraction of a second
    (check,) = plan_checks(PLAN, _completions(a=(0.2, 0, 16), b=(0.1, 0, 16)), local_store)
    assert check.reused == ["a", "b"] and check.ratio is None
    assert "predicted/measured" not in check.line()
    assert "not compared: the completions of 2 shard(s) (a, b) were reused from an earlier run" in check.line()
    # one shard regenerated (its config changed), one reused: still not a like-for-like comparison
    (mixed,) = plan_checks(PLAN, _completions(a=(40.0, 16, 0), b=(0.1, 0, 16)), local_store)
    assert mixed.reused == ["b"] and "not compared: the completions of 1 shard(s) (b)" in mixed.line()
