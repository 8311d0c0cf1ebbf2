"""Greedy speculative decoding with a DFlash drafter: lossless against the target alone, tau."""

from __future__ import annotations

import pytest
import torch

from dflash_assets.target_model.conventions import mask_token_id_in_dir
from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_drafter, load_target_config
from dflash_assets.drafter.training import DrafterRecipe, train_drafter
from dflash_assets.drafter.decoding import (
    EvalPrompt,
    SpeculativeDecoder,
    decode_speed,
    evaluate_drafter,
    greedy_generate,
    greedy_mismatch,
    load_target,
)
from tests.drafter.test_model import MINI_MASK, MINI_VOCAB, greedy_sequences, mini_target, one_thread, write_cache  # noqa: F401

EOS = (248046, 248044)


def untrained_drafter(target_dir, block_size=8, seed=0) -> DFlashDrafter:
    cfg = DrafterConfig.from_target_config(load_target_config(target_dir), num_layers=2, block_size=block_size,
                                           mask_token_id=mask_token_id_in_dir(target_dir))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg)


def prompts(n: int, length: int, seed: int, hi: int, categories=("chat", "code")) -> list[EvalPrompt]:
    g = torch.Generator().manual_seed(seed)
    return [EvalPrompt(tuple(torch.randint(0, hi, (length,), generator=g).tolist()), categories[i % len(categories)],
                       f"p{i}") for i in range(n)]


@pytest.fixture(scope="module")
def dense(tiny_dense_target):
    torch.set_num_threads(1)
    return load_target(tiny_dense_target, "cpu")


def test_greedy_reference_equals_generate(dense):
    p = prompts(1, 10, seed=3, hi=248000)[0].input_ids
    ref = dense.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
    assert greedy_generate(dense, p, 24, EOS) == ref
    assert greedy_generate(dense, p, 24, EOS, use_cache=False) == ref


def test_lossless_on_the_dense_target(dense, tiny_dense_target):
    ps = prompts(3, 10, seed=0, hi=248000)
    res = evaluate_drafter(untrained_drafter(tiny_dense_target), dense, ps, max_new_tokens=16, stop_token_ids=EOS)
    assert res.lossless and res.num_mismatches == 0, res.per_prompt
    assert all(r["lossless"] for r in res.per_prompt)
    assert res.tau >= 1.0 and set(res.tau_by_category) == {"chat", "code"}
    # pooled: accepted tokens / verifications, overall and per category
    rows = res.per_prompt
    assert res.tau == pytest.approx(sum(r["accepted_tokens"] for r in rows) / sum(r["verifications"] for r in rows))
    chat = [r for r in rows if r["category"] == "chat"]
    assert res.tau_by_category["chat"] == pytest.approx(
        sum(r["accepted_tokens"] for r in chat) / sum(r["verifications"] for r in chat))
    # the KV-cache path and the recompute-everything path produce the same tokens
    d = untrained_drafter(tiny_dense_target)
    for p in ps[:1]:
        a = SpeculativeDecoder(dense, d, use_cache=True).generate(p.input_ids, 16, EOS)
        b = SpeculativeDecoder(dense, d, use_cache=False).generate(p.input_ids, 16, EOS)
        assert a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths
        assert sum(a.acceptance_lengths) == len(a.output_ids) - 1  # the first token comes from the prefill


def test_lossless_on_the_hybrid_target(tiny_hybrid_target):
    target = load_target(tiny_hybrid_target, "cpu")  # linear attention: no cache crop, recompute path
    ps = prompts(2, 8, seed=1, hi=248000)
    res = evaluate_drafter(untrained_drafter(tiny_hybrid_target), target, ps, max_new_tokens=12, stop_token_ids=EOS)
    assert res.lossless, res.per_prompt
    assert 0 < res.num_new_tokens <= 24 and res.num_verifications > 0


