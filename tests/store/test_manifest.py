"""Multi-file outputs publish as one: a kill between files leaves readers the old complete set.

Cache parts and drafter checkpoints go under a fresh version prefix, a manifest
written last names them, readers trust only the manifest, and stale files and
scratch directories of killed runs are removed at the next start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_assets.hidden_states import stage
from dflash_assets.hidden_states.capture import CaptureSpec
from dflash_assets.hidden_states.format import HiddenStateCacheReader, bytes_per_token
from dflash_assets.store import layout
from dflash_assets.store.manifest import publish_files, remove_stale_scratch, scratch_prefix


class Killed(BaseException):
    """Stands for SIGKILL: nothing after the raise runs (BaseException, so no ``except Exception`` catches it)."""


class KillAfterUploads:
    """A store that dies on the ``n + 1``-th ``upload_file``: the first ``n`` uploads complete, nothing after."""

    def __init__(self, store, n: int):
        self._store, self._left = store, n

    def upload_file(self, key, path):
        if self._left == 0:
            raise Killed(f"killed before uploading {key}")
        self._left -= 1
        self._store.upload_file(key, path)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _samples(lengths, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_id": f"p{i}", "input_ids": rng.integers(0, 1000, n).astype(np.int32),
             "loss_mask": np.ones(n, np.uint8)} for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def dense(tiny_dense_target):
    from dflash_assets.hidden_states.capture import load_target

    return tiny_dense_target, load_target(tiny_dense_target, "cpu", "float32")


def _spec(path, version: str) -> CaptureSpec:
    # two samples of 20 tokens, parts of at most 20 tokens' bytes: two parts
    return CaptureSpec(target=str(path), layer_ids=(1,), dtype="float32", tokens_per_batch=64,
                       max_part_bytes=20 * bytes_per_token(1, 64, "float32"), upstream_data_version=version,
                       tokenizer_hash="t")


def test_a_kill_between_cache_parts_leaves_readers_the_old_complete_set(dense, local_store):
    path, model = dense
    old = stage.write_hidden_state_cache(local_store, "shard-00001", _samples([20, 20], 0), _spec(path, "old"),
                                         models=[model])
    assert len(old.keys) == 2
    with pytest.raises(Killed):  # the new run dies after its first part is in the store
        stage.write_hidden_state_cache(KillAfterUploads(local_store, 1), "shard-00001", _samples([20, 20], 1),
                                       _spec(path, "new"), models=[model])
    assert len([k for k in local_store.list("hidden_state_cache") if k.endswith(".safetensors")]) == 3
    keys = layout.list_hidden_state_parts(local_store)["shard-00001"]
    assert keys == list(old.keys)  # the manifest still names the old parts only
    with HiddenStateCacheReader.from_store(local_store, keys) as reader:
        assert {p.meta.upstream_data_version for p in reader.parts} == {"old"} and len(reader) == 2

    # the next complete run switches to its parts and removes the old ones and the killed run's orphan
    new = stage.write_hidden_state_cache(local_store, "shard-00001", _samples([20, 20], 2), _spec(path, "new"),
                                         models=[model])
    assert sorted(local_store.list("hidden_state_cache")) == sorted([*new.keys, layout.hidden_state_manifest("shard-00001")])
    with HiddenStateCacheReader.from_store(local_store, layout.list_hidden_state_parts(local_store)["shard-00001"]) as r:
        assert {p.meta.upstream_data_version for p in r.parts} == {"new"}


def test_a_kill_between_checkpoint_files_leaves_the_old_checkpoint(local_store, tmp_path):
    def files(tag):
        d = tmp_path / tag
        d.mkdir()
        for name in ("model.safetensors", "config.json", "train_metrics.json"):
            (d / name).write_text(f"{tag} {name}")
        return {n: d / n for n in ("model.safetensors", "config.json", "train_metrics.json")}

    name = "demo-v1"
    local_store.write_bytes(layout.drafter_checkpoint_file(name, "config.json"), b"pre-manifest config")
    local_store.write_bytes(layout.drafter_checkpoint_file(name, "model.safetensors"), b"pre-manifest model")
    legacy = layout.drafter_checkpoint_files(local_store, name, ("model.safetensors", "config.json"))
    assert local_store.read_bytes(legacy["config.json"]) == b"pre-manifest config"  # read before any manifest

    publish_files(local_store, layout.drafter_checkpoint_manifest(name), layout.drafter_checkpoint_prefix(name),
                  files("one"), stale=list(legacy.values()))
    assert not local_store.exists(layout.drafter_checkpoint_file(name, "config.json"))  # the old layout is gone
    with pytest.raises(Killed):  # new model uploaded, then killed before the config
        publish_files(KillAfterUploads(local_store, 1), layout.drafter_checkpoint_manifest(name),
                      layout.drafter_checkpoint_prefix(name), files("two"))
    current = layout.drafter_checkpoint_files(local_store, name)
    assert {n: local_store.read_bytes(k).decode() for n, k in current.items()} == {
        "model.safetensors": "one model.safetensors", "config.json": "one config.json",
        "train_metrics.json": "one train_metrics.json"}


def test_scratch_directories_of_dead_processes_are_removed_at_the_next_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited
    left = tmp_path / f"dflash-hidden-{dead_pid}-abc"
    (left / "sub").mkdir(parents=True)
    (left / "sub" / "part.safetensors").write_bytes(b"x" * 100)
    mine = Path(tempfile.mkdtemp(prefix=scratch_prefix("hidden"), dir=tmp_path))
    other_tag = tmp_path / f"dflash-parts-{dead_pid}-abc"
    other_tag.mkdir()
    assert remove_stale_scratch(tmp_path, "hidden") == [left]
    assert not left.exists() and mine.exists() and other_tag.exists()


def test_training_state_temp_dirs_of_a_killed_run_are_cleaned_and_a_moved_aside_copy_restored(tmp_path):
    from dflash_assets.drafter.model import clean_stale_temps

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    half = tmp_path / f".step-00000004.tmp-{dead}-x1"
    half.mkdir()
    (half / "drafter.safetensors").write_bytes(b"half")
    latest_tmp = tmp_path / f".latest.tmp-{dead}"
    latest_tmp.write_text("step-00000004")
    aside = tmp_path / f".drafter.old-{dead}"  # killed between moving the old checkpoint aside and the new rename
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    live = tmp_path / f".step-00000006.tmp-{os.getpid()}-x2"  # a writer that still runs: left alone
    live.mkdir()
    removed = clean_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == sorted([half.name, latest_tmp.name])
    assert (tmp_path / "drafter" / "config.json").exists() and live.exists() and not aside.exists()


def test_training_state_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    """Every file of a state directory is fsynced before the directory is renamed into place."""
    from dflash_assets.drafter import model as model_mod
    from dflash_assets.drafter.state import save_training_state

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(model_mod.os, "fsync", fsync)
    monkeypatch.setattr(model_mod.os, "replace", replace)
    drafter = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(drafter.parameters())
    drafter(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dest = save_training_state(tmp_path / "state", 3, drafter, opt, sched, {}, {"losses": torch.zeros(1)})
    rename = events.index(("rename", str(dest)))
    synced = {Path(p).name for kind, p in events[:rename] if kind == "fsync"}
    assert {"drafter.safetensors", "optimizer.safetensors", "history.safetensors", "trainer.json"} <= synced


@pytest.mark.parametrize("doc,said", [
    ({"format": "dflash-manifest/v2", "version": "v", "files": []}, "format: input should be 'dflash-manifest/v1', got 'dflash-manifest/v2'"),
    ({"format": "dflash-manifest/v1", "version": "v", "files": [{"name": "a", "key": "k", "bytes": -1}]},
     "files.0.bytes: input should be greater than or equal to 0, got -1"),
    ({"format": "dflash-manifest/v1", "version": "v", "files": "a.safetensors"}, "files: input should be a valid list"),
])
def test_a_malformed_stored_manifest_fails_naming_the_field(local_store, doc, said):
    from dflash_assets.store.manifest import read_manifest

    local_store.write_json("m/manifest.json", doc)
    with pytest.raises(ValueError, match="m/manifest.json: not a dflash-manifest/v1 manifest: " + re.escape(said)):
        read_manifest(local_store, "m/manifest.json")
    assert read_manifest(local_store, "other/manifest.json") is None
