"""The D-PACE objective: position weights checked against a block computed by hand, its gradient against autograd,
and a tiny drafter trained with each objective on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_assets.drafter.loss import dpace_weights, head_cross_entropy_reweighted
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.drafter.training import train_drafter
from tests.drafter.test_training import mini, mini_recipe  # noqa: F401


def test_weights_of_a_block_computed_by_hand():
    # p = (0.8, 0.6, 0.5), alpha 0.5: q = (0.9, 0.8, 0.75); survival 0.9, 0.72, 0.54; suffix sums 2.16, 1.26, 0.54
    p = torch.tensor([[0.8, 0.6, 0.5]])
    w = dpace_weights(p, torch.ones_like(p, dtype=torch.bool), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[2.16, 1.26, 0.54]]))
    # the middle position has no label: q = 1 there (no-op in the products), left out of the sums, weight 0
    w = dpace_weights(p, torch.tensor([[True, False, True]]), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.9 + 0.675, 0.0, 0.675]]))
    # alpha 1: every q is 1, the weights count the valid positions from k on (the loss of a position-blind draft)
    w = dpace_weights(p, torch.tensor([[True, True, False]]), alpha=1.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.0]]))
    # alpha 0: the plain expected acceptance length's derivative, p1 + p1 p2 + p1 p2 p3 at position 1
    w = dpace_weights(p, torch.ones_like(p, dtype=torch.bool), alpha=0.0)
    torch.testing.assert_close(w, torch.tensor([[0.8 + 0.48 + 0.24, 0.48 + 0.24, 0.24]]))


def test_weights_are_detached():
    p = torch.tensor([[0.3, 0.9]], requires_grad=True)
    assert not dpace_weights(p, torch.ones(1, 2, dtype=torch.bool)).requires_grad


@pytest.mark.parametrize("chunk", [2, 1000])
def test_reweighted_cross_entropy_matches_autograd(chunk):
    """One pass over the head: sum w*CE with w = D-PACE weights of the rows' own label probabilities (detached),
    its gradient the same as autograd's on the full logits."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(40, 8, generator=g)
    h = torch.randn(12, 8, generator=g, requires_grad=True)  # 4 blocks x 3 positions
    y = torch.randint(0, 40, (12,), generator=g)
    valid = torch.ones(4, 3, dtype=torch.bool)

    loss, correct, w = head_cross_entropy_reweighted(
        h, W, y, lambda p: dpace_weights(p.view(4, 3), valid).view(-1), chunk=chunk)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ W.T
    ce = F.cross_entropy(logits, y, reduction="none")
    ref_w = dpace_weights(torch.exp(-ce).view(4, 3), valid).view(-1)
    ref = (ce * ref_w).sum()
    ref.backward()
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(correct, logits.argmax(-1) == y)


def test_objective_is_a_recipe_field_checked_and_fingerprinted():
    base = DrafterRecipe(name="r", objective="dflash")
    assert DrafterRecipe(name="r").objective == "dpace" and base.dpace_alpha == 0.5  # dpace is the default
    assert DrafterRecipe(name="r", objective="dflash", dpace_alpha=0.2).fingerprint() == base.fingerprint()  # unused
    dpace = DrafterRecipe(name="r", objective="dpace")
    assert dpace.fingerprint() != base.fingerprint() and DrafterRecipe(name="r").fingerprint() == dpace.fingerprint()
    assert DrafterRecipe(name="r", objective="dpace", dpace_alpha=0.3).fingerprint() != dpace.fingerprint()
    assert DrafterRecipe.from_dict(dpace.to_dict()) == dpace
    with pytest.raises(ValueError, match="objective must be one of dflash, dpace"):
        DrafterRecipe(name="r", objective="domino")
    with pytest.raises(ValueError, match="dpace_alpha"):
        DrafterRecipe(name="r", objective="dpace", dpace_alpha=1.5)


@pytest.mark.parametrize("objective", ["dflash", "dpace"])
def test_both_objectives_train_a_tiny_drafter(mini, tmp_path, objective):
    r = train_drafter(mini_recipe(objective=objective, epochs=4, tau_prompts=0), [mini["cache"]], mini["target_dir"],
                      tmp_path, device="cpu")
    assert r.finished and r.checkpoint_dir is not None
    first, last = sum(r.losses[:3]) / 3, sum(r.losses[-3:]) / 3
    assert last < first, (objective, r.losses)
    assert r.stop_reason == "completed"


def test_existing_recipes_keep_their_fingerprints():
    """Recipes stored before the objective and the tau estimate's fields existed read as dflash (what they were
    trained with) and keep their recorded fingerprints; the estimate's settings without an early stop change none."""
    from dflash_assets.demo import demo_recipe

    def stored(recipe: DrafterRecipe) -> DrafterRecipe:  # its JSON as written before the fields existed
        d = recipe.to_dict()
        for k in ("objective", "dpace_alpha", "tau_every", "tau_prompts", "tau_new_tokens", "early_stop_patience"):
            d.pop(k)
        return DrafterRecipe.from_dict(json.loads(json.dumps(d)))

    assert stored(demo_recipe(["shard-00000", "shard-00001"])).fingerprint() == "6c420d4fa3ade25f"
    assert stored(DrafterRecipe(name="x")).fingerprint() == "440042d13df2be48"
    assert stored(DrafterRecipe(name="y", partitions=("a",), target_layer_ids=(1, 2), online=True, cache_limit_gb=2.0,
                                init_from="promoted")).fingerprint() == "3c5f08cf7a113303"
    assert DrafterRecipe(name="x", objective="dflash", tau_every=7, tau_prompts=3,
                         tau_new_tokens=9).fingerprint() == "440042d13df2be48"
    assert stored(DrafterRecipe(name="x")).objective == "dflash"
    assert DrafterRecipe(name="x").fingerprint() != "440042d13df2be48"  # a recipe made now trains dpace