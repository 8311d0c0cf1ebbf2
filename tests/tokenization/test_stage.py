"""The tokenization stage over a real local store: samples published with the gate that names them, the span markers
taken from the target's own template, the encoder built once per target, and the default thresholds applying
thinking_ratio only when the target's template thinks."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_assets.tokenization.samples import TokenizeConfig
from tests.support.sharegpt import sharegpt_completions
from tests.tokenization.test_samples import assistant, completions, user


@pytest.fixture(scope="module")
def sharegpt():
    return sharegpt_completions(20)


def test_tokenize_partition_publishes_samples_its_gate_names_with_the_targets_own_markers(local_store, sharegpt,
                                                                                         tiny_dense_target):
    """The library stage reads completions from the store, takes the supervised span's markers from the target's
    template (whatever the config says), publishes samples and a gate naming their sha256, and builds the
    target's encoder once per process."""
    from dflash_assets.store import layout
    from dflash_assets.target_model.spec import TargetModelSpec
    from dflash_assets.tokenization import stage
    from dflash_assets.tokenization.quality import QualityThresholds, read_verified_samples, require_quality_gate

    spec = TargetModelSpec(model_path=str(tiny_dense_target))
    chat = spec.chat_conventions()
    local_store.write_parquet(layout.completions("shard-00000"), sharegpt.slice(0, 20))
    lines: list[str] = []
    wrong_markers = TokenizeConfig(max_length=1024, assistant_header="<|nowhere|>", end_of_turn="<|never|>")
    lenient = QualityThresholds(max_empty_ratio=1.0, thinking_floor=0.0, thinking_requested=chat.thinking)
    result = stage.tokenize_partition(local_store, "shard-00000", spec, wrong_markers, lenient, log=lines.append)
    assert result.stats.samples == result.table.num_rows > 0 and result.stats.loss_tokens > 0
    assert lines and lines[0].startswith(f"shard-00000: {result.stats.samples} samples from 20 conversations")
    gate = require_quality_gate(local_store, "shard-00000")
    assert gate["data_version"] == result.data_version == gate["samples_sha256"][:16]
    assert read_verified_samples(local_store, "shard-00000", gate).equals(result.table)
    assert set(result.outcomes) == set(gate["checks"]) and result.outcomes["schema"].passed
    encoder, _ = stage.target_encoder(spec)
    row = result.table.slice(0, 1).to_pylist()[0]
    supervised = encoder.decode(np.array(row["input_ids"])[np.array(row["loss_mask"], dtype=bool)])
    assert supervised.endswith(chat.end_of_turn)
    assert stage.target_encoder(spec)[0] is encoder  # cached per target, per process


def test_tokenize_partition_without_thresholds_checks_thinking_as_the_target_decides(local_store, tiny_dense_target):
    """No thresholds given: the defaults, with thinking_ratio applying only when the target's template thinks."""
    from dflash_assets.store import layout
    from dflash_assets.target_model.spec import TargetModelSpec
    from dflash_assets.tokenization.stage import tokenize_partition

    local_store.write_parquet(layout.completions("shard-00000"), completions(
        [[user(f"question {i}"), assistant(f"a long enough answer number {i}, " * 8)] for i in range(30)]))
    thinking = TargetModelSpec(model_path=str(tiny_dense_target))
    plain = TargetModelSpec(model_path=str(tiny_dense_target), chat_template_kwargs={"enable_thinking": False})
    assert thinking.thinking() and not plain.thinking()
    on = tokenize_partition(local_store, "shard-00000", thinking).outcomes["thinking_ratio"]
    off = tokenize_partition(local_store, "shard-00000", plain).outcomes["thinking_ratio"]
    assert on.metadata["applicable"] and not on.passed  # no answer has reasoning: the check fails
    assert not off.metadata["applicable"] and off.passed
