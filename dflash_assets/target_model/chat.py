"""The target's one chat object: its tokenizer, chat renderer, chat conventions, stop ids and thinking flag.

`TargetChat` is what a target hands to everything that renders or tokenizes its chats: the generation engines
(through `generation.chat_tokenizer.ChatTokenizer`), the fleet and the completions stage, the tokenization stage,
the hidden-state capture's tokenizer hash, and evaluation (held-out prompts, the stop ids of speculative decoding,
the demo's untrained tau). It is made by the target spec, `TargetModelSpec.chat()`, once per process for each
loaded tokenizer and template kwargs, so the spec's chat-template override, its `chat_template_kwargs` and its
mask token reach every consumer the same way; `TargetChat.from_tokenizer` wraps a tokenizer already in hand
(tests, the embedded target builders).

- `tokenizer`: the target's, loaded by the spec (`TargetModelSpec.load_tokenizer`: template override and mask
  token applied). Shared: treat it as read-only.
- `renderer`: the one `ChatRenderer` over the tokenizer's template with the spec's `chat_template_kwargs` as
  template variables; a call's keyword arguments (a generation config's `enable_thinking`) override them.
- `conventions`: `ChatConventions` read off that template (`conventions.derive_chat_conventions`); `thinking`
  is whether generation runs with reasoning (thinking requested and the template has a thinking mode).
- `stop_ids`: the one stop rule (`stop_token_ids`): `<|im_end|>`, `<|endoftext|>` and the tokenizer's eos, those
  the tokenizer has (an id equal to its unk id is not a token it has). The engines, the in-process generation,
  the evaluation and the demo stop on these (plus a generation config's own `stop_token_ids`).
- `render`, `prompt` (the generation prompt), `encode` (without special tokens; the fast tokenizer's Rust
  backend when there is one), `prompt_ids`, `tokenizer_hash`; `encode_texts` encodes many texts in one call.

Renderer, conventions and stop ids are computed on first use, so a tokenizer without a chat template still
gives its hash. Reads nothing itself (the spec loads the tokenizer files); writes nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_assets.target_model.chat_template import ChatRenderer
from dflash_assets.target_model.conventions import ChatConventions, derive_chat_conventions

__all__ = ["STOP_TOKENS", "TargetChat", "encode_text", "encode_texts", "stop_token_ids", "token_id_of"]

# Stop tokens looked up by name, beside the tokenizer's eos: the end of a ChatML turn and the end of text.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def token_id_of(tokenizer: Any, token: str) -> int | None:
    """Id of `token` in any HF-style tokenizer (`convert_tokens_to_ids`), None when it has no such token
    (an error, a non-int, or its unk id)."""
    try:
        idx = tokenizer.convert_tokens_to_ids(token)
    except Exception:  # noqa: BLE001 - any tokenizer-like object: no such token
        return None
    if not isinstance(idx, int) or idx == getattr(tokenizer, "unk_token_id", None):
        return None
    return idx


def stop_token_ids(tokenizer: Any) -> frozenset[int]:
    """The one stop rule: `<|im_end|>`, `<|endoftext|>` and the tokenizer's `eos_token_id`, those it has."""
    stops = {*(token_id_of(tokenizer, t) for t in STOP_TOKENS), getattr(tokenizer, "eos_token_id", None)}
    return frozenset(i for i in stops if isinstance(i, int))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids without special tokens added: the fast tokenizer's Rust backend when present (~1.5x faster
    than the Python front, the same ids), else `tokenizer.encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text's ids as `encode_text` gives them, in one call: the Rust backend's `encode_batch`, which runs
    without Python's GIL and on all cores (a single `encode` holds the GIL throughout), else text by text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [encode_text(tokenizer, text) for text in texts]


@dataclass(frozen=True, eq=False)
class TargetChat:
    """A target's tokenizer with its renderer (template kwargs applied), conventions, stop ids and thinking flag."""

    tokenizer: Any
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> "TargetChat":
        """The chat object of a tokenizer already loaded (its own template), with `template_kwargs`."""
        return cls(tokenizer, dict(template_kwargs or {}))

    @functools.cached_property
    def renderer(self) -> ChatRenderer:
        """The tokenizer's template, its special tokens and the template kwargs as variables (compiled once)."""
        return ChatRenderer.from_tokenizer(self.tokenizer, **self.template_kwargs)

    @functools.cached_property
    def conventions(self) -> ChatConventions:
        """Thinking (supported, used), assistant header and end of turn, read off the template."""
        return derive_chat_conventions(ChatRenderer.from_tokenizer(self.tokenizer), self.template_kwargs)

    @property
    def thinking(self) -> bool:
        """Whether generation runs with reasoning: thinking requested and the template has a thinking mode."""
        return self.conventions.thinking

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        return stop_token_ids(self.tokenizer)

    @property
    def template(self) -> str:
        return self.renderer.template

    @property
    def tokenizer_hash(self) -> str:
        from dflash_assets.target_model.tokenizer import tokenizer_hash

        return tokenizer_hash(self.tokenizer)

    def render(self, messages: Sequence[Any], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """`messages` rendered as the tokenizer's `apply_chat_template` renders them, with the template kwargs."""
        return self.renderer(messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)

    def prompt(self, messages: Sequence[Any], enable_thinking: bool | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The generation prompt of `messages`; `enable_thinking` None: the template kwargs' setting."""
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self.render(messages, add_generation_prompt=True, tools=tools, **extra)

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def prompt_ids(self, messages: Sequence[Any], enable_thinking: bool | None = None,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode(self.prompt(messages, enable_thinking, tools))

    def __repr__(self) -> str:
        name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        return f"TargetChat({name!r}, template_kwargs={json.dumps(dict(self.template_kwargs), default=str)})"