def test_stop_tokens_and_length_budget(dense, tiny_dense_target):
    p = prompts(1, 10, seed=0, hi=248000)[0].input_ids
    ref = greedy_generate(dense, p, 30)
    stop = ref[7]
    d = untrained_drafter(tiny_dense_target)
    out = SpeculativeDecoder(dense, d).generate(p, 30, stop_token_ids=[stop])
    assert out.output_ids == ref[: ref.index(stop) + 1]
    out = SpeculativeDecoder(dense, d).generate(p, 5)
    assert out.output_ids == ref[:5] and sum(out.acceptance_lengths) == 4


def test_drafter_fitted_to_the_targets_greedy_continuations_accepts_most_of_each_block(tmp_path):
    """Train on the hidden states of the target's own greedy continuations, then decode those prompts through
    SpeculativeDecoder: tau must reach 0.8 x the block size (training and decoding agree; an
    alignment regression - positions, masks, context, labels off by one - leaves tau near 1 and fails here)."""
    B = 4
    tdir = mini_target(tmp_path / "target")
    target = load_target(tdir, "cpu")
    seqs = greedy_sequences(target, n=4, prompt_len=8, new_tokens=40, seed=0, vocab_hi=MINI_VOCAB - 12)
    cache = write_cache(tmp_path / "part.safetensors", target, seqs, layer_ids=[1, 3])
    r = DrafterRecipe(name="tau", num_layers=2, block_size=B, epochs=200, batch_size=4, max_anchors=32, lr=3e-3,
                      mask_token_id=MINI_MASK, save_every=10_000)
    res = train_drafter(r, [cache], tdir, tmp_path / "out")
    ps = [EvalPrompt(tuple(ids[:8]), "chat" if i % 2 else "code", f"p{i}") for i, (ids, _) in enumerate(seqs)]

    cfg = DrafterConfig.from_target_config(load_target_config(tdir), num_layers=2, block_size=B,
                                           mask_token_id=MINI_MASK, target_layer_ids=[1, 3])
    torch.manual_seed(0)
    before = evaluate_drafter(DFlashDrafter(cfg), target, ps, max_new_tokens=32, check_lossless=False)
    after = evaluate_drafter(res.checkpoint_dir, target, ps, max_new_tokens=32)
    assert after.lossless, after.per_prompt
    assert before.tau < 1.3, before.tau
    assert after.tau >= 0.8 * B, (after.tau, res.to_metadata())
    assert min(after.tau_by_category.values()) >= 0.7 * B, after.tau_by_category
    # the same drafter decodes those prompts exactly as the target does alone, and faster per verification
    dec = SpeculativeDecoder(target, load_drafter(res.checkpoint_dir, dtype=torch.float32))
    for p in ps[:2]:
        out = dec.generate(p.input_ids, 32)
        assert out.output_ids == greedy_generate(target, p.input_ids, 32)
        assert out.tau >= 0.7 * B, out.acceptance_lengths


def test_decode_speed_times_both_decoders_on_the_same_prompts(dense, tiny_dense_target):
    ps = prompts(3, 10, seed=2, hi=248000)
    speed = decode_speed(dense, untrained_drafter(tiny_dense_target), ps, max_new_tokens=8)
    assert speed["num_prompts"] == 3 and speed["outputs_equal"] == 3  # lossless: same tokens both ways
    assert speed["target_tokens"] == speed["speculative_tokens"] == 24  # no stop token: 8 new tokens each
    assert speed["target_tokens_per_s"] > 0 and speed["speculative_tokens_per_s"] > 0
    assert speed["speedup"] == pytest.approx(speed["speculative_tokens_per_s"] / speed["target_tokens_per_s"], rel=1e-2)
    assert speed["dtype"] == "float32" and speed["device"] == "cpu"


