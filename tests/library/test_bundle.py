"""``dflash bundle`` / ``unbundle``: a directory shipped as checksummed parts comes back byte for byte, and a bundle
that is incomplete, damaged or hostile is refused before anything lands in the destination."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest

from dflash_assets.bundle import MANIFEST, BundleError, bundle_path, parse_size, unbundle
from dflash_assets.cli import main


def model_dir(root: Path) -> Path:
    """A directory shaped like a model: config, a binary weight file larger than one part, a nested tokenizer."""
    src = root / "my-model"
    (src / "tokenizer").mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (src / "model.safetensors").write_bytes(os.urandom(70_000))
    (src / "tokenizer" / "tokenizer.json").write_text("{}" * 500)
    (src / "empty.txt").write_bytes(b"")
    return src


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("text, size", [("1048576", 1 << 20), ("512K", 512 << 10), ("40M", 40 << 20),
                                        ("40MiB", 40 << 20), ("40MB", 40 << 20), ("1.5G", 3 << 29), ("2g", 2 << 30)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "forty", "-1M", "0"])
def test_a_bad_size_is_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_a_directory_comes_back_byte_for_byte_through_many_parts(tmp_path):
    src = model_dir(tmp_path)
    manifest = bundle_path(src, tmp_path / "bundle", part_bytes=16 * 1024)
    parts = sorted(p.name for p in (tmp_path / "bundle").iterdir() if p.name != MANIFEST)
    assert parts == [p["name"] for p in manifest["parts"]] and len(parts) >= 5
    assert all(p["bytes"] <= 16 * 1024 for p in manifest["parts"])
    assert sorted(f["path"] for f in manifest["files"]) == [
        "my-model/config.json", "my-model/empty.txt", "my-model/model.safetensors", "my-model/tokenizer/tokenizer.json"]
    out = unbundle(tmp_path / "bundle", tmp_path / "host")
    assert out == tmp_path / "host" / "my-model"
    assert tree(out) == tree(src)
    assert [p.name for p in (tmp_path / "host").iterdir()] == ["my-model"]  # no temporary directory left


def test_the_current_directory_is_bundled_under_its_own_name(tmp_path, monkeypatch):
    src = model_dir(tmp_path)
    monkeypatch.chdir(src)
    bundle_path(".", tmp_path / "bundle", part_bytes=16 * 1024)
    assert tree(unbundle(tmp_path / "bundle", tmp_path / "host")) == tree(src)
    assert (tmp_path / "host" / "my-model").is_dir()


def test_a_single_file_is_bundled_as_itself(tmp_path):
    src = tmp_path / "weights.gguf"
    src.write_bytes(os.urandom(5000))
    bundle_path(src, tmp_path / "b", part_bytes=2048)
    assert unbundle(tmp_path / "b", tmp_path / "host").read_bytes() == src.read_bytes()


def test_a_damaged_or_missing_part_is_named_and_nothing_is_extracted(tmp_path):
    manifest = bundle_path(model_dir(tmp_path), tmp_path / "bundle", part_bytes=16 * 1024)
    first, second = (tmp_path / "bundle" / p["name"] for p in manifest["parts"][:2])
    data = bytearray(first.read_bytes())
    data[100] ^= 0xFF
    first.write_bytes(bytes(data))
    second.unlink()
    with pytest.raises(BundleError) as e:
        unbundle(tmp_path / "bundle", tmp_path / "host")
    assert f"{first.name} is damaged" in str(e.value) and f"{second.name} is missing" in str(e.value)
    assert not (tmp_path / "host").exists()


def test_a_bundle_without_its_manifest_is_incomplete(tmp_path):
    bundle_path(model_dir(tmp_path), tmp_path / "bundle", part_bytes=16 * 1024)
    (tmp_path / "bundle" / MANIFEST).unlink()  # what a writer killed before its last rename leaves
    with pytest.raises(BundleError, match="no manifest.json, so the bundle is incomplete"):
        unbundle(tmp_path / "bundle", tmp_path / "host")


def test_an_existing_destination_and_a_non_empty_bundle_directory_are_refused(tmp_path):
    src = model_dir(tmp_path)
    bundle_path(src, tmp_path / "bundle", part_bytes=16 * 1024)
    with pytest.raises(BundleError, match="is not empty"):
        bundle_path(src, tmp_path / "bundle")
    unbundle(tmp_path / "bundle", tmp_path / "host")
    with pytest.raises(FileExistsError, match="my-model exists"):
        unbundle(tmp_path / "bundle", tmp_path / "host")


def test_a_member_that_escapes_the_destination_is_refused(tmp_path):
    """A crafted bundle whose tar names a path outside the destination, with a manifest that matches its parts."""
    import hashlib

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.part-0000").write_bytes(buf.getvalue())
    manifest = {"format": "dflash-bundle/1", "source": "x", "part_bytes": 1 << 20,
                "parts": [{"name": "x.part-0000", "bytes": len(buf.getvalue()),
                           "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}],
                "files": [{"path": "../escaped.txt", "bytes": 3, "sha256": hashlib.sha256(b"bad").hexdigest()}]}
    (tmp_path / "b" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(tarfile.OutsideDestinationError):
        unbundle(tmp_path / "b", tmp_path / "host")
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "host" / "x").exists()


def test_the_cli_round_trip_and_its_errors(tmp_path, capsys):
    src = model_dir(tmp_path)
    assert main(["bundle", str(src), str(tmp_path / "bundle"), "--part-size", "16K"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["files"] == 4 and made["parts"] >= 5
    assert main(["unbundle", str(tmp_path / "bundle"), str(tmp_path / "host")]) == 0
    assert json.loads(capsys.readouterr().out) == {"unbundled": str(tmp_path / "host" / "my-model")}
    assert tree(tmp_path / "host" / "my-model") == tree(src)
    next(p for p in (tmp_path / "bundle").iterdir() if p.name != MANIFEST).unlink()
    assert main(["unbundle", str(tmp_path / "bundle"), str(tmp_path / "elsewhere")]) == 2
    assert "is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bundle", str(src), str(tmp_path / "b2"), "--part-size", "lots"])


@pytest.mark.parametrize("change,said", [
    ({"source": "../outside"}, "source: string should match pattern"),  # it names the directory extracted to
    ({"format": "dflash-bundle/2"}, "format: input should be 'dflash-bundle/1', got 'dflash-bundle/2'"),
    ({"parts": []}, "parts: list should have at least 1 item after validation, not 0"),
    ({"part_bytes": "1M"}, "part_bytes: input should be a valid integer, got '1M'"),
])
def test_a_manifest_with_a_bad_field_is_refused_naming_it(tmp_path, change, said):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello")
    bundle_path(tmp_path / "src", tmp_path / "b", part_bytes=1 << 20)
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    (tmp_path / "b" / MANIFEST).write_text(json.dumps({**manifest, **change}))
    with pytest.raises(BundleError, match=re.escape(said)):
        unbundle(tmp_path / "b", tmp_path / "host")
    assert not (tmp_path / "host").exists() and not (tmp_path / "outside").exists()
