"""The fixture the bench tests share: ``bench/smollm2_product.py`` loaded as a module (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_smollm2_product", REPO / "bench" / "smollm2_product.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
