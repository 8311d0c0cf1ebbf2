"""What the pipeline needs to know about a target model, resolved and checked.

`TargetModelSpec` (pydantic v2) names a target: a local model directory (or a
hub id already present in the local Hugging Face cache: nothing is downloaded
unless `allow_download=True`), its tokenizer, an optional chat-template
override file, chat-template kwargs, dtype, the DFlash target layers and the
mask token. It reads the target's `config.json`, tokenizer files and template
file; it writes nothing.

- `dflash_target_layer_ids(L, n)`: the public DFlash / SpecForge rule,
  `round(1 + i * (L - 4) / (n - 1))` for i < n (evenly from layer 1 to L-3,
  Python rounding), `[L // 2]` for n = 1. Layer id i is the output of decoder
  layer i = HF `hidden_states[i + 1]`. An explicit `target_layer_ids` always
  wins.
- `TargetModelSpec.validate()` resolves everything into a frozen
  `TargetFacts` or raises `TargetModelError` (a ValueError) with the reason;
  the facts include the chat conventions read off the target's own template
  (`chat_conventions()`: thinking supported and used, assistant header, end
  of turn) and whether the embeddings are tied.
- `TargetModelSpec.chat()`: the target's one chat object
  (`target_model.chat.TargetChat`: the tokenizer loaded here, the renderer
  with the spec's template kwargs, the conventions, the stop ids, the
  thinking flag), cached per process; engines, tokenization and evaluation
  take it, so the template override reaches them all.
- `TargetModelSpec.config_fingerprint()`: short hash of what changes pipeline
  outputs, for Dagster code versions. The weights enter through a cheap
  content sample (`weights_sample`): per `*.safetensors` / `*.bin` / `*.gguf`
  file of the model directory, its size and a blake2b of its first, middle
  and last 1 MiB, cached per (path, size, mtime), so a fine-tune written over
  the old files at the same path changes it.
- `TargetModelSpec.generation_fingerprint()`: short hash of what changes the
  target's answers (config, generation and tokenizer files by content, the
  weights sample, the template and its kwargs; not the path, layers, mask or
  dtype), hashed into completions' `config_hash`; None for a hub id.

Mask token: by default `<|MASK|>` must be in the tokenizer (the tiny targets
have it at 248077), or the tokenizer must declare its own `mask_token`
(the converted SmolLM2 declares `<empty_output>`, id 16: its embedding has
no free row). For a production tokenizer with neither, either set
`mask_token_id` (e.g. 248070, what published Qwen3.5/3.6 drafters use) or
`add_mask_token=True`, which appends `<|MASK|>` as a special token at id
`len(tokenizer)` the way SpecForge does (151669 for Qwen3, 248077 for
Qwen3.5/3.6); the id must fit the model's embedding rows either way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_assets.cache_keys import content_key
from dflash_assets.target_model.chat import TargetChat
from dflash_assets.target_model.chat_template import ChatRenderer, load_chat_template, template_hash
from dflash_assets.target_model.conventions import (
    DEFAULT_NUM_TARGET_LAYERS,
    ChatConventions,
    TargetModelError,
    derive_chat_conventions,
    dflash_target_layer_ids,
    resolve_mask_token_id,
    text_config,
)
from dflash_assets.target_model.tokenizer import QWEN3_6_MASK_TOKEN

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

text_config_of = text_config  # the decoder text config (target.conventions.text_config), by its older name


def token_id(tok: "PreTrainedTokenizerBase", token: str) -> int | None:
    """Id of `token` in `tok`, or None; avoids building the 248K-entry vocab dict."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)
    return tok.get_vocab().get(token)


def _dir_stamp(path: str) -> tuple:
    """(name, size, mtime_ns) of the files of a local directory; () for hub ids."""
    base = Path(path)
    if not base.is_dir():
        return ()
    return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in base.iterdir() if f.is_file()))


