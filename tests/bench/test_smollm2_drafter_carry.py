"""``bench/smollm2_product.py --export-drafter`` / ``--init-drafter``: training continued across GPU sessions.

A session's GPU time fits about 12 minutes of training; the drafter it trains goes back through the device tool's
$OUT (files of at most 16 MiB) and the next session continues it. These tests train a drafter through the product's
``train_recipe`` on a tiny target, export it in parts, import it into a fresh store as the family's promoted
drafter, and train the next recipe with ``init_from: promoted`` from it: the weights arrive as exported (bfloat16),
the continued run starts from a lower loss and reports the warm start, its export counts the tokens of both runs
and names both recipes, and a damaged part is refused before anything is promoted. A GPU host can be lost
mid-training (the device tool gives an idle machine back), so the train stage also exports each learning-curve
checkpoint as it is saved, and ``bench/smollm2_gpu_poll.sh`` brings the newest export back at every poll: tested
here on a chain's run directory, without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from tests.drafter.test_model import publish_cache, publish_tiny_cache

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dense_target):
    """A store holding one hidden-state shard of the tiny target and the recipe tiny-v1 trained on it."""
    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import save_recipe, train_recipe
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("carry")
    store = LocalStore(tmp / "store")
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    _, cache = publish_tiny_cache(store, tmp, tiny_dense_target)
    base = dict(partitions=("shard-00000",), num_layers=1, block_size=8, epochs=2, batch_size=2, max_anchors=8,
                lr=3e-3, save_every=2, compile=False, checkpoint_dtype="float32")
    recipe = DrafterRecipe(name="tiny-v1", **base)
    save_recipe(store, recipe)
    first = train_recipe(store, "tiny-v1", spec, work_dir=str(tmp / "work"), device="cpu")
    return {"tmp": tmp, "store": store, "spec": spec, "cache": cache, "base": base, "recipe": recipe, "first": first}


def fresh_store(trained, name: str):
    """Another machine's store: the same hidden-state shard, no drafter."""
    from dflash_assets.store.backends import LocalStore

    store = LocalStore(trained["tmp"] / name)
    publish_cache(store, trained["cache"])
    return store


@pytest.mark.slow
def test_an_exported_drafter_continues_training_in_another_store(bench, trained):
    from safetensors.torch import load_file

    from dflash_assets.drafter.promotion import read_promoted
    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import save_recipe, train_recipe
    from dflash_assets.store import layout

    out = trained["tmp"] / "exported"
    doc = bench.export_drafter(trained["store"], trained["recipe"], out, tau=1.25, part_bytes=4096)
    assert len(doc["parts"]) >= 2 and all((out / p).stat().st_size <= 4096 for p in doc["parts"])
    assert doc["sequence_tokens"] == doc["sequence_tokens_total"] == trained["first"]["sequence_tokens"] > 0
    assert doc["lineage"] == ["tiny-v1"] and doc["tau"] == 1.25 and doc["final"]
    assert doc["step"] == trained["first"]["steps"]
    assert json.loads((out / "drafter.json").read_text()) == doc

    store = fresh_store(trained, "store-next")
    imported = bench.import_drafter(out, store, "tiny")
    assert imported == doc
    promoted = read_promoted(store, "tiny")
    assert promoted["tokens"] == doc["sequence_tokens_total"] and promoted["recipe"] == "tiny-v1"
    # the promoted weights are the trained ones, rounded to bfloat16 on the way
    original = load_file(str(trained["store"].local_path(
        layout.drafter_checkpoint_files(trained["store"], "tiny-v1")["model.safetensors"])))
    carried = load_file(str(store.local_path(promoted["files"]["model.safetensors"])))
    assert sorted(carried) == sorted(original)
    for k, v in original.items():
        assert carried[k].dtype == torch.bfloat16 and torch.equal(carried[k], v.to(torch.bfloat16)), k

    recipe = DrafterRecipe(name="tiny-v2", init_from="promoted", **trained["base"])
    save_recipe(store, recipe)
    second = train_recipe(store, "tiny-v2", trained["spec"], work_dir=str(trained["tmp"] / "work-next"),
                          device="cpu")
    assert second["warm_start"]["recipe"] == "tiny-v1" and "skipped" not in second["warm_start"]
    assert second["first_loss"] < 0.9 * trained["first"]["first_loss"], (second["first_loss"],
                                                                         trained["first"]["first_loss"])
    again = bench.export_drafter(store, recipe, trained["tmp"] / "exported-next", warm_start=imported)
    assert again["lineage"] == ["tiny-v1", "tiny-v2"]
    assert again["sequence_tokens"] == second["sequence_tokens"]
    assert again["sequence_tokens_total"] == doc["sequence_tokens_total"] + second["sequence_tokens"]


