"""Tiny targets for tests and the embedded default: random init, then taught the chat format.

Builds, once per machine, two deterministic causal LMs that use the Qwen3.5/3.6
tokenizer of `dflash_assets.target_model.tokenizer` and load with
`AutoModelForCausalLM.from_pretrained(dir)`:

- "dense":  `qwen3` (Qwen3ForCausalLM), 8 layers, hidden 64, 4 heads, 2 KV heads,
  head_dim 16, intermediate 128.
- "hybrid": `qwen3_5_text` (Qwen3_5ForCausalLM), 8 layers, layer_types
  3 x linear_attention + full_attention, twice; same widths.

Eight layers each, so the DFlash default rule (5 layers evenly from 1 to L-3)
gives the distinct ids [1, 2, 3, 4, 5] and layers 6-7 come after the last
captured one. Both have vocab_size 248,320 (the real Qwen3.5/3.6 embedding size, a
multiple of 128, covering the tokenizer's 248,078 ids incl. `<|MASK|>`),
untied embed_tokens / lm_head (like the real targets, so code that confuses
the two fails), and are stored as bf16 safetensors (~64 MB per target; the
two 248K x 64 matrices dominate). Each directory also holds the tokenizer
files, `chat_template.jinja` and `generation_config.json`, so
`AutoTokenizer.from_pretrained(dir)` and `transformers serve <dir>` work.

A purely random model never writes `</think>` nor `<|im_end|>`, so every
completion it generates is "all reasoning, empty answer" and the pipeline's
`empty_response_ratio` check fails. After its seeded random init the dense
target (the embedded default) is therefore trained briefly on one CPU core
(`tiny_target_training.teach_chat_format`: 240 steps on synthetic ShareGPT
chats rendered with the chat template, ~45-60 s) to answer in the thinking
format: `Okay, ...` reasoning of ~16 tokens, `\\n</think>\\n\\n`, an answer of
~24 tokens, `<|im_end|>`; then its greedy bfloat16 answers to 40 held-out ShareGPT prompts must keep that
format (95%), or it trains on in rounds of 80 steps until they do (`teach_until_well_formed`: how well a
short run learns depends on the CPU's kernels). Rows of embed_tokens / lm_head for ids absent from
that data keep their random values. The hybrid stays random (see
`TINY_TARGET_TRAINING`). How a target was trained (settings, steps, losses,
data; null when it was not) is recorded in the directory's
`dflash_tiny_target.json` under "training".

Writes `<cache>/<kind>-<key>/` where cache is `cache_dir`, else
`$DFLASH_CACHE/targets`, else `~/.cache/dflash-assets/targets`. The key
(`target_fingerprint`) hashes what builds the target: the bytes of this module
and of every project module it imports (training, tokenizer, chat template,
the ShareGPT reader, ...), the input files (ShareGPT file, tiktoken ranks,
packaged chat template), the architecture and training settings, and the
torch/transformers/tokenizers/safetensors/jinja2 versions, and the CPU kernel level
torch dispatches to (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...;
`ATEN_CPU_CAPABILITY` sets it), because the trained bytes depend on it: one machine built three
different dense targets under DEFAULT, AVX2 and AVX512. A forced level below AVX-512 also caps oneDNN
(`cap_onednn_to_kernel_level`: ONEDNN_MAX_CPU_ISA, which then joins the key), as a CPU of that level would.
The inputs are recorded in the directory's marker under "fingerprint". Any change builds a
new directory; no version string to bump. A target is built in a temp dir
beside it and renamed into place, so concurrent processes never see a partial
directory; builders of one target also take a file lock (`.<name>.lock`
beside it), so concurrent first uses build it once and the others wait.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from dataclasses import asdict
from typing import Literal

from dflash_assets.cache_keys import Fingerprint, build_fingerprint, build_lock
from dflash_assets.target_model.chat_template import DEFAULT_TEMPLATE_NAME, TEMPLATES_DIR, default_chat_template
from dflash_assets.embedded.tiny_target_training import ChatFormatTraining, teach_until_well_formed
from dflash_assets.prompts.sources import embedded_sharegpt_path
from dflash_assets.target_model.tokenizer import (
    QWEN3_6_EOS_TOKEN,
    QWEN3_6_MASK_TOKEN_ID,
    QWEN3_6_PAD_TOKEN,
    build_qwen3_6_tokenizer,
    default_cache_root,
    qwen3_6_build_id,
    qwen3_6_tiktoken_path,
)

TargetKind = Literal["dense", "hybrid"]

TINY_TARGET_SEED = 1234
TINY_VOCAB_SIZE = 248_320  # = real Qwen3.5/3.6; multiple of 128, > QWEN3_6_MASK_TOKEN_ID
COMPLETE_MARKER = "dflash_tiny_target.json"

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=248046,  # <|im_end|>
    pad_token_id=248044,  # <|endoftext|>
)

TINY_TARGET_SETTINGS: dict[str, dict] = {
    "dense": dict(_COMMON, model_type="qwen3", num_hidden_layers=8, rope_theta=1_000_000.0),
    "hybrid": dict(
        _COMMON,
        model_type="qwen3_5_text",
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
}


# How each target is taught the chat format after its random init (`teach_until_well_formed`); None: left random.
# The hybrid stays random: Transformers' PyTorch fallback for its linear-attention layers makes training it
# ~2.5x slower than the dense (~100 s for the same steps on one core; 80 steps, ~50 s, are not enough), and
# it serves only hidden-state capture tests, where random weights do.
TINY_TARGET_TRAINING: dict[str, ChatFormatTraining | None] = {
    "dense": ChatFormatTraining(seed=TINY_TARGET_SEED),
    "hybrid": None,
}


def default_targets_dir() -> Path:
    """`$DFLASH_CACHE/targets`, else `~/.cache/dflash-assets/targets`."""
    return default_cache_root() / "targets"


# Libraries whose versions shape the built bytes: weights (torch), model classes and generation config
# (transformers), the tokenizer pipeline (tokenizers), the file format (safetensors), the rendered chats (jinja2).
BUILD_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "jinja2")


def target_fingerprint(kind: str) -> Fingerprint:
    """What builds the `kind` target (code, data, settings, library versions) and its digest: the cache key."""
    training = TINY_TARGET_TRAINING[kind]
    files = [qwen3_6_tiktoken_path(), TEMPLATES_DIR / DEFAULT_TEMPLATE_NAME]
    if training is not None:
        files.append(embedded_sharegpt_path())
    settings = {"kind": kind, "seed": TINY_TARGET_SEED, "architecture": TINY_TARGET_SETTINGS[kind],
                "training": _training_settings(kind), "tokenizer": qwen3_6_build_id(),
                "cpu_capability": cpu_capability()}
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):  # oneDNN's kernels train it too (unset: none of the keys change)
        settings["onednn_max_cpu_isa"] = os.environ["ONEDNN_MAX_CPU_ISA"].upper()
    return build_fingerprint(modules=[__name__], files=files, settings=settings, packages=BUILD_PACKAGES)


# oneDNN's instruction-set cap for each torch kernel level below AVX-512 (ONEDNN_MAX_CPU_ISA's names).
ONEDNN_ISA_FOR_KERNEL_LEVEL = {"default": "SSE41", "avx2": "AVX2"}


def cap_onednn_to_kernel_level(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make `ATEN_CPU_CAPABILITY=avx2|default` emulate such a CPU for oneDNN too (sets ONEDNN_MAX_CPU_ISA unless
    set already); returns the cap in force, or None.

    On a CPU with AMX (Sapphire Rapids and later), torch 2.13 under a lowered kernel level still has oneDNN ask for
    VNNI-packed bfloat16 operands, which only the AVX-512 kernels can pack: bfloat16 SDPA fails with "pack_vnni2 is
    only supported when avx512 is supported" (the tiny target's format check and `transformers serve` both run
    it). A real AVX2 CPU has no AMX, so capping oneDNN at the same level is what the emulation should be anyway.
    oneDNN reads the variable once, at the process's first oneDNN call: call this at a process's start, or on the
    environment of a child process to be started (`environ`).
    """
    environ = os.environ if environ is None else environ
    isa = ONEDNN_ISA_FOR_KERNEL_LEVEL.get(environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())
    if isa is not None and not environ.get("ONEDNN_MAX_CPU_ISA"):
        environ["ONEDNN_MAX_CPU_ISA"] = isa
    return environ.get("ONEDNN_MAX_CPU_ISA")