def _load_tokenizer(path: str, stamp: tuple, template: str | None, add_mask: bool, mask_token: str,
                    allow_download: bool) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=not allow_download)
    except (OSError, ValueError) as e:
        raise TargetModelError(f"cannot load the tokenizer {path!r}: {e}") from e
    if template is not None:
        tok.chat_template = template
    if add_mask and token_id(tok, mask_token) is None:
        tok.add_special_tokens({"mask_token": mask_token})
    return tok


_load_tokenizer_cached = functools.lru_cache(maxsize=8)(_load_tokenizer)


_CHATS_LOCK = threading.Lock()
_CHATS: dict[tuple, TargetChat] = {}  # (tokenizer load key, template kwargs as JSON) -> chat object; the last 8


def _chat_cached(key: tuple, template_kwargs: dict[str, Any]) -> TargetChat:
    """One chat object per loaded tokenizer (the `load_tokenizer` key) and template kwargs, per process."""
    memo = (key, json.dumps(template_kwargs, sort_keys=True, default=repr))
    tokenizer = _load_tokenizer_cached(*key)
    with _CHATS_LOCK:
        chat = _CHATS.pop(memo, None)
        if chat is None or chat.tokenizer is not tokenizer:
            chat = TargetChat.from_tokenizer(tokenizer, template_kwargs)
        _CHATS[memo] = chat  # most recently used last
        while len(_CHATS) > 8:
            del _CHATS[next(iter(_CHATS))]
    return chat


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
WEIGHT_SAMPLE_BYTES = 1 << 20  # per sampled window: the first, middle and last MiB of each weight file


