"""Near duplicates by MinHash over word shingles, with an LSH index to find candidates.

A text's shingles are the word n-grams (5 by default) of its normalized form
(:func:`dflash_assets.prompts.text_filters.normalized_text`; a text of fewer words is one shingle, itself), the
rule of the drafter's decontamination. :func:`minhash` gives its signature: ``num_perm`` minima of universal
hashes ``(a * h + b) mod (2^31 - 1)`` over 32-bit shingle hashes (blake2b), computed with numpy; two signatures
agree in a share of positions that estimates the Jaccard similarity of the shingle sets.
:class:`MinHashIndex` buckets signatures by bands (``bands`` x ``rows`` = ``num_perm``) and answers the
indexed text most similar to a query among those sharing a band, when its estimated Jaccard is at least the
threshold. With 32 bands of 4 rows a pair at Jaccard 0.7 shares a band with probability 0.9998.

Pure: reads and writes nothing (an index is in memory; callers store its signatures where they like).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from dflash_assets.prompts.text_filters import normalized_text

__all__ = ["NGRAM", "NUM_PERM", "BANDS", "shingles", "minhash", "jaccard", "estimated_jaccard", "MinHashIndex",
           "NearMatch"]

NGRAM = 5
NUM_PERM = 128
BANDS = 32
_PRIME = np.uint64((1 << 31) - 1)
_SEED = 0x5EED


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    a = rng.integers(1, int(_PRIME), size=num_perm, dtype=np.uint64)
    b = rng.integers(0, int(_PRIME), size=num_perm, dtype=np.uint64)
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


def minhash(text: str, num_perm: int = NUM_PERM, n: int = NGRAM) -> np.ndarray:
    """The MinHash signature of ``text`` (``num_perm`` uint32 values); all-max for a text with no shingle."""
    grams = shingles(text, n)
    if not grams:
        return np.full(num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
    h = np.fromiter((int.from_bytes(hashlib.blake2b(g.encode("utf-8"), digest_size=4).digest(), "little")
                     for g in grams), dtype=np.uint64, count=len(grams)) % _PRIME
    a, b = _permutations(num_perm)
    values = (h[:, None] * a[None, :] + b[None, :]) % _PRIME  # (shingles, num_perm); a*h < 2^62
    return values.min(axis=0).astype(np.uint32)


def estimated_jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """The share of positions where two signatures agree."""
    return float(np.mean(x == y))


@dataclass(frozen=True)
class NearMatch:
    key: str  # the indexed text's key
    jaccard: float  # estimated from the signatures


class MinHashIndex:
    """Signatures bucketed by LSH bands; ``query`` finds the most similar indexed text at or above ``threshold``."""

    def __init__(self, threshold: float = 0.7, num_perm: int = NUM_PERM, bands: int = BANDS):
        if num_perm % bands:
            raise ValueError(f"bands ({bands}) must divide num_perm ({num_perm})")
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        self.threshold, self.num_perm, self.bands, self.rows = threshold, num_perm, bands, num_perm // bands
        self.keys: list[str] = []
        self.signatures: list[np.ndarray] = []
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]

    def __len__(self) -> int:
        return len(self.keys)

    def _bands(self, signature: np.ndarray) -> list[bytes]:
        return [signature[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def add(self, key: str, signature: np.ndarray) -> None:
        if signature.shape != (self.num_perm,):
            raise ValueError(f"signature of shape {signature.shape}, the index takes ({self.num_perm},)")
        i = len(self.keys)
        self.keys.append(key)
        self.signatures.append(signature)
        for band, bucket in zip(self._bands(signature), self._buckets):
            bucket.setdefault(band, []).append(i)

    def query(self, signature: np.ndarray) -> NearMatch | None:
        """The indexed text with the highest estimated Jaccard at or above the threshold, else None."""
        candidates = {i for band, bucket in zip(self._bands(signature), self._buckets) for i in bucket.get(band, ())}
        best: NearMatch | None = None
        for i in sorted(candidates):
            j = estimated_jaccard(signature, self.signatures[i])
            if j >= self.threshold and (best is None or j > best.jaccard):
                best = NearMatch(self.keys[i], j)
        return best
