"""The target's tokenizer for the engine tests (the tiny target's, loaded once per module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))
