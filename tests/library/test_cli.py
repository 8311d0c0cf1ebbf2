"""`dflash engine`: printed commands, refusal without SGLang, and a real `transformers serve` started
by the CLI and driven through the fleet (OpenAI path, thinking on)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def test_engine_prints_transformers_serve_for_the_embedded_default(capsys, tiny_dense_target, monkeypatch):
    monkeypatch.delenv("DFLASH_TARGET_MODEL", raising=False)
    monkeypatch.delenv("DFLASH_TARGET", raising=False)
    assert main(["engine"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert Path(argv[0]).name == "transformers" or argv[1:3] == ["-m", "transformers.cli.transformers"]
    i = argv.index("serve")
    # the tiny target is served in float32: its bf16 weights decode several times slower on CPU
    assert argv[i + 1:] == [str(tiny_dense_target), "--host", "127.0.0.1", "--port", "8000", "--dtype", "float32"]


def test_engine_prints_sglang_launch_for_a_target(capsys, monkeypatch):
    monkeypatch.setenv("DFLASH_TARGET_MODEL", "/models/Qwen3.6-27B")
    assert main(["engine", "--tp", "4", "--port", "31000", "--served-model-name", "qwen"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[0] == sys.executable and argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[3:] == ["--model-path", "/models/Qwen3.6-27B", "--port", "31000", "--tp", "4", "--host", "127.0.0.1",
                        "--reasoning-parser", "qwen3", "--served-model-name", "qwen"]


def test_engine_refuses_the_old_variable_name(capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_TARGET_MODEL", raising=False)
    monkeypatch.setenv("DFLASH_TARGET", "/models/Qwen3.6-27B")
    assert main(["engine"]) == 2
    assert "DFLASH_TARGET_MODEL" in capsys.readouterr().err


def test_engine_json_and_extra_args(capsys):
    assert main(["engine", "--target", "/m/X", "--kind", "sglang", "--json", "--max-concurrency", "128",
                 "--", "--mem-fraction-static", "0.85"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["argv"][-2:] == ["--mem-fraction-static", "0.85"] and out["url"] == "http://127.0.0.1:30000"
    assert out["endpoint"] == {"url": "http://127.0.0.1:30000", "kind": "sglang", "max_concurrency": 128}
    assert out["target_model"] == "/m/X"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang installed: it would start")
def test_engine_start_sglang_without_sglang_says_how(capsys):
    assert main(["engine", "--target", "/m/X", "--start"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dflash-assets[sglang]'" in err and "sglang.launch_server" in err


def test_parser_is_extensible():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a subcommand is required
    args = parser.parse_args(["engine", "--kind", "transformers"])
    assert args.command == "engine" and callable(args.func)


@pytest.mark.slow
def test_engine_start_detach_then_generate_through_the_fleet(tiny_dense_target, local_store, tmp_path):
    from transformers import AutoTokenizer

    from dflash_assets.generation.completions import GenerationConfig, regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DFLASH_TARGET_MODEL", None)
    env.pop("DFLASH_TARGET", None)
    out = subprocess.run([sys.executable, "-m", "dflash_assets.cli", "engine", "--start", "--detach", "--port", "0",
                          "--log", str(tmp_path / "serve.log"), "--wait-s", "300"],
                         env=env, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stderr
    ready = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        assert ready["endpoint"]["kind"] == "openai" and ready["target_model"] == str(tiny_dense_target)
        rows = [{"prompt_id": "a", "system": "Be brief.", "user_turns": ["Hi", "And then?"]},
                {"prompt_id": "b", "system": None, "user_turns": ["What is DFlash?"]}]
        fleet = EngineFleetConfig(target_model=str(tiny_dense_target),
                                  endpoints=[EndpointConfig(**{**ready["endpoint"], "max_concurrency": 2})])
        gen = GenerationConfig(max_new_tokens=6, enable_thinking=True, stop_after_truncated_turn=False)
        res = regenerate_shard(rows, shard="serve", store=local_store, fleet=fleet, generation=gen)
        tok = AutoTokenizer.from_pretrained(str(tiny_dense_target))
    finally:
        os.kill(ready["pid"], signal.SIGTERM)
    assert res.probe is not None and res.probe.rows[0].status == "ok"
    got = {r["prompt_id"]: r for r in res.table.to_pylist()}
    assert set(got) == {"a", "b"} and res.failed.num_rows == 0
    assert got["a"]["num_turns"] == 2 and [m["role"] for m in got["a"]["messages"]] == \
        ["system", "user", "assistant", "user", "assistant"]
    for r in got.values():  # random weights: assert on structure and counts, not text
        assert all(1 <= n <= 6 for n in r["completion_tokens"])
        assert all(f in ("length", "stop") for f in r["finish_reasons"])
        assert r["served_model"] == str(tiny_dense_target)
    first = [{"role": "user", "content": "What is DFlash?"}]
    assert got["b"]["prompt_tokens"][0] == len(tok.apply_chat_template(first, add_generation_prompt=True,
                                                                      enable_thinking=True, tokenize=True)["input_ids"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the detached server goes away on SIGTERM
        try:
            os.kill(ready["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("server still running after SIGTERM")


def test_every_help_text_is_whole_sentences_and_names_its_command(capsys):
    """`dflash <sub> --help` describes the subcommand in sentences that end; `python -m dagster_project.demo
    --help` calls itself by that command and gives each knob's default for every target."""
    import re

    for name in ("engine", "plan"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        description = " ".join(text.split("\n\n")[1].split())
        assert description[-1] in ".)", f"dflash {name} --help: {description!r}"

    from dagster_project import demo

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m dagster_project.demo ")
    for knob, key in (("--prompts", "prompts"), ("--shard-size", "shard_size"), ("--max-new-tokens", "max_new_tokens"),
                      ("--engine", "engine"), ("--eval-prompts", "eval_prompts"),
                      ("--max-empty-ratio", "max_empty_ratio")):
        expected = ", ".join(f"{d[key]} ({t})" for t, d in demo.TARGET_DEFAULTS.items())
        assert re.search(rf"{knob} \S+ .*?default {re.escape(expected)}", text), (knob, expected, text)
    assert "smollm2 (default)" in text
