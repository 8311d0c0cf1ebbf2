"""The fixtures the bench tests share: bench scripts loaded as modules (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_bench_script(name: str):
    """``bench/<name>.py`` loaded as a module named ``bench_<name>``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def study():
    return load_bench_script("smollm2_study")


@pytest.fixture(scope="module")
def op_counts():
    return load_bench_script("decode_op_counts")
