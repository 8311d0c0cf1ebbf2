"""Drafter training: the recipe, loss goes down, resume after SIGKILL, DDP, online mode, target features, a time
budget (the loss, anchors and batches are tests/drafter/test_loss.py's and test_data.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_assets.drafter.model import load_drafter
from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.drafter.state import latest_state_dir
from dflash_assets.drafter.training import TargetFeatures, train_drafter
from tests.drafter.test_model import MINI_MASK, MINI_VOCAB, greedy_sequences, mini_target, one_thread, write_cache  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """Small-vocab target, 16 of its own greedy continuations, and their hidden-state cache."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("mini")
    tdir = mini_target(base / "target")
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    seqs = greedy_sequences(target, n=16, prompt_len=8, new_tokens=40, seed=0, vocab_hi=MINI_VOCAB - 12)
    cache = write_cache(base / "part-0.safetensors", target, seqs, layer_ids=[1, 3])
    return {"target_dir": tdir, "target": target, "seqs": seqs, "cache": cache}


def mini_recipe(**kw) -> DrafterRecipe:
    d = dict(name="mini", num_layers=2, block_size=8, epochs=3, batch_size=2, max_anchors=8, lr=3e-3,
             mask_token_id=MINI_MASK, save_every=2, seed=5)
    d.update(kw)
    return DrafterRecipe(**d)


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------------------------


def test_recipe_defaults_and_round_trip():
    r = DrafterRecipe(name="x")
    assert (r.block_size, r.num_layers, r.epochs, r.lr, r.warmup_ratio, r.max_length, r.max_anchors) == (
        16, 5, 6, 6e-4, 0.04, 3072, 512)
    assert r.loss_gamma == 7.0
    assert DrafterRecipe(name="x", block_size=10).loss_gamma == 5.0
    assert DrafterRecipe(name="x", block_size=8).loss_gamma == 4.0
    r2 = DrafterRecipe(name="y", partitions=("a", "b"), target_layer_ids=(1, 2))
    assert DrafterRecipe.from_dict(json.loads(json.dumps(r2.to_dict()))) == r2
    assert r2.fingerprint() == DrafterRecipe.from_dict(r2.to_dict()).fingerprint()
    assert r2.fingerprint() != DrafterRecipe(name="y", partitions=("a",), target_layer_ids=(1, 2)).fingerprint()