@pytest.mark.slow
def test_a_damaged_or_missing_part_is_refused_before_anything_is_promoted(bench, trained):
    from dflash_assets.drafter.promotion import read_promoted

    out = trained["tmp"] / "exported-damaged"
    doc = bench.export_drafter(trained["store"], trained["recipe"], out, part_bytes=4096)
    part = out / doc["parts"][1]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    store = fresh_store(trained, "store-damaged")
    with pytest.raises(SystemExit, match="damaged"):
        bench.import_drafter(out, store, "tiny")
    part.unlink()
    with pytest.raises(FileNotFoundError):
        bench.import_drafter(out, store, "tiny")
    assert read_promoted(store, "tiny") is None


def test_the_flags_reach_the_stages_and_the_chain_passes_them(bench):
    args = bench.build_parser().parse_args(["--stage", "train", "--init-drafter", "/tmp/d"])
    assert args.init_drafter == "/tmp/d" and args.export_drafter is None
    args = bench.build_parser().parse_args(["--stage", "eval", "--export-drafter", "/tmp/e"])
    assert args.export_drafter == "/tmp/e" and args.init_drafter is None
    chain = (REPO / "bench" / "smollm2_gpu_chain.sh").read_text()
    assert '${INIT_DRAFTER:+--init-drafter "$INIT_DRAFTER"} --export-drafter "$RUN/drafter"' in chain  # train
    assert '--eval-workers "$EVAL_WORKERS" --export-drafter "$RUN/drafter"' in chain  # eval
    assert bench.DRAFTER_PART_BYTES <= 16 * 2**20  # what a device run brings back per file


@pytest.mark.slow
def test_the_newest_learning_curve_checkpoint_is_exported_once(bench, trained):
    """What the train stage's watcher thread does at each save: the newest curve checkpoint of the recipe, as
    bfloat16 parts, not final; nothing new while no newer one is saved; the parts of an older export deleted."""
    from safetensors.torch import load_file

    out = trained["tmp"] / "exported-curve"
    curve = trained["first"]["curve_checkpoints"]
    assert len(curve) >= 2  # save_every 2
    stale = out / "drafter-000000000000.safetensors.part-00"
    out.mkdir()
    stale.write_bytes(b"an older export")
    step = bench.export_latest_curve_checkpoint(trained["tmp"] / "work", trained["recipe"], out, -1,
                                                part_bytes=4096)
    newest_step, newest_tokens = max(curve)
    assert step == newest_step
    doc = json.loads((out / "drafter.json").read_text())
    assert doc["step"] == newest_step and doc["sequence_tokens"] == newest_tokens and not doc["final"]
    assert doc["tau"] is None and doc["lineage"] == ["tiny-v1"]
    assert not stale.exists() and sorted(p.name for p in out.glob("drafter-*")) == sorted(doc["parts"])
    mtime = (out / "drafter.json").stat().st_mtime_ns
    assert bench.export_latest_curve_checkpoint(trained["tmp"] / "work", trained["recipe"], out, step) == step
    assert (out / "drafter.json").stat().st_mtime_ns == mtime
    # the parts join to the curve checkpoint's weights in bfloat16
    store = fresh_store(trained, "store-curve")
    bench.import_drafter(out, store, "tiny")
    from dflash_assets.drafter.promotion import read_promoted

    carried = load_file(str(store.local_path(read_promoted(store, "tiny")["files"]["model.safetensors"])))
    saved = load_file(str(next((trained["tmp"] / "work").glob(f"tiny-v1-*/curve/curve-step-{newest_step:08d}"
                                                               ".safetensors"))))
    assert all(torch.equal(carried[k], v.to(torch.bfloat16)) for k, v in saved.items())


