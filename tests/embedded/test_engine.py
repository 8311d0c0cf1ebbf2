"""The embedded engine on demand: which target it serves, and a server that never becomes ready within the start
timeout fails after its attempts, each attempt's log named in the error. (A real start, `transformers serve`
answering, is covered where the embedded default generates: tests/dagster_project/test_ui_browser.py.)"""

from __future__ import annotations

import pytest

from dflash_assets.embedded.engine import EmbeddedEngine, is_embedded_target


def test_only_the_default_target_is_the_embedded_one(tiny_dense_target, tmp_path):
    assert is_embedded_target(tiny_dense_target) and is_embedded_target(str(tiny_dense_target) + "/")
    assert not is_embedded_target(tmp_path)


def test_a_server_that_never_gets_ready_fails_with_every_attempt_named(tiny_dense_target):
    lines: list[str] = []
    engine = EmbeddedEngine(start_timeout_s=0.05, attempts=2, log=lines.append)
    with pytest.raises(RuntimeError, match="did not start after 2 attempts") as info:
        engine.endpoint()
    assert str(info.value).count("--- last lines of") == 2
    assert [line.split(":")[0] for line in lines] == ["starting the embedded engine (attempt 1/2)",
                                                      "starting the embedded engine (attempt 2/2)"]
    assert not engine.running and engine.server is None
    engine.stop()  # idempotent