def test_loss_decreases_on_tiny_target(tiny_dense_target, tmp_path):
    """The real tiny target (248K vocab, bf16 cache): a drafter memorizes two continuations."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dense_target, dtype=torch.float32).eval()
    seqs = greedy_sequences(target, n=2, prompt_len=6, new_tokens=18, seed=1, vocab_hi=248000)
    cache = write_cache(tmp_path / "p.safetensors", target, seqs, [1, 2, 3, 4, 5], dtype=torch.bfloat16)
    r = DrafterRecipe(name="tiny", num_layers=1, block_size=8, epochs=12, batch_size=2, max_anchors=3, lr=3e-3,
                      warmup_ratio=0.1, save_every=100)
    res = train_drafter(r, [cache], tiny_dense_target, tmp_path / "out")
    assert res.finished and res.steps == 12 and len(res.losses) == 12
    # a random target's logits are nearly flat (CE ~ ln 248320 = 12.4), so the drop is in absolute nats
    assert np.mean(res.losses[-3:]) < np.mean(res.losses[:3]) - 0.4, res.losses
    assert len(res.accuracy_by_position) == 7 and all(0 <= a <= 1 for a in res.accuracy_by_position)
    d = load_drafter(res.checkpoint_dir)
    assert d.config.target_layer_ids == [1, 2, 3, 4, 5]  # from the cache's header
    assert d.config.mask_token_id == 248077  # the tokenizer's <|MASK|>


def test_resume_after_sigkill_continues_the_same_run(mini, tmp_path):
    r = mini_recipe()
    full = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "full")
    assert full.steps == full.total_steps == 24  # 16 sequences / batch 2 x 3 epochs

    out = tmp_path / "killed"
    code = (
        "import os, signal, torch\n"
        "torch.set_num_threads(1)\n"
        "from dflash_assets.drafter.training import DrafterRecipe, train_drafter\n"
        f"r = DrafterRecipe.from_dict({r.to_dict()!r})\n"
        "def log(m):\n"
        "    if m['step'] == 5:\n"  # the state of step 4 is on disk; step 5 is lost
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"train_drafter(r, [{str(mini['cache'])!r}], {str(mini['target_dir'])!r}, {str(out)!r}, log=log)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert latest_state_dir(out / "state").name == "step-00000004"
    assert not (out / "drafter").exists()

    resumed = train_drafter(r, [mini["cache"]], mini["target_dir"], out)
    assert resumed.resumed_from_step == 4 and resumed.steps == 24
    assert resumed.losses == full.losses  # the same run, bit for bit (CPU, one thread)
    assert resumed.accuracy_by_position == full.accuracy_by_position
    a, b = load_drafter(full.checkpoint_dir).state_dict(), load_drafter(resumed.checkpoint_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # a finished run resumes to a no-op; a changed recipe refuses to continue another run's state
    again = train_drafter(r, [mini["cache"]], mini["target_dir"], out)
    assert again.resumed_from_step == 24 and again.losses == full.losses
    with pytest.raises(ValueError, match="different run"):
        train_drafter(mini_recipe(lr=1e-3), [mini["cache"]], mini["target_dir"], out)


def test_max_steps_stops_with_a_resumable_state(mini, tmp_path):
    r = mini_recipe(epochs=1, save_every=100)
    part = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", max_steps=3)
    assert part.steps == 3 and not part.finished and part.checkpoint_dir is None
    assert latest_state_dir(tmp_path / "o" / "state").name == "step-00000003"
    rest = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o")
    full = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "full")
    assert rest.finished and rest.losses == full.losses
    # each invocation counts the steps that met a batch shape first (a resumed one meets its shapes again)
    for res in (part, rest, full):
        assert 1 <= res.new_shape_steps <= res.steps - (res.resumed_from_step or 0) and res.new_shape_s > 0
    assert full.new_shape_steps < full.steps and full.warm_tokens_per_s > 0


def test_the_warm_rate_leaves_out_the_first_step_of_each_batch_shape():
    from dflash_assets.drafter.training import _Progress

    p = _Progress()
    steps = [((2, 8), 4.0, 100), ((2, 8), 1.0, 100), ((2, 16), 3.0, 200), ((2, 8), 1.0, 100), ((2, 16), 1.0, 200)]
    for shapes, seconds, tokens in steps:
        p.count_shapes(shapes, seconds, tokens)
        p.tokens_seen += tokens
    assert (p.new_shape_steps, p.new_shape_s, p.new_shape_tokens) == (2, 7.0, 300)
    p.aside_s = 2.0  # tau estimates and saved states: left out too
    assert p.warm_tokens_per_s(loop_s=12.0) == pytest.approx(400 / 3.0)  # 12 s less 2 aside less 7 first-shape
    only_new = _Progress()
    only_new.count_shapes((1,), 5.0, 10)
    only_new.tokens_seen = 10
    assert only_new.warm_tokens_per_s(loop_s=5.0) == 0.0


def test_training_runs_with_the_callers_flex_tiles_else_the_drafters_and_restores_them(mini, tmp_path):
    """flex's tiles in the steps: those the caller set (kept after the run), else the drafter's for the device
    (none on a CPU); the result names them."""
    from dflash_assets.torch_compile import current_flex_kernel_options, set_flex_kernel_options

    r = mini_recipe(epochs=1, save_every=100)
    assert train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "a", max_steps=1).flex_kernel_options == {}
    set_flex_kernel_options({"BLOCK_M": 32})
    try:
        res = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "b", max_steps=1)
        assert res.flex_kernel_options == {"BLOCK_M": 32} == current_flex_kernel_options()
    finally:
        set_flex_kernel_options(None)


def test_ddp_two_processes_match_one_process(mini, tmp_path):
    """torchrun with 2 gloo processes x batch 1 trains the same run as 1 process x batch 2."""
    recipe_file = tmp_path / "recipe.json"
    common = ["--data", str(mini["cache"]), "--target", str(mini["target_dir"]), "--recipe", str(recipe_file)]
    recipe_file.write_text(json.dumps(mini_recipe(batch_size=1, epochs=2, save_every=100).to_dict()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_assets.drafter.training", *common, "--out", str(tmp_path / "ddp"),
           "--result", str(tmp_path / "ddp.json")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp.json").read_text())

    one = train_drafter(mini_recipe(batch_size=2, epochs=2, save_every=100), [mini["cache"]], mini["target_dir"],
                        tmp_path / "one")
    assert ddp["world_size"] == 2 and ddp["steps"] == one.steps == 16
    np.testing.assert_allclose(ddp["losses"], one.losses, rtol=2e-4, atol=1e-5)
    a = load_drafter(tmp_path / "ddp" / "drafter", dtype=torch.float32).state_dict()
    b = load_drafter(one.checkpoint_dir, dtype=torch.float32).state_dict()
    for k in a:  # bf16 checkpoints of (nearly) the same weights
        torch.testing.assert_close(a[k], b[k], rtol=0.02, atol=2e-3)


def test_online_mode_matches_the_cache(mini, tmp_path):
    """Online hidden states (hooks, target cut after its last captured layer) train the same run as
    the cache written from HF output_hidden_states; tokenized samples come from Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [ids for ids, _ in mini["seqs"]],
                             "loss_mask": [lm for _, lm in mini["seqs"]]}), tmp_path / "samples.parquet")
    r = mini_recipe(epochs=1, target_layer_ids=(1, 3))
    offline = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "off")
    online = train_drafter(DrafterRecipe.from_dict({**r.to_dict(), "online": True}), [tmp_path / "samples.parquet"],
                           mini["target_dir"], tmp_path / "on")
    np.testing.assert_allclose(online.losses, offline.losses, rtol=1e-5, atol=1e-6)
    # safetensors samples in the cache layout work online too (the `hidden` tensor is not read)
    online2 = train_drafter(DrafterRecipe.from_dict({**r.to_dict(), "online": True}), [mini["cache"]],
                            mini["target_dir"], tmp_path / "on2")
    np.testing.assert_allclose(online2.losses, offline.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_target_features_equal_hf_hidden_states(kind, tiny_dense_target, tiny_hybrid_target):
    from transformers import AutoModelForCausalLM

    tdir = tiny_dense_target if kind == "dense" else tiny_hybrid_target
    ids = torch.tensor([[11, 2000, 30000, 5, 77, 248046, 9, 12]])
    feats = TargetFeatures(tdir, [1, 3, 5], "cpu", torch.float32)
    assert len(feats.model.layers) == 6  # layers 6 and 7 are gone
    got = feats(ids)
    full = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = full(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got, torch.cat([hs[2], hs[4], hs[6]], -1), rtol=1e-5, atol=1e-5)


def test_compiled_target_features_equal_the_eager_ones(tiny_dense_target):
    """A compiled recipe's online features: the target's norms and MLPs compiled (as the cache's capture does), the
    same features as eager within float rounding, over two batch shapes."""
    eager = TargetFeatures(tiny_dense_target, [1, 3, 5], "cpu", torch.float32)
    compiled = TargetFeatures(tiny_dense_target, [1, 3, 5], "cpu", torch.float32, compile=True)
    marked = [m for m in compiled.model.layers.modules() if getattr(m, "_dflash_compiled", False)]
    assert len(marked) == 6 * 5  # per kept layer: its four RMSNorms (Qwen3 norms q and k too) and the MLP
    assert not any(getattr(m, "_dflash_compiled", False) for m in eager.model.modules())
    gen = torch.Generator().manual_seed(0)
    for shape in ((2, 24), (3, 40)):
        ids = torch.randint(0, 1000, shape, generator=gen)
        torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-3, atol=1e-3)