def test_evaluation_costs_one_target_forward_per_verification(dense, tiny_dense_target):
    """Prefill + one forward per verification + one teacher-forced check per prompt, and the verify forwards take
    only the block (KV cache): the lossless check does not decode every prompt a second time token by token (one
    target forward per new token)."""
    ps = prompts(2, 40, seed=5, hi=248000)
    calls: list[int] = []
    h = dense.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    seen: list[tuple[int, dict]] = []
    try:
        res = evaluate_drafter(untrained_drafter(tiny_dense_target), dense, ps, max_new_tokens=24,
                               stop_token_ids=(), on_prompt=lambda i, row: seen.append((i, dict(row))))
    finally:
        h.remove()
    assert res.lossless, res.per_prompt
    assert res.num_new_tokens == 48  # no stop token: both prompts ran to the budget, so counts are not vacuous
    assert len(calls) == res.num_verifications + 2 * len(ps), (len(calls), res.num_verifications)
    B = 8
    # tokens the target processed: per prompt its prefill, <= B per verification, prompt + output for the check
    assert sum(calls) <= sum(2 * len(p.input_ids) + r["new_tokens"] + B * r["verifications"]
                             for p, r in zip(ps, res.per_prompt))
    assert [i for i, _ in seen] == [0, 1] and all(row["wall_s"] >= 0 for _, row in seen)
    assert [row["prompt_id"] for _, row in seen] == ["p0", "p1"]
    cut = evaluate_drafter(untrained_drafter(tiny_dense_target), dense, ps, max_new_tokens=4, stop_after_s=0.0)
    assert len(cut.per_prompt) == 1 and cut.to_metadata()["num_prompts"] == 1  # no second prompt past the budget


def test_greedy_mismatch_finds_the_first_departure(dense):
    p = prompts(1, 10, seed=3, hi=248000)[0].input_ids
    ref = greedy_generate(dense, p, 20)
    assert greedy_mismatch(dense, p, ref, 20) is None
    bad = list(ref)
    bad[6] = (bad[6] + 1) % 248000
    assert greedy_mismatch(dense, p, bad, 20) == 6
    assert greedy_mismatch(dense, p, ref[:12], 20) == 12  # stopped early without a stop token
    k = next(i for i in range(4, 20) if ref[i] not in ref[:i])  # a token greedy emits first at k
    assert greedy_mismatch(dense, p, ref[: k + 1], 20, stop_token_ids=[ref[k]]) is None
    assert greedy_mismatch(dense, p, ref, 20, stop_token_ids=[ref[k]]) == k  # went on past a stop token


def test_drafter_eval_learning_curve_is_drawn_as_a_chart_in_dagster():
    """eval_recipe(curve_prompts=...) reports [tokens trained, tau] points; the asset shows them as a PNG chart."""
    import dagster as dg

    from dagster_project.config import DrafterEvalConfig
    from dagster_project.metadata import render_pipes_result

    result = render_pipes_result(dg.MaterializeResult(metadata={  # as Pipes hands them over: metadata values
        "tau": dg.MetadataValue.float(1.45),
        "learning_curve": dg.MetadataValue.json([[2_281_686, 1.0674], [4_574_972, 1.2467], [11_145_362, 1.3418]])}))
    text = result.metadata["learning_curve"].value
    assert "data:image/png;base64," in text and "3 checkpoints: tau 1.067 -> 1.342" in text
    assert result.metadata["tau"].value == 1.45
    # the config fields reach eval_recipe's keyword arguments unchanged (the asset sends config.model_dump())
    cfg = DrafterEvalConfig(num_prompts=64, dtype="float32", speed_prompts=16, curve_prompts=4).model_dump()
    assert {k: cfg[k] for k in ("dtype", "speed_prompts", "curve_prompts")} == {
        "dtype": "float32", "speed_prompts": 16, "curve_prompts": 4}
    import inspect

    from dflash_assets.drafter.stages import eval_recipe

    assert set(cfg) <= set(inspect.signature(eval_recipe).parameters)


def test_evaluation_dtype_is_one_rule():
    """float32 on a CPU, bfloat16 on a GPU, else the dtype asked for (by name or dtype); a bad name is refused."""
    from dflash_assets.drafter.decoding import evaluation_dtype

    assert evaluation_dtype("cpu") == torch.float32
    assert evaluation_dtype("cuda") == torch.bfloat16  # decided from the device's kind: no GPU needed
    assert evaluation_dtype("cuda", "float32") == torch.float32
    assert evaluation_dtype("cpu", "bf16") == torch.bfloat16 and evaluation_dtype("cpu", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        evaluation_dtype("cpu", "float33")
