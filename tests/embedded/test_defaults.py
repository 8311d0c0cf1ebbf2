"""The embedded default: the tiny dense target (float32 for CPU) and the command that serves it, `transformers serve`
in float32 by default, SGLang with its reasoning parser when asked."""

from __future__ import annotations

import shlex

from dflash_assets.embedded.defaults import (EMBEDDED_DTYPE, default_target_spec, embedded_default_target,
                                             embedded_engine_server)


def test_the_default_target_is_the_tiny_dense_target_in_float32(tiny_dense_target):
    assert embedded_default_target() == tiny_dense_target and (tiny_dense_target / "config.json").is_file()
    spec = default_target_spec()
    assert spec.model_path == str(tiny_dense_target) and spec.dtype == EMBEDDED_DTYPE == "float32"
    assert spec.thinking()  # the tiny target speaks the thinking format


def test_the_engine_command_serves_the_default_target(tiny_dense_target):
    served = shlex.split(embedded_engine_server(port=31234).command)
    assert served[1:3] == ["serve", str(tiny_dense_target)] and served[-2:] == ["--dtype", EMBEDDED_DTYPE]
    assert served[served.index("--host") + 1] == "127.0.0.1" and served[served.index("--port") + 1] == "31234"
    sglang = shlex.split(embedded_engine_server("sglang", port=31234).command)
    assert sglang[sglang.index("--model-path") + 1] == str(tiny_dense_target) and "--dtype" not in sglang
    assert sglang[sglang.index("--reasoning-parser") + 1] == "qwen3"