def test_packed_batches_run_the_target_over_real_tokens_only(tiny_dense_target):
    """Online features of a packed batch: the samples' real tokens through the target as one packed row, each
    attending inside its own sample; the same features, slot by slot, as the padded rows give and the batch's
    packed layout gathers (the end padding zeros)."""
    from dflash_assets.drafter.data import Sample, collate

    features = TargetFeatures(tiny_dense_target, [1, 3, 5], "cpu", torch.float32)
    assert features.packed
    rng = np.random.default_rng(0)
    samples = [Sample(rng.integers(0, 1000, n), np.ones(n, bool), None) for n in (9, 30, 17)]
    anchors = [np.array([1, 4]), np.array([2, 20, 25]), np.array([3])]
    batch = collate(samples, anchors, seq_multiple=8, anchor_multiple=8, packed=True, bucket=True)
    assert batch.ctx_index.shape[1] > batch.num_tokens  # padding at the end
    calls = []
    forward = features.model.forward
    features.model.forward = lambda **kw: (calls.append(kw["input_ids"].shape), forward(**kw))[1]
    packed = features.for_batch(batch)
    assert calls == [(1, 56)]  # 9 + 30 + 17 tokens, one row, no padding
    want = batch.pack_context(features(batch.input_ids))
    T = batch.num_tokens
    assert packed.shape == want.shape
    torch.testing.assert_close(packed[:, :T], want[:, :T], rtol=1e-4, atol=1e-4)
    assert not packed[:, T:].any()
    padded = collate(samples, anchors, seq_multiple=8, anchor_multiple=8)
    torch.testing.assert_close(features.for_batch(padded), features(padded.input_ids))