def run_poll(run: Path, out: Path) -> str:
    out.mkdir(exist_ok=True)
    done = subprocess.run(["bash", str(REPO / "bench" / "smollm2_gpu_poll.sh"), "0"], capture_output=True, text=True,
                          env={**os.environ, "RUN_DIR": str(run), "OUT": str(out)}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_poll_brings_back_the_reports_and_a_changed_drafter(bench, tmp_path):
    from dflash_assets.drafter.recipe import DrafterRecipe

    run = tmp_path / "run"
    (run / "exp").mkdir(parents=True)
    (run / "status").write_text("generate 0\n")
    (run / "train.log").write_text("step 600: loss 3.1\n")
    (run / "exp" / "completions").mkdir()
    (run / "exp" / "completions" / "shard-00008.parquet").write_bytes(b"generated")  # each shard as exported
    (run / "exp" / "completions" / "shard-00009.parquet.tmp").write_bytes(b"gene")  # one being copied: left there
    recipe = DrafterRecipe(name="tiny-v1", partitions=("shard-00000",))
    fields = bench.drafter_fields(recipe, step=600, tokens=1000, final=False, tau=None, warm_start=None)
    weights = {"w": torch.arange(6000, dtype=torch.float32)}
    doc = bench.write_drafter_parts(weights, run / "drafter", fields, part_bytes=4096)

    printed = run_poll(run, tmp_path / "out1")
    assert "step 600: loss 3.1" in printed and "drafter back: tiny-v1 step 600 (training)" in printed
    assert printed.rstrip().endswith("poll again within 30 s")
    with tarfile.open(tmp_path / "out1" / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"status", "train.log", "shard-00008.parquet"} <= names and "drafter.json" not in names
    assert "shard-00009.parquet.tmp" not in names
    back = sorted(p.name for p in (tmp_path / "out1" / "drafter").iterdir())
    assert back == sorted(["drafter.json", *doc["parts"]])

    assert "drafter back" not in run_poll(run, tmp_path / "out2")  # unchanged: the earlier copy is back already
    assert not (tmp_path / "out2" / "drafter").exists()

    weights["w"] += 1  # training saved a newer checkpoint, then the chain ended
    newer = bench.write_drafter_parts(weights, run / "drafter", {**fields, "step": 1200}, part_bytes=4096)
    (run / "done").touch()
    printed = run_poll(run, tmp_path / "out3")
    assert "drafter back: tiny-v1 step 1200" in printed and printed.rstrip().endswith("done")
    assert sorted(p.name for p in (tmp_path / "out3" / "drafter").iterdir()) == sorted(["drafter.json",
                                                                                        *newer["parts"]])
    with tarfile.open(tmp_path / "out3" / "results.tgz") as tar:
        assert "shard-00008.parquet" in {Path(n).name for n in tar.getnames()}

    # polls repeated in one device run write into the same $OUT: one drafter there, the newest
    (run / ".polled-drafter.json").unlink()
    run_poll(run, tmp_path / "out1")
    assert sorted(p.name for p in (tmp_path / "out1").iterdir()) == ["drafter", "results.tgz"]
    assert sorted(p.name for p in (tmp_path / "out1" / "drafter").iterdir()) == sorted(["drafter.json",
                                                                                        *newer["parts"]])


def test_a_poll_on_a_fresh_machine_says_so_at_once(tmp_path):
    """The device tool gives an idle machine back after ~30 s; a poll that lands on the fresh one that follows
    says that the chain is gone and stops, instead of waiting out its WAIT_S on nothing (session 39)."""
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(REPO / "bench" / "smollm2_gpu_poll.sh"), "540"], capture_output=True,
                          text=True, env={**os.environ, "RUN_DIR": str(tmp_path / "run"), "OUT": str(out)}, timeout=30)
    assert done.returncode == 3 and "no chain on this machine" in done.stdout, done
    assert list(out.iterdir()) == []
