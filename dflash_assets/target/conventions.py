"""The DFlash conventions every stage shares: which target layers feed the drafter, and its mask token.

One implementation, used by the target spec (`target_model`), the drafter and
its training, so the cache, training and evaluation agree. Pure Python (no
third-party import), so the GPU hosts' code paths import it with only torch
present. Reads a target's `tokenizer.json` when asked for its mask token;
writes nothing.

- Layer rule (public DFlash / SpecForge): `n` ids evenly spaced from layer 1 to
  L-3, `round(1 + i * (L - 4) / (n - 1))` (Python rounding); `[L // 2]` for
  n = 1. 36 layers -> [1, 9, 17, 25, 33]; 64 -> [1, 16, 31, 46, 61]. Layer id
  i is the output of decoder layer i = HF `hidden_states[i + 1]`. An explicit
  list always wins over the rule (the callers apply that).
- Mask token: an explicit id wins; else the named token (`<|MASK|>` by default)
  must be in the target's tokenizer. No silent fallback to a family default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

__all__ = [
    "DEFAULT_NUM_TARGET_LAYERS",
    "MASK_TOKEN",
    "TargetModelError",
    "dflash_target_layer_ids",
    "resolve_mask_token_id",
    "mask_token_id_in_dir",
]

DEFAULT_NUM_TARGET_LAYERS = 5
MASK_TOKEN = "<|MASK|>"


class TargetModelError(ValueError):
    """A target model, tokenizer or template that the pipeline cannot use."""


def dflash_target_layer_ids(num_hidden_layers: int, n: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    """`n` target layer ids evenly spaced from 1 to L-3; raises TargetModelError when L is too shallow."""
    if n < 1:
        raise TargetModelError(f"need at least one target layer, got n={n}")
    if num_hidden_layers < 1:
        raise TargetModelError(f"num_hidden_layers must be positive, got {num_hidden_layers}")
    if n == 1:
        return [num_hidden_layers // 2]
    start, end = 1, num_hidden_layers - 3
    ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    if end < start or len(set(ids)) != n:
        raise TargetModelError(
            f"a {num_hidden_layers}-layer target has no {n} distinct layers in [1, {end}] "
            f"(rule gives {ids}); set target_layer_ids explicitly or lower num_target_layers"
        )
    return ids


def resolve_mask_token_id(explicit: int | None, lookup: Callable[[str], int | None], *,
                          mask_token: str = MASK_TOKEN, where: str = "the tokenizer") -> int:
    """The mask id: `explicit` when set, else `lookup(mask_token)`; a clear error when neither gives one."""
    if explicit is not None:
        return int(explicit)
    index = lookup(mask_token)
    if index is None:
        raise TargetModelError(
            f"mask token {mask_token!r} is not in tokenizer {where}; "
            "set mask_token_id, or add_mask_token=True to append it"
        )
    return int(index)


def mask_token_id_in_dir(target_dir: str | Path, explicit: int | None = None, mask_token: str = MASK_TOKEN) -> int:
    """The mask id of a target directory, read from its `tokenizer.json` added tokens (no tokenizer load)."""
    path = Path(target_dir) / "tokenizer.json"

    def lookup(token: str) -> int | None:
        if not path.exists():
            return None
        for t in json.loads(path.read_text()).get("added_tokens", []):
            if t.get("content") == token:
                return int(t["id"])
        return None

    return resolve_mask_token_id(explicit, lookup, mask_token=mask_token, where=repr(str(path)))