def test_benchmark_quick_mode_runs(tmp_path, capsys):
    """bench/drafter_training.py --quick (tiny shapes, CPU) keeps working: same step code as training."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_drafter_training", REPO / "bench" / "drafter_training.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--batch-sizes", "1", "--steps", "1", "--out", str(tmp_path / "b.json")]) == 0
    out = json.loads((tmp_path / "b.json").read_text())
    (r,) = out["single_gpu"]
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["loss"] == pytest.approx(np.log(1024), rel=0.05)
    assert set(r["flops_breakdown_per_rank"]) == {"drafter_linear", "fc", "lm_head", "attention"}
    assert out["config"]["flex_kernel_options"] == {}  # a CPU: no tiles named, as training
    assert json.loads(capsys.readouterr().out)["single_gpu"][0]["batch_size"] == 1


def test_benchmark_profiles_the_packed_varied_lengths(tmp_path):
    """--varied-only --profile: the padded and packed layouts give the same first loss, and the packed steps are
    profiled (wall and busy time per step, the kernels that take it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_drafter_training", REPO / "bench" / "drafter_training.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--varied-only", "--varied-batches", "2", "--varied-passes", "1", "--profile",
                       "--out", str(tmp_path / "v.json")]) == 0
    varied = json.loads((tmp_path / "v.json").read_text())["varied_lengths"]
    assert varied["first_loss_rel_diff"] < 1e-4
    profile = varied["packed"]["profile"]
    assert profile["wall_ms_per_step"] > 0 and 0 < profile["busy_ms_per_step"]
    assert profile["top"] and all(k["ms_per_step"] > 0 for k in profile["top"])
    assert "profile" not in varied["padded"]


