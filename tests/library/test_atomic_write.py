"""The one atomic writer: the whole new file or the old one, no temporary left behind, a stale one recognizable."""

from __future__ import annotations

import os

import pytest

from dflash_assets.atomic_write import atomic_path, write_atomic
from dflash_assets.drafter.model import _STALE, clean_stale_temps


def test_write_atomic_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    dest = tmp_path / "report.json"
    dest.write_text("old")
    assert write_atomic(dest, '{"new": "ü"}') == dest
    assert dest.read_bytes() == '{"new": "ü"}'.encode()
    write_atomic(dest, b"\x00\x01")
    assert dest.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    dest = tmp_path / "curve.safetensors"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="killed mid-write"):
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.safetensors"]


def test_the_temporary_is_named_for_the_stale_temp_sweep(tmp_path):
    """A killed writer's temporary (`.<name>.tmp-<pid>-…`) is what clean_stale_temps removes once the pid is gone."""
    dest = tmp_path / "latest"
    with atomic_path(dest) as tmp:
        assert tmp.parent == tmp_path and _STALE.fullmatch(tmp.name).group("pid") == str(os.getpid())
        tmp.write_text("step-00000001")
        dead = tmp_path / tmp.name.replace(f"-{os.getpid()}-", "-999999999-")
        dead.write_text("left by a killed writer")
    assert dest.read_text() == "step-00000001"
    assert clean_stale_temps(tmp_path) == [dead] and not dead.exists()


def test_a_caller_names_its_own_temporaries(tmp_path):
    dest = tmp_path / "part.bin"
    with atomic_path(dest, prefix=".dflash-part-1-", suffix=".part") as tmp:
        assert tmp.name.startswith(".dflash-part-1-") and tmp.name.endswith(".part")
        tmp.write_bytes(b"x")
    assert dest.read_bytes() == b"x"