@functools.lru_cache(maxsize=256)
def _weight_file_digest(path: str, size: int, mtime_ns: int) -> str:
    """blake2b of the first, middle and last ``WEIGHT_SAMPLE_BYTES`` of a file (the whole file when smaller than
    three windows); cached per (path, size, mtime), so each file is read once per process and change."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= 3 * WEIGHT_SAMPLE_BYTES:
            h.update(f.read())
        else:
            for offset in (0, (size - WEIGHT_SAMPLE_BYTES) // 2, size - WEIGHT_SAMPLE_BYTES):
                f.seek(offset)
                h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()


def weights_sample(model_path: str) -> list[tuple[str, int, str]]:
    """(name, size, sampled blake2b) of each weight file in a local model directory (sub-directories included,
    names relative); [] for a hub id or a directory without weight files."""
    base = Path(model_path)
    if not base.is_dir():
        return []
    out = []
    for f in sorted(p for p in base.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        st = f.stat()
        out.append((f.relative_to(base).as_posix(), st.st_size, _weight_file_digest(str(f), st.st_size,
                                                                                     st.st_mtime_ns)))
    return out


# Small files of a model / tokenizer directory that change what the target generates: config.json,
# generation_config.json, tokenizer*.json, special_tokens_map.json, vocab/merges, chat_template.jinja, *.model.
TARGET_FILE_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt")


def target_files_sample(path: str) -> list[tuple[str, int, str]]:
    """(name, size, blake2b) of the top-level config / tokenizer / template files of a local directory (the
    ``TARGET_FILE_SUFFIXES``; weight indexes and READMEs aside), by content, cached like the weight sample;
    [] for a hub id."""
    base = Path(path)
    if not base.is_dir():
        return []
    out = []
    for f in sorted(p for p in base.iterdir() if p.is_file() and p.name.endswith(TARGET_FILE_SUFFIXES)
                    and not p.name.endswith(".index.json") and not p.name.lower().startswith("readme")):
        st = f.stat()
        out.append((f.name, st.st_size, _weight_file_digest(str(f), st.st_size, st.st_mtime_ns)))
    return out


@dataclass(frozen=True)
class TargetFacts:
    """Resolved facts about a validated target (what downstream stages record)."""

    model_path: str
    model_type: str
    num_layers: int
    hidden_size: int
    model_vocab_size: int  # embedding rows of the model
    tokenizer_vocab_size: int  # len(tokenizer), added tokens included
    layer_ids: tuple[int, ...]
    mask_token: str | None  # None when only an id was configured and it has no token here
    mask_token_id: int
    eos_token_id: int | None
    tokenizer_hash: str
    template_hash: str
    dtype: str
    tie_word_embeddings: bool = False  # lm_head is embed_tokens (SmolLM2); the drafter reuses it either way
    chat: ChatConventions | None = None  # thinking, assistant header, end of turn: read off the template


class TargetModelSpec(BaseModel):
    """A target LLM as the pipeline sees it. Nothing is loaded until a method asks."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model_path: str = Field(description="Local model directory, or a hub id present in the local HF cache.")
    tokenizer_path: str | None = Field(None, description="Tokenizer directory or id; defaults to model_path.")
    chat_template_path: str | None = Field(None, description="Jinja file replacing the tokenizer's chat template.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"enable_thinking": True},
        description="Extra variables for the chat template (e.g. enable_thinking).",
    )
    dtype: Literal["bfloat16", "float32", "auto"] = Field("bfloat16", description="Model weights dtype.")
    target_layer_ids: list[int] | None = Field(None, description="Explicit DFlash target layers; always wins.")
    num_target_layers: int = Field(DEFAULT_NUM_TARGET_LAYERS, ge=1, description="Layers picked by the DFlash rule.")
    mask_token: str = Field(QWEN3_6_MASK_TOKEN, description="Mask token string looked up in the tokenizer.")
    mask_token_id: int | None = Field(None, ge=0, description="Explicit mask id; wins over the token lookup.")
    add_mask_token: bool = Field(False, description="Append mask_token to the tokenizer when it is missing.")
    allow_download: bool = Field(False, description="Let transformers fetch files from the hub.")

    # -- loading ---------------------------------------------------------------------------

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path

    def load_config(self) -> "PretrainedConfig":
        """The model's (outer) config; see `text_config_of` for the decoder part."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.model_path, local_files_only=not self.allow_download)
        except (OSError, ValueError) as e:
            raise TargetModelError(f"cannot read the config of target {self.model_path!r}: {e}") from e

    def _tokenizer_key(self) -> tuple:
        """What a tokenizer load depends on: path, file stamps, template override, mask settings, downloads."""
        template = None
        if self.chat_template_path is not None:
            try:
                template = load_chat_template(self.chat_template_path)
            except (OSError, ValueError) as e:
                raise TargetModelError(f"cannot read chat template {self.chat_template_path!r}: {e}") from e
        return (self.resolved_tokenizer_path, _dir_stamp(self.resolved_tokenizer_path), template,
                self.add_mask_token, self.mask_token, self.allow_download)

    def load_tokenizer(self, fresh: bool = False) -> "PreTrainedTokenizerBase":
        """The tokenizer, with the chat-template override and (if asked) the mask token applied.

        Loads are cached per process (keyed by path, file mtimes, template and
        mask settings) and the cached instance is shared: treat it as
        read-only, or pass `fresh=True` for a private copy.
        """
        key = self._tokenizer_key()
        if fresh:
            return _load_tokenizer(*key)
        return _load_tokenizer_cached(*key)

    def chat(self) -> TargetChat:
        """The target's one chat object (`target_model.chat.TargetChat`): the tokenizer of `load_tokenizer`, the
        renderer with this spec's template kwargs, the chat conventions, the stop ids and the thinking flag.
        Cached per process with the tokenizer load (same key) and the template kwargs: shared, read-only."""
        return _chat_cached(self._tokenizer_key(), self.chat_template_kwargs)

    def torch_dtype(self, dtype: str | None = None) -> "torch.dtype | str":
        import torch

        name = dtype or self.dtype
        return "auto" if name == "auto" else {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]

    def load_model(self, device: "str | torch.device" = "cpu", dtype: str | None = None) -> "PreTrainedModel":
        """`AutoModelForCausalLM` in eval mode on `device`, in `dtype` (default: the spec's)."""
        from dflash_assets.target_model.loading import load_causal_lm

        model = load_causal_lm(
            self.model_path, dtype=self.torch_dtype(dtype), local_files_only=not self.allow_download
        )
        return model.to(device).eval()

    # -- resolution ------------------------------------------------------------------------

    def layer_ids(self, config: "PretrainedConfig | None" = None) -> list[int]:
        """The DFlash target layer ids: the explicit list, else the rule on the model depth.

        An explicit list is returned as given; `validate()` checks it against the depth.
        """
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        text = text_config_of(config if config is not None else self.load_config())
        return self.layer_ids_for_depth(text.num_hidden_layers)

    def mask_token_id_for(self, tok: "PreTrainedTokenizerBase") -> int:
        """The mask id: the explicit `mask_token_id`, else `mask_token` looked up in `tok`, else (default
        name only) the tokenizer's own declared mask token (see `conventions`)."""
        declared = getattr(tok, "mask_token", None)
        return resolve_mask_token_id(self.mask_token_id, lambda t: token_id(tok, t), mask_token=self.mask_token,
                                     where=repr(self.resolved_tokenizer_path),
                                     declared=declared if isinstance(declared, str) else None)

    def chat_conventions(self, tok: "PreTrainedTokenizerBase | None" = None) -> ChatConventions:
        """Thinking (supported, used), assistant header and end of turn, read off this target's template
        rendered with this spec's template kwargs (`conventions.derive_chat_conventions`); those of `chat()`
        unless another tokenizer is given."""
        if tok is None:
            return self.chat().conventions
        return derive_chat_conventions(ChatRenderer.from_tokenizer(tok), self.chat_template_kwargs)

    def thinking(self) -> bool:
        """Whether generation runs with reasoning: thinking requested and the template has a thinking mode
        (the chat object's flag, `chat().thinking`)."""
        return self.chat().thinking

    def mask_token_id_resolved(self) -> int:
        """The mask id, loading the tokenizer when no explicit id is set."""
        if self.mask_token_id is not None:
            return self.mask_token_id
        return self.mask_token_id_for(self.load_tokenizer())

    def render_chat(
        self, tok: "PreTrainedTokenizerBase | None", messages: list[dict], add_generation_prompt: bool = False
    ) -> str:
        """`messages` rendered with the tokenizer's template and this spec's template kwargs (the one renderer):
        `chat().render`, or with another tokenizer's template when one is given."""
        if tok is None or tok is self.chat().tokenizer:
            return self.chat().render(messages, add_generation_prompt)
        return ChatRenderer.from_tokenizer(tok, **self.chat_template_kwargs)(messages, add_generation_prompt)

    def validate(self) -> TargetFacts:
        """Load config and tokenizer (not weights), check they fit together, return the facts."""
        config = self.load_config()
        text = text_config_of(config)
        num_layers, hidden, model_vocab = (
            getattr(text, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        )
        if not all(isinstance(v, int) and v > 0 for v in (num_layers, hidden, model_vocab)):
            raise TargetModelError(
                f"config of {self.model_path!r} lacks num_hidden_layers/hidden_size/vocab_size "
                f"(got {num_layers}, {hidden}, {model_vocab})"
            )
        chat = self.chat()
        tok = chat.tokenizer
        template = tok.chat_template
        if not isinstance(template, str) or not template.strip():
            raise TargetModelError(
                f"tokenizer {self.resolved_tokenizer_path!r} has no chat template; set chat_template_path"
            )
        if len(tok) > model_vocab:
            raise TargetModelError(
                f"tokenizer has {len(tok)} tokens but the model's embedding has only {model_vocab} rows"
            )
        layer_ids = self._checked_layer_ids(num_layers)
        mask_id = self.mask_token_id_for(tok)
        if mask_id >= model_vocab:
            raise TargetModelError(f"mask token id {mask_id} is outside the model's {model_vocab} embedding rows")
        mask_token = tok.convert_ids_to_tokens(mask_id) if mask_id < len(tok) else None
        eos = tok.eos_token_id
        conventions = chat.conventions
        return TargetFacts(
            model_path=self.model_path,
            model_type=text.model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            model_vocab_size=model_vocab,
            tokenizer_vocab_size=len(tok),
            layer_ids=tuple(layer_ids),
            mask_token=mask_token,
            mask_token_id=mask_id,
            eos_token_id=eos if isinstance(eos, int) else None,
            tokenizer_hash=chat.tokenizer_hash,
            template_hash=template_hash(template),
            dtype=self.dtype,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),  # the outer config decides
            chat=conventions,
        )

    def _checked_layer_ids(self, num_layers: int) -> list[int]:
        ids = self.layer_ids_for_depth(num_layers)
        if not ids:
            raise TargetModelError("target_layer_ids is empty")
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise TargetModelError(
                f"target layer ids {bad} out of range for a {num_layers}-layer target [0, {num_layers - 1}]"
            )
        if len(set(ids)) != len(ids):
            raise TargetModelError(f"target layer ids {ids} contain duplicates")
        if ids != sorted(ids):
            raise TargetModelError(f"target layer ids {ids} must be in increasing order")
        return ids

    def layer_ids_for_depth(self, num_layers: int) -> list[int]:
        """The explicit list, else the DFlash rule for a `num_layers`-deep target (unchecked)."""
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        return dflash_target_layer_ids(num_layers, self.num_target_layers)

    # -- identity --------------------------------------------------------------------------

    def _template_text(self) -> str:
        """Template content without loading the tokenizer (override file, else local tokenizer files)."""
        if self.chat_template_path is not None:
            return load_chat_template(self.chat_template_path)
        base = Path(self.resolved_tokenizer_path)
        if (base / "chat_template.jinja").is_file():
            return (base / "chat_template.jinja").read_text("utf-8")
        cfg = base / "tokenizer_config.json"
        if cfg.is_file():
            template = json.loads(cfg.read_text("utf-8")).get("chat_template")
            return template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        return ""

    def config_fingerprint(self) -> str:
        """16-hex hash of what changes outputs: model (path, config.json and a content sample of the weight
        files, `weights_sample`), tokenizer path, template content, template kwargs, layer choice, dtype and mask
        settings."""
        config_file = Path(self.model_path) / "config.json"
        payload = {
            "model_path": self.model_path,
            "config_json": hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else None,
            "weights": weights_sample(self.model_path),
            "tokenizer_path": self.resolved_tokenizer_path,
            "template": template_hash(self._template_text()),
            "template_kwargs": self.chat_template_kwargs,
            "layers": self.target_layer_ids if self.target_layer_ids is not None else f"rule:{self.num_target_layers}",
            "dtype": self.dtype,
            "mask": [self.mask_token, self.mask_token_id, self.add_mask_token],
        }
        return content_key(payload, default=str)

    def generation_fingerprint(self) -> str | None:
        """16-hex hash of what changes the target's answers, for completions' ``config_hash``: the model's and
        the tokenizer's config / tokenizer / template files by content (`target_files_sample`), the weight files'
        content sample (`weights_sample`), the template override's content and the template kwargs.

        Not the path (a copy moved elsewhere keeps its rows), nor the DFlash layers, mask settings or dtype
        (they change capture and training, not the answers). None when ``model_path`` is not a local
        directory (a hub id): there is nothing to sample, and completions name the target by its id alone.
        """
        if not Path(self.model_path).is_dir():
            return None
        payload = {
            "model_files": target_files_sample(self.model_path),
            "weights": weights_sample(self.model_path),
            "tokenizer_files": (target_files_sample(self.resolved_tokenizer_path)
                                if self.tokenizer_path not in (None, self.model_path) else None),
            "template_override": (template_hash(load_chat_template(self.chat_template_path))
                                  if self.chat_template_path is not None else None),
            "template_kwargs": self.chat_template_kwargs,
        }
        return content_key(payload, default=str)