def test_last_layer_features_are_equal_online_offline_and_at_decode_time(tiny_dense_target):
    """Layer id L-1 is HF's hidden_states[L], the final norm's output: the cache, online training and the
    speculative decoder read it through one LayerCapture, so all three give the same features."""
    from transformers import AutoModelForCausalLM

    from dflash_assets.hidden_states.capture import capture_hidden_states, load_target
    from dflash_assets.drafter.decoding import TargetRunner

    ids = [11, 2000, 30000, 5, 77, 248046, 9, 12]
    layer_ids = [1, 7]  # 7 = L-1 for the 8-layer tiny target
    full = AutoModelForCausalLM.from_pretrained(tiny_dense_target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = full(torch.tensor([ids]), output_hidden_states=True).hidden_states
    reference = torch.cat([hs[2], hs[8]], -1)[0]

    online = TargetFeatures(tiny_dense_target, layer_ids, "cpu", torch.float32)(torch.tensor([ids]))[0]
    (offline,) = capture_hidden_states(load_target(tiny_dense_target, dtype="float32"),
                                       [{"prompt_id": "p", "input_ids": np.array(ids, dtype=np.int32),
                                         "loss_mask": np.ones(len(ids), dtype=np.uint8)}], layer_ids)
    runner = TargetRunner(full, layer_ids, use_cache=False)
    try:
        _, decoding = runner.extend(ids)
    finally:
        runner.close()
    torch.testing.assert_close(offline.float(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(online, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoding, reference, rtol=1e-5, atol=1e-5)
    # the raw layer-7 output (before the final norm) differs, so hooking the layer itself would be caught
    raw = {}
    handle = full.model.layers[7].register_forward_hook(lambda m, a, out: raw.setdefault("x", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        full(torch.tensor([ids]))
    handle.remove()
    assert not torch.allclose(raw["x"].reshape(len(ids), -1), reference[:, 64:], atol=1e-3)


# ----------------------------------------------------------------------------------------------
# A time budget measured after warm-up


def test_budget_steps():
    from dflash_assets.drafter.training import budget_steps

    assert budget_steps(20, 0.5, 10.0, 1000) == 40
    assert budget_steps(20, 0.5, 10.0, 30) == 30  # never past the plan
    assert budget_steps(20, 0.5, -3.0, 1000) == 20  # never before what is done


def test_budget_pace_is_the_median_of_the_latest_windows():
    from dflash_assets.drafter.training import BUDGET_PACE_WINDOWS, budget_pace

    assert BUDGET_PACE_WINDOWS == 3
    assert budget_pace([1.26]) == 1.26  # the first cut: one window
    assert budget_pace([1.26, 0.6]) == pytest.approx(0.93)
    assert budget_pace([1.26, 0.6, 0.6]) == 0.6  # the slow start forgotten after two windows
    assert budget_pace([0.3, 0.31, 1.05]) == 0.31  # one slow window (a recompilation) moves nothing
    assert budget_pace([0.3, 0.31, 1.05, 0.3]) == 0.31
    assert budget_pace([0.3, 0.31, 0.6, 0.61]) == 0.6  # a lasting change of pace within two windows


def test_one_slow_window_does_not_cut_a_time_budgeted_run(mini, tmp_path, monkeypatch):
    """A window of slow steps in mid-run (on an H200: 1,050 ms/step among ~305) is not taken for the pace: the
    cut after it plans at the median of the latest windows, so the plan and the cosine schedule barely move."""
    import time as _time

    from dflash_assets.drafter import training
    from dflash_assets.drafter.training import BUDGET_MEASURE_STEPS, BUDGET_WARMUP_STEPS

    monkeypatch.setattr(training, "BUDGET_REPLAN_EVERY", 5)
    first_cut = BUDGET_WARMUP_STEPS + BUDGET_MEASURE_STEPS
    slow = range(first_cut + 10, first_cut + 15)  # the fourth timed window: after three fast ones
    r = mini_recipe(epochs=400, save_every=1000)
    cuts = []

    def log(m):
        if m.get("budget"):
            cuts.append(m)
        elif m["step"] in slow:
            _time.sleep(0.3)

    train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", log=log, time_budget_s=8.0)
    at = next(c for c in cuts if c["step"] == first_cut + 15)  # the cut just after the slow window
    assert at["window_step_s"] > 0.3  # the slow window was seen ...
    assert at["step_s"] < 0.5 * at["window_step_s"]  # ... and not planned with
    # the median of the latest three windows: the slower of the two fast ones before the slow one
    assert at["step_s"] == max(c["window_step_s"] for c in cuts if c["step"] in (first_cut + 5, first_cut + 10))


def test_a_slow_start_does_not_shorten_a_time_budgeted_run(mini, tmp_path, monkeypatch):
    """Steps that meet new batch widths early are slower than later ones (1.26 s/step over steps 5-20 on an
    H200; a plan at that pace alone would use a third of the budget). Here steps 5-20 are slowed on purpose: the
    first cut is short, the next re-plan at the recent pace lengthens it again."""
    import time as _time

    from dflash_assets.drafter import training
    from dflash_assets.drafter.training import BUDGET_MEASURE_STEPS, BUDGET_WARMUP_STEPS

    monkeypatch.setattr(training, "BUDGET_REPLAN_EVERY", 5)  # re-plan soon: the test stays short on any CPU
    first_cut = BUDGET_WARMUP_STEPS + BUDGET_MEASURE_STEPS
    r = mini_recipe(epochs=400, save_every=1000)
    cuts = []

    def log(m):
        if m.get("budget"):
            cuts.append(m)
        elif BUDGET_WARMUP_STEPS <= m["step"] < first_cut:
            _time.sleep(0.2)  # inside the timed window: these steps look 200 ms slower than they are

    t0 = _time.perf_counter()
    res = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", log=log, time_budget_s=8.0)
    assert cuts[0]["step"] == first_cut and cuts[0]["step_s"] > 0.2
    assert cuts[1]["step"] == first_cut + 5 and cuts[1]["step_s"] < cuts[0]["step_s"]
    assert cuts[1]["total_steps"] > cuts[0]["total_steps"]  # lengthened at the faster recent pace
    assert cuts[2]["step_s"] < 0.5 * cuts[0]["step_s"]  # the slow start out of the median after two windows
    assert res.steps == cuts[-1]["total_steps"] > cuts[0]["total_steps"]
    assert _time.perf_counter() - t0 < 8.0 + 10.0  # and the budget still holds (a step or two over, no more)


def test_time_budget_cuts_the_plan_after_warm_up_and_ends_with_a_checkpoint(mini, tmp_path):
    """The step time is measured after the first steps, the plan cut to the budget and cut again at the recent
    pace every BUDGET_REPLAN_EVERY steps, the cosine schedule ends
    at the cut (lr ~0 at the last step), the checkpoint is published, and every saved state reaches on_save."""
    from dflash_assets.drafter.training import BUDGET_MEASURE_STEPS, BUDGET_REPLAN_EVERY, BUDGET_WARMUP_STEPS

    r = mini_recipe(epochs=400, save_every=10)  # 3,200 planned steps: far more than the budget allows
    budget_events, lrs, saved = [], [], []

    def log(m):
        (budget_events if m.get("budget") else lrs).append(m)

    res = train_drafter(r, [mini["cache"]], mini["target_dir"], tmp_path / "o", log=log, time_budget_s=3.0,
                        on_save=lambda step, tokens, drafter: saved.append((step, tokens)))
    first_cut = BUDGET_WARMUP_STEPS + BUDGET_MEASURE_STEPS
    assert budget_events[0]["step"] == first_cut  # then again every BUDGET_REPLAN_EVERY steps, at the recent pace
    assert [e["step"] for e in budget_events] == list(range(first_cut, first_cut + BUDGET_REPLAN_EVERY
                                                            * len(budget_events), BUDGET_REPLAN_EVERY))
    assert budget_events[-1]["total_steps"] == res.steps  # the last cut is where the run ended
    assert first_cut <= res.steps == res.total_steps < 3200
    assert res.finished and res.checkpoint_dir is not None and load_drafter(res.checkpoint_dir) is not None
    assert lrs[-1]["step"] == res.steps and lrs[-1]["lr"] < 0.01 * r.lr  # the cosine reached its end
    assert res.wall_s < 30
    assert [s for s, _ in saved] == [s for s in range(10, res.steps + 1, 10)] + ([res.steps] if res.steps % 10 else [])
    tokens = [t for _, t in saved]
    assert tokens == sorted(tokens) and tokens[-1] == res.sequence_tokens > 0
    assert res.draft_tokens > 0 and res.to_metadata()["draft_tokens_per_sequence_token"] > 0