def cpu_capability() -> str:
    """The CPU kernel level torch runs its float kernels at here (DEFAULT, AVX2, AVX512, ...).

    Part of the tiny targets' cache key: the same code, data and seed give other weights under
    other kernels (float sums in another order), so a target is only reused where it was built
    with the same kernels. `ATEN_CPU_CAPABILITY=default|avx2|avx512` tries another machine's.
    """
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def _training_settings(kind: str) -> dict | None:
    training = TINY_TARGET_TRAINING[kind]
    return asdict(training) if training is not None else None


def _make_config(kind: str):
    from transformers import Qwen3_5TextConfig, Qwen3Config

    settings = dict(TINY_TARGET_SETTINGS[kind])
    model_type = settings.pop("model_type")
    if model_type == "qwen3":
        theta = settings.pop("rope_theta")
        return Qwen3Config(**settings, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return Qwen3_5TextConfig(**settings)


def _build(kind: str, out: Path) -> dict | None:
    """Write model, tokenizer, chat template and generation config into `out`; return the training report."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = build_qwen3_6_tokenizer()
    config = _make_config(kind)
    torch.manual_seed(TINY_TARGET_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    training = TINY_TARGET_TRAINING[kind]
    report = teach_until_well_formed(model, tok, training) if training is not None else None
    model = model.to(torch.bfloat16).eval()
    # Sampling defaults as real Qwen3 checkpoints ship them (thinking mode): a server that starts from
    # this file (`transformers serve`) samples unless a request asks for temperature 0.
    model.generation_config = GenerationConfig(
        eos_token_id=[248046, 248044],  # <|im_end|>, <|endoftext|>
        pad_token_id=248044,
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
    )
    model.save_pretrained(out, safe_serialization=True)

    tok.save_pretrained(out)
    # A plain fast-tokenizer class: a model-specific class (Qwen2Tokenizer) would
    # rebuild its own pre-tokenizer in v5 and drift from the Qwen3.5 pattern.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Listing the added tokens here (as real Qwen checkpoints do) spares AutoTokenizer a
    # ~2 s pure-Python parse of the 33 MB tokenizer.json on every load.
    tok_cfg["added_tokens_decoder"] = {
        str(index): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for index, t in sorted(tok.added_tokens_decoder.items())
    }
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    template_file = out / "chat_template.jinja"
    if not template_file.exists():
        template_file.write_text(default_chat_template(), "utf-8")
    return report.to_dict() if report is not None else None


def tiny_target_path(kind: TargetKind = "dense", cache_dir: str | Path | None = None) -> Path:
    """Directory of the tiny `kind` target, building it on first use (~30-60 s on one core).

    Safe under concurrent processes: builders take a file lock, so one builds
    while the others wait; each builds into its own temp dir and renames it into
    place, so readers never see a partial directory.
    """
    if kind not in TINY_TARGET_SETTINGS:
        raise ValueError(f"unknown tiny target kind {kind!r}; expected one of {sorted(TINY_TARGET_SETTINGS)}")
    cap_onednn_to_kernel_level()  # before the build's first bfloat16 attention (a no-op unless a level is forced)
    root = Path(cache_dir) if cache_dir is not None else default_targets_dir()
    fingerprint = target_fingerprint(kind)
    final = root / f"{kind}-{fingerprint.digest}"
    if (final / COMPLETE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with build_lock(root / f".{final.name}.lock"):
        if not (final / COMPLETE_MARKER).exists():
            _build_into(kind, root, final, fingerprint)
    return final


def _build_into(kind: str, root: Path, final: Path, fingerprint: Fingerprint) -> None:
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{kind}-building-"))
    try:
        training = _build(kind, tmp)
        marker = {"kind": kind, "seed": TINY_TARGET_SEED, "settings": TINY_TARGET_SETTINGS[kind],
                  "mask_token_id": QWEN3_6_MASK_TOKEN_ID, "eos_token": QWEN3_6_EOS_TOKEN,
                  "pad_token": QWEN3_6_PAD_TOKEN, "training": training,
                  "fingerprint": {"digest": fingerprint.digest, **fingerprint.inputs}}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the target is shared, read-only data
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / COMPLETE_MARKER).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
