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
  must be in the target's tokenizer, or, for the default name only, the
  tokenizer must declare its own mask token (`tokenizer_config.json`
  `mask_token`): a vocabulary whose embedding has no free row (SmolLM2: 49,152
  tokens, 49,152 rows) reuses an unused token, as published Qwen3.5/3.6
  drafters reuse `<|audio_start|>`. No silent fallback to a family default.
- Chat conventions (`derive_chat_conventions`), read off the target's own
  template by rendering probe messages, never hard-coded per family: whether
  it has a thinking mode and uses it, the assistant header (what the
  generation prompt adds: the supervised span starts after it) and the end of
  an assistant turn (what follows its content: the span runs through it).
  Qwen3.5/3.6 with thinking: `<|im_start|>assistant\n<think>\n` ...
  `<|im_end|>\n`; SmolLM2 (ChatML, no thinking): `<|im_start|>assistant\n`
  ... `<|im_end|>\n`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = [
    "DEFAULT_NUM_TARGET_LAYERS",
    "MASK_TOKEN",
    "ChatConventions",
    "TargetModelError",
    "derive_chat_conventions",
    "dflash_target_layer_ids",
    "resolve_mask_token_id",
    "mask_token_id_in_dir",
    "text_config",
]

DEFAULT_NUM_TARGET_LAYERS = 5
MASK_TOKEN = "<|MASK|>"


def text_config(config: Any) -> Any:
    """The decoder text config of a target: ``config`` itself, or its nested ``text_config`` (Qwen3.5 VL-style).

    The one helper for it (the spec, the layer capture, the packing and the cost plan call it): a transformers
    config answers ``get_text_config(decoder=True)``; a dict of config fields gives its ``text_config`` entry.
    """
    get = getattr(config, "get_text_config", None)
    if get is not None:
        return get(decoder=True)
    if isinstance(config, Mapping):
        return config.get("text_config") or config
    return getattr(config, "text_config", None) or config


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
                          mask_token: str = MASK_TOKEN, where: str = "the tokenizer",
                          declared: str | None = None) -> int:
    """The mask id: `explicit` when set, else `lookup(mask_token)`, else (for the default `<|MASK|>` only)
    `lookup(declared)`, the tokenizer's own declared mask token; a clear error when none gives one."""
    if explicit is not None:
        return int(explicit)
    index = lookup(mask_token)
    if index is None and mask_token == MASK_TOKEN and declared:
        index = lookup(declared)
    if index is None:
        raise TargetModelError(
            f"mask token {mask_token!r} is not in tokenizer {where}"
            + (f" (nor its declared mask token {declared!r})" if declared else " and it declares no mask_token")
            + "; set mask_token_id, or add_mask_token=True to append it (the id must fit the embedding)"
        )
    return int(index)


def _declared_token(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _file_stamp(path: Path) -> tuple[int, int, int]:
    """(inode, mtime in ns, size) of a file, all -1 when it is missing: a changed or replaced file is read again."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return -1, -1, -1
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=16)
def _added_tokens(path: str, inode: int, mtime_ns: int, size: int) -> dict[str, int]:
    """A `tokenizer.json`'s added tokens, content -> id, parsed once per file version (a Qwen3.6 file is over
    10 MB of JSON: a second or so to parse, and every training run asks)."""
    if size < 0:
        return {}
    added: dict[str, int] = {}
    for t in json.loads(Path(path).read_text()).get("added_tokens", []):
        if t.get("content") is not None:
            added.setdefault(t["content"], int(t["id"]))  # the first entry of a content, as a lookup finds it
    return added


def mask_token_id_in_dir(target_dir: str | Path, explicit: int | None = None, mask_token: str = MASK_TOKEN) -> int:
    """The mask id of a target directory, read from its `tokenizer.json` added tokens and its
    `tokenizer_config.json` declared `mask_token` (no tokenizer load)."""
    path = Path(target_dir) / "tokenizer.json"
    config = Path(target_dir) / "tokenizer_config.json"
    declared = _declared_token(json.loads(config.read_text()).get("mask_token")) if config.exists() else None

    def lookup(token: str) -> int | None:
        return _added_tokens(str(path), *_file_stamp(path)).get(token)

    return resolve_mask_token_id(explicit, lookup, mask_token=mask_token, where=repr(str(path)), declared=declared)


# -- chat conventions, read off the target's template ------------------------------------------------------------

PROBE_USER = "DFLASH-PROBE-QUESTION"
PROBE_ANSWER = "DFLASH-PROBE-ANSWER"


@dataclass(frozen=True)
class ChatConventions:
    """What the target's chat template does, as the stages need it."""

    thinking_supported: bool  # the template renders differently with enable_thinking on and off
    thinking: bool  # ... and it is on for this target (generation with reasoning, thinking_ratio applies)
    assistant_header: str  # the generation prompt: the supervised span starts right after it
    end_of_turn: str  # what follows an assistant message's content: the span runs through it


def derive_chat_conventions(render: Callable[..., str], template_kwargs: Mapping[str, Any] | None = None
                            ) -> ChatConventions:
    """Render probe messages with `render(messages, add_generation_prompt, **kwargs)` and read the conventions off.

    Raises TargetModelError when the template adds no generation prompt, or renders an assistant turn that
    does not start with it (the supervised span could not be located)."""
    kwargs = dict(template_kwargs or {})
    user = [{"role": "user", "content": PROBE_USER}]
    base = render(user, False, **kwargs)
    prompt = render(user, True, **kwargs)
    if not prompt.startswith(base) or len(prompt) == len(base):
        raise TargetModelError("the chat template adds no generation prompt after the last user turn "
                               f"(rendered {prompt[-80:]!r}); it cannot locate the assistant's span")
    header = prompt[len(base):]
    on = render(user, True, **{**kwargs, "enable_thinking": True})
    off = render(user, True, **{**kwargs, "enable_thinking": False})
    supported = on != off
    text = render(user + [{"role": "assistant", "content": PROBE_ANSWER}], False, **kwargs)
    at = text.rfind(PROBE_ANSWER)
    end = text[at + len(PROBE_ANSWER):] if at >= 0 else ""
    if at < 0 or not end or text.rfind(header, 0, at) < 0:
        raise TargetModelError(f"the chat template renders an assistant turn as {text[-120:]!r}: no header "
                               f"{header!r} before its content, or nothing after it")
    return ChatConventions(thinking_supported=supported, thinking=supported and prompt == on,
                           assistant_header=header, end_of_turn=end)
