"""Near duplicates by MinHash over word shingles, with an LSH index to find candidates.

A text's shingles are the word n-grams (5 by default) of its normalized form
(:func:`dflash_assets.prompts.text_filters.normalized_text`; a text of fewer words is one shingle, itself), the
rule of the drafter's decontamination. :func:`minhash` (and :func:`minhash_many`, over many texts at once)
gives its signature: ``num_perm`` minima of multiply-shift hashes ``((a * h + b) mod 2^64) >> 32`` (``a`` odd)
over 32-bit shingle hashes (CRC-32), computed with numpy; two signatures agree in a share of positions that
estimates the Jaccard similarity of the shingle sets.
:class:`MinHashIndex` buckets signatures by bands (``bands`` x ``rows`` = ``num_perm``) and answers the
indexed text most similar to a query among those sharing a band, when its estimated Jaccard is at least the
threshold. With 32 bands of 4 rows a pair at Jaccard 0.7 shares a band with probability 0.9998.

Pure: reads and writes nothing (an index is in memory; callers store its signatures where they like).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_assets.prompts.text_filters import normalized_text

__all__ = ["NGRAM", "NUM_PERM", "BANDS", "shingles", "minhash", "minhash_many", "jaccard", "estimated_jaccard", "MinHashIndex",
           "NearMatch"]

NGRAM = 5
NUM_PERM = 128
BANDS = 32
_SEED = 0x5EED


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def shingles(text: str, n: int = NGRAM) -> frozenset[str]:
    """The word ``n``-grams of the normalized text; a shorter non-empty text is one shingle (itself)."""
    words = normalized_text(text).split()
    if not words:
        return frozenset()
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """Exact Jaccard similarity of two shingle sets (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def _shingle_hashes(text: str, n: int) -> np.ndarray:
    grams = shingles(text, n)
    return np.fromiter((zlib.crc32(g.encode("utf-8")) for g in grams), dtype=np.uint64, count=len(grams))


def minhash(text: str, num_perm: int = NUM_PERM, n: int = NGRAM) -> np.ndarray:
    """The MinHash signature of ``text`` (``num_perm`` uint32 values); all-max for a text with no shingle."""
    return minhash_many([text], num_perm, n)[0]


def minhash_many(texts: Sequence[str], num_perm: int = NUM_PERM, n: int = NGRAM,
                 chunk_shingles: int = 1024) -> np.ndarray:
    """Signatures of ``texts``, shape (len(texts), ``num_perm``), computed over many texts' shingles at once."""
    a, b = _permutations(num_perm)
    out = np.full((len(texts), num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
    start = 0
    while start < len(texts):
        rows, hashes, total = [], [], 0
        while start < len(texts) and (total < chunk_shingles or not rows):
            h = _shingle_hashes(texts[start], n)
            if len(h):
                rows.append(start)
                hashes.append(h)
                total += len(h)
            start += 1
        if not rows:
            continue
        h = np.concatenate(hashes)
        offsets = np.cumsum([0] + [len(x) for x in hashes[:-1]])
        values = (h[:, None] * a[None, :] + b[None, :]) >> np.uint64(32)  # (shingles, num_perm), mod 2^64
        out[rows] = np.minimum.reduceat(values, offsets, axis=0).astype(np.uint32)
    return out


def estimated_jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """The share of positions where two signatures agree."""
    return float(np.mean(x == y))


@dataclass(frozen=True)
class NearMatch:
    key: str  # the indexed text's key
    jaccard: float  # estimated from the signatures


class MinHashIndex:
    """Signatures bucketed by LSH bands; ``query`` finds the most similar indexed text at or above ``threshold``.

    A band's key is a 64-bit hash of its rows (a rare collision only adds a candidate, which the estimate then
    rejects)."""

    def __init__(self, threshold: float = 0.7, num_perm: int = NUM_PERM, bands: int = BANDS):
        if num_perm % bands:
            raise ValueError(f"bands ({bands}) must divide num_perm ({num_perm})")
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        self.threshold, self.num_perm, self.bands, self.rows = threshold, num_perm, bands, num_perm // bands
        self.keys: list[str] = []
        self._signatures = np.zeros((0, num_perm), dtype=np.uint32)
        self._size = 0
        self._buckets: list[dict[int, list[int]]] = [{} for _ in range(bands)]
        self._mix = np.random.default_rng(_SEED + 1).integers(1, 2**63, size=self.rows, dtype=np.uint64) | 1

    def __len__(self) -> int:
        return self._size

    def _band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """(n, bands) uint64 keys of the signatures' bands."""
        parts = signatures.reshape(len(signatures), self.bands, self.rows).astype(np.uint64)
        with np.errstate(over="ignore"):
            return (parts * self._mix).sum(axis=2)

    def add(self, key: str, signature: np.ndarray) -> None:
        self.add_many([key], np.asarray(signature)[None, :] if np.ndim(signature) == 1 else signature)

    def add_many(self, keys: Sequence[str], signatures: np.ndarray) -> None:
        """Index ``signatures`` (shape (len(keys), num_perm)) under ``keys``."""
        if signatures.ndim != 2 or signatures.shape[1] != self.num_perm or len(signatures) != len(keys):
            raise ValueError(f"signatures of shape {signatures.shape}, the index takes ({len(keys)}, {self.num_perm})")
        first = self._size
        if first + len(keys) > len(self._signatures):  # grow by doubling
            grown = np.zeros((max(2 * len(self._signatures), first + len(keys)), self.num_perm), dtype=np.uint32)
            grown[:first] = self._signatures[:first]
            self._signatures = grown
        self._signatures[first:first + len(keys)] = signatures
        self._size += len(keys)
        self.keys.extend(keys)
        for band, column in zip(self._buckets, self._band_keys(signatures).T.tolist()):
            for i, k in enumerate(column, start=first):
                band.setdefault(k, []).append(i)

    def query(self, signature: np.ndarray) -> NearMatch | None:
        """The indexed text with the highest estimated Jaccard at or above the threshold, else None."""
        if np.shape(signature) != (self.num_perm,):
            raise ValueError(f"signature of shape {np.shape(signature)}, the index takes ({self.num_perm},)")
        keys = self._band_keys(np.asarray(signature)[None, :])[0].tolist()
        candidates = sorted({i for band, k in zip(self._buckets, keys) for i in band.get(k, ())})
        if not candidates:
            return None
        shares = (self._signatures[candidates] == signature[None, :]).mean(axis=1)
        best = int(np.argmax(shares))
        j = float(shares[best])
        return NearMatch(self.keys[candidates[best]], j) if j >= self.threshold else None
