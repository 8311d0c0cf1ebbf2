"""The preflight: the demo's recipe memorizes a handful of its samples and decodes them at tau = B, losslessly;
a label shifted by one and wrong target layers fail it, each with per-position accuracy and what to look at."""

from __future__ import annotations

import pytest
import torch

from dflash_assets.drafter import loss
from dflash_assets.drafter.preflight import MEMORIZED, PreflightFailed, perfect_tau, preflight_recipe, run_preflight
from dflash_assets.drafter.recipe import DrafterRecipe
from tests.drafter.test_training import mini, mini_recipe  # noqa: F401


def test_perfect_tau_counts_the_prefill_token_apart():
    assert perfect_tau(9, 8) == 8.0  # the prefill's token, then one verification of the whole block
    assert perfect_tau(17, 8) == 8.0 and perfect_tau(12, 8) == pytest.approx(11 / 2)


def test_the_preflight_recipe_keeps_what_must_be_proven():
    r = DrafterRecipe(name="x-v1", num_layers=3, block_size=10, target_layer_ids=(1, 4), mask_token_id=7,
                      objective="dpace", online=True, partitions=("shard-00000",), epochs=6, batch_size=8)
    p = preflight_recipe(r, samples=2, steps=50, lr=1e-3)
    assert (p.num_layers, p.block_size, p.target_layer_ids, p.mask_token_id, p.objective) == (3, 10, (1, 4), 7, "dpace")
    assert (p.epochs, p.batch_size, p.online, p.partitions, p.tau_prompts) == (50, 2, False, (), 0)


@pytest.mark.parametrize("objective", ["dpace", "dflash"])
def test_the_mini_recipe_passes(mini, objective):
    res = run_preflight(mini_recipe(objective=objective), [mini["cache"]], mini["target_dir"], device="cpu")
    assert res.passed and res.lossless and res.tau == res.tau_max == 8.0, res.to_metadata()
    # training stops once the set is memorized: every prompt decoded at tau = B, well before the 200 steps at most
    # (dpace weighs a position by the chance a draft survives to it: the block's last positions come right last)
    train = res.train_accuracy_by_position
    assert sum(train) / len(train) >= MEMORIZED and res.steps < 200 and res.problems == [], res.to_metadata()
    assert res.layer_ids == {"data": [1, 3], "drafter": [1, 3]}


def test_a_label_shifted_by_one_fails_and_names_the_labels(mini, monkeypatch):
    right = loss.block_labels

    def shifted(input_ids, loss_mask, anchors, keep, block_size, gamma):  # label k = token anchor + k + 1
        labels, w = right(input_ids, loss_mask, anchors + 1, keep, block_size, gamma)
        return labels, w

    monkeypatch.setattr(loss, "block_labels", shifted)
    res = run_preflight(mini_recipe(), [mini["cache"]], mini["target_dir"], device="cpu")
    assert not res.passed and res.tau < 3.0, res.to_metadata()
    train = res.train_accuracy_by_position
    assert sum(train) / len(train) > 0.95  # it learned the labels it was given
    forced = res.forced_accuracy_by_position  # against the next tokens (the mini target repeats itself at times)
    assert sum(forced) / len(forced) < 0.75
    assert "loss.block_labels" in res.problems[0], res.problems
    with pytest.raises(PreflightFailed, match="block_labels"):
        raise PreflightFailed(res)


def test_wrong_target_layers_fail_and_name_the_layers(mini):
    """The recipe names layers 2, 4; its cache holds layers 1, 3."""
    res = run_preflight(mini_recipe(target_layer_ids=(2, 4)), [mini["cache"]], mini["target_dir"], device="cpu")
    assert not res.passed, res.to_metadata()
    assert res.layer_ids == {"data": [1, 3], "drafter": [2, 4]}
    assert res.features["nearest"] == [1, 3] and not res.features["matches"]
    assert "the cached features are the target's layers [1, 3]" in res.problems[0], res.problems
    assert "the drafter takes [2, 4]" in res.problems[0]


def test_a_capture_off_by_one_layer_fails(mini, tmp_path):
    """A cache whose header says layers 1, 3 but holds HF hidden_states[1] and [3] (the outputs of layers 0 and 2:
    layer id i is hidden_states[i + 1])."""
    from dflash_assets.hidden_states.format import SafetensorsStreamWriter, ShardMetadata, shard_tensor_specs

    target, seqs = mini["target"], mini["seqs"][:4]
    H, T = target.config.hidden_size, sum(len(ids) for ids, _ in seqs)
    meta = ShardMetadata(target_model="test", layer_ids=(1, 3), dtype="float32", hidden_size=H,
                         prompt_ids=tuple(f"p{i}" for i in range(len(seqs))))
    path, cu = tmp_path / "off-by-one.safetensors", [0]
    with SafetensorsStreamWriter(path, shard_tensor_specs(T, len(seqs), 2, H, torch.float32), meta.to_header(),
                                 fsync=False) as w:
        for ids, lm in seqs:
            with torch.no_grad():
                hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            w.write("hidden", torch.cat([hs[i][0] for i in (1, 3)], -1).contiguous())  # planted: hs[i], not hs[i + 1]
            w.write("input_ids", torch.tensor(ids, dtype=torch.int32))
            w.write("loss_mask", torch.tensor(lm, dtype=torch.uint8))
            cu.append(cu[-1] + len(ids))
        w.write("cu_seqlens", torch.tensor(cu, dtype=torch.int64))
    res = run_preflight(mini_recipe(), [path], mini["target_dir"], device="cpu")
    assert not res.passed and res.features["nearest"] == [0, 2], res.to_metadata()
    assert "layer id i is the output of decoder layer i" in res.problems[0]


def test_train_recipe_stops_before_the_long_run_and_leaves_the_report(mini, tmp_path):
    """train_recipe(preflight=True) on a recipe whose layers are not its cache's: PreflightFailed before any
    training step, the report in the store under this run's id, nothing published; the check reads it."""
    from dflash_assets.drafter.checkpoint_checks import preflight_outcome, preflight_report
    from dflash_assets.drafter.preflight import PreflightFailed
    from dflash_assets.drafter.stages import preflight_key, save_recipe, train_recipe
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec
    from tests.drafter.test_model import publish_cache

    store = LocalStore(tmp_path / "store")
    publish_cache(store, mini["cache"])
    save_recipe(store, mini_recipe(name="mini-v1", partitions=("shard-00000",), target_layer_ids=(2, 4),
                                   tau_prompts=0, compile=False))
    with pytest.raises(PreflightFailed, match="the cached features are the target's layers"):
        train_recipe(store, "mini-v1", TargetModelSpec(model_path=str(mini["target_dir"]), dtype="float32"),
                     work_dir=str(tmp_path / "work"), device="cpu", preflight=True, preflight_run="run-1")
    report = store.read_json(preflight_key("mini-v1"))
    assert report["run"] == "run-1" and report["passed"] is False and report["layer_ids"]["drafter"] == [2, 4]
    assert not store.list("drafter_checkpoint") and not list((tmp_path / "work").glob("*/state"))
    assert preflight_report(store, "mini-v1", "run-2") is None  # another run's report is not this run's
    check = preflight_outcome(preflight_report(store, "mini-v1", "run-1"), True)
    assert check.passed is False and "cached features" in check.metadata["summary"]
    assert preflight_outcome(None, False).severity == "WARN"
