"""``bench/decode_op_counts.py``: the operators one speculative verification issues against one target token.

Run on the tiny target with untrained drafters of 1 and 2 layers: speculative decoding stays lossless (the bench
checks it), every region is counted, a second drafter layer adds its operators to the drafter's count and not
to the target's, and the prediction is tau x (operators per target token / operators per verification).
"""

from __future__ import annotations

import json

import pytest



def run(op_counts, target, tmp_path, layers: int) -> dict:
    out = tmp_path / f"ops-{layers}.json"
    assert op_counts.main(["--target", str(target), "--layers", str(layers), "--block-size", "4",
                           "--prompt-tokens", "24", "--new-tokens", "12", "--tau", "2.0", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_drafter_layer_costs_the_drafter_and_the_prediction_follows(op_counts, tiny_dense_target, tmp_path):
    one, two = run(op_counts, tiny_dense_target, tmp_path, 1), run(op_counts, tiny_dense_target, tmp_path, 2)
    for r in (one, two):
        assert r["new_tokens"] == 12 and r["verifications"] >= 1 and r["prefill_ops"] > 0
        ops = r["ops_per_verification"]
        assert set(ops) == {"drafter", "target_verify", "loop"} and all(v > 0 for v in ops.values())
        assert r["ops_per_verification_total"] == pytest.approx(sum(ops.values()), abs=0.2)
        assert r["ops_ratio"] == pytest.approx(r["ops_per_target_token"] / r["ops_per_verification_total"], abs=1e-3)
        assert r["tau_used"] == 2.0 and r["predicted_host_bound_speedup"] == pytest.approx(2.0 * r["ops_ratio"],
                                                                                            abs=2e-3)
        # a verification runs the target once over the block and the drafter besides: more than one target token
        assert r["ops_per_verification"]["target_verify"] >= 0.9 * r["ops_per_target_token"]
        assert r["ops_ratio"] < 1.0 and r["tau_for_2x"] > 2.0
    d1, d2 = one["ops_per_verification"]["drafter"], two["ops_per_verification"]["drafter"]
    assert 1.6 * d1 < d2 < 2.4 * d1  # the layers dominate the drafter's forward
    assert two["ops_per_target_token"] == one["ops_per_target_token"]  # the target alone does not change


def test_a_published_checkpoint_is_counted_with_its_own_layers(op_counts, tiny_dense_target, tmp_path):
    """``--drafter DIR`` loads a checkpoint as ``drafter_checkpoint`` publishes it (``save_drafter``): its layers
    and block size come from its config.json, not from the flags."""
    import torch

    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
    from dflash_assets.target_model.conventions import mask_token_id_in_dir

    config = DrafterConfig.from_target_config(load_target_config(tiny_dense_target), num_layers=2, block_size=4,
                                              mask_token_id=mask_token_id_in_dir(tiny_dense_target))
    save_drafter(DFlashDrafter(config), tmp_path / "ckpt", dtype=torch.float32)
    out = tmp_path / "ops.json"
    assert op_counts.main(["--target", str(tiny_dense_target), "--drafter", str(tmp_path / "ckpt"), "--layers", "1",
                           "--block-size", "8", "--prompt-tokens", "24", "--new-tokens", "12",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["drafter"]["layers"] == 2 and report["drafter"]["block_size"] == 4
    assert report["tau_from"] == "measured" and report["tau_used"] >= 1.0
