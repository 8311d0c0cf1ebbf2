"""Two copies of the tiny target under the same basename, one weight byte apart (a fine-tune written in place)."""

from __future__ import annotations

import shutil

import pytest

from dflash_assets.target_model.spec import TargetModelSpec


@pytest.fixture
def two_targets(tiny_dense_target, tmp_path):
    """``a/m`` and ``b/m``: copies of the tiny target; b has one weight byte changed (past the safetensors header)."""
    a, b = tmp_path / "a" / "m", tmp_path / "b" / "m"
    shutil.copytree(tiny_dense_target, a)
    shutil.copytree(tiny_dense_target, b)
    weights = b / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return TargetModelSpec(model_path=str(a), dtype="float32"), TargetModelSpec(model_path=str(b), dtype="float32")
