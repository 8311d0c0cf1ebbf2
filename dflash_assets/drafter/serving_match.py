"""Train/serve match: does a published drafter checkpoint load and behave in SGLang's DFlash loader as trained?

The rules are read from the ``sglang`` 0.5.23 wheel's source (``pip download --no-deps sglang==0.5.23``);
each rule cites its file and lines:

- ``srt/models/dflash.py`` (the ``DFlashDraftModel`` loader, ``EntryClass`` at 1317),
- ``srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config`` 588-800, ``build_target_layer_ids``
  348-385, ``DEFAULT_DFLASH_MASK_TOKEN`` 26),
- ``srt/speculative/dflash_worker_v2.py`` (block size 507-520, ``_resolve_mask_token_id`` 1391-1440).

Beyond loading, the chat template hash and thinking mode the training samples were made with (the
checkpoint's ``provenance.json``) must equal those of the target being served. SGLang 0.5.23 reports neither
(``/model_info`` and ``/server_info`` carry no template), so the served side is the deployment's target
settings (:func:`served_target_from_spec`); a caller that can ask its engine passes a :class:`ServedTarget`
built from the engine's answer instead.

Reads a checkpoint's ``config.json``, ``provenance.json`` and the safetensors header of
``model.safetensors`` (8-byte length + JSON; no tensor data, no torch), from a directory or a store.
Writes nothing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ServedTarget", "TensorInfo", "MatchReport", "safetensors_header", "check_serving_match",
           "served_target_from_spec", "checkpoint_serving_match"]

# dflash_utils.py:26 DEFAULT_DFLASH_MASK_TOKEN = "<|MASK|>" (used when the config names no mask_token, 677-681)
DEFAULT_MASK_TOKEN = "<|MASK|>"
# dflash.py:1317-1324 EntryClass; dflash_utils.py:469 recognises DFlashDraftModel by its architectures entry
DRAFT_ARCHITECTURE = "DFlashDraftModel"
# dflash.py:674-678 "The checkpoint provides: layers.*, fc.weight, hidden_norm.weight, norm.weight"
REQUIRED_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
# dflash.py:99-129 the target head must be dense FP16/BF16/FP32; the draft runs in the same float dtypes
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ServedTarget:
    """What the serving side runs: the target's shape, its tokenizer's view of the mask token, the chat
    template hash and thinking mode, and (optional) ``--speculative-num-draft-tokens``."""

    model_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # the target's embedding rows (model_config.vocab_size in dflash_worker_v2.py:1399)
    layer_ids: tuple[int, ...]
    token_ids: Mapping[str, int | None]  # tokenizer vocab id of each token name the check asks about
    template_hash: str
    thinking: bool
    num_draft_tokens: int | None = None
    source: str = "deployment target settings"


@dataclass
class MatchReport:
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def safetensors_header(data: bytes | Path | str) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes from a safetensors file's header (bytes or a path)."""
    if isinstance(data, (str, Path)):
        with open(data, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{data}: not a safetensors file (shorter than 8 bytes)")
            raw = f.read(struct.unpack("<Q", head)[0])
    else:
        if len(data) < 8:
            raise ValueError("not a safetensors file (shorter than 8 bytes)")
        raw = data[8: 8 + struct.unpack("<Q", data[:8])[0]]
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not a safetensors header: {e}") from e
    return {name: TensorInfo(str(v["dtype"]), tuple(int(x) for x in v["shape"]))
            for name, v in header.items() if name != "__metadata__"}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_serving_match(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], served: ServedTarget,
                        provenance: Mapping[str, Any] | None = None,
                        trained_block_size: int | None = None) -> MatchReport:
    """Every rule, in order (one ``_check_*`` each, citing the SGLang source it follows); ``report.problems`` says
    what differs (empty: the checkpoint matches)."""
    r = MatchReport()
    dc = config.get("dflash_config") or {}
    if not isinstance(dc, Mapping):
        r.problems.append(f"dflash_config must be a mapping, got {type(dc).__name__}")
        dc = {}

    _check_architecture(r, config)
    n_layers = _check_num_hidden_layers(r, config)
    hidden = _check_hidden_size(r, config, served)
    _check_block_size(r, config, dc, served, trained_block_size)
    ids = _check_target_layers(r, config, dc, served)
    _check_mask_token(r, config, dc, served)
    _check_tensors(r, tensors, dc, n_layers, hidden, ids)
    _check_dtype(r, config, tensors)
    _check_training_data(r, provenance, served)
    return r


def _check_architecture(r: MatchReport, config: Mapping[str, Any]) -> None:
    # architecture: dflash.py:1317 EntryClass, dflash_utils.py:469
    r.checked.append("architectures")
    if DRAFT_ARCHITECTURE not in (config.get("architectures") or []):
        r.problems.append(f"architectures is {config.get('architectures')!r}: SGLang loads a DFlash draft only as "
                          f"{DRAFT_ARCHITECTURE!r}")


def _check_num_hidden_layers(r: MatchReport, config: Mapping[str, Any]) -> int:
    # num_hidden_layers: dflash_utils.py:595-599 (int >= 1); layer_types one per layer: dflash.py:166-176
    r.checked.append("num_hidden_layers")
    n_layers = _int(config.get("num_hidden_layers"))
    if n_layers is None or n_layers < 1:
        r.problems.append(f"num_hidden_layers must be an integer >= 1, got {config.get('num_hidden_layers')!r}")
        n_layers = 0
    layer_types = config.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != n_layers):
        r.problems.append(f"layer_types must list one entry per draft layer ({n_layers}), got {layer_types!r}")
    return n_layers


def _check_hidden_size(r: MatchReport, config: Mapping[str, Any], served: ServedTarget) -> int | None:
    # hidden size: the draft embeds with the target's embedding (dflash.py:857-866) and projects
    #    K target hidden states of hidden_size each (dflash.py:830-841)
    r.checked.append("hidden_size")
    hidden = _int(config.get("hidden_size"))
    if hidden != served.hidden_size:
        r.problems.append(f"hidden_size {config.get('hidden_size')!r} differs from the served target's "
                          f"{served.hidden_size}")
    return hidden


def _check_block_size(r: MatchReport, config: Mapping[str, Any], dc: Mapping[str, Any], served: ServedTarget,
                      trained_block_size: int | None) -> None:
    # block size: dflash_utils.py:608-616 (dflash_config.block_size, else top-level; int >= 1; default 16 at
    #    dflash.py:703); the server's --speculative-num-draft-tokens wins with only a warning
    #    (dflash_worker_v2.py:507-520), so a different value there silently changes the block the drafter sees
    r.checked.append("block_size")
    raw_block = dc.get("block_size", config.get("block_size"))
    block = _int(raw_block)
    if raw_block is not None and (block is None or block < 1):
        r.problems.append(f"block_size must be an integer >= 1, got {raw_block!r}")
    resolved_block = block if block is not None else 16
    if raw_block is None:
        r.problems.append("block_size missing: SGLang would assume 16 (dflash.py:703)")
    if trained_block_size is not None and resolved_block != trained_block_size:
        r.problems.append(f"block_size {resolved_block} in config.json differs from the trained block size "
                          f"{trained_block_size}")
    if served.num_draft_tokens is not None and served.num_draft_tokens != resolved_block:
        r.problems.append(f"the server runs --speculative-num-draft-tokens {served.num_draft_tokens} but the "
                          f"drafter was trained with block size {resolved_block}")
    r.facts["block_size"] = resolved_block


def _check_target_layers(r: MatchReport, config: Mapping[str, Any], dc: Mapping[str, Any],
                         served: ServedTarget) -> list[int]:
    # target layers: dflash_utils.py:656-675 (non-empty list of ints), 556-585 (each < num_target_layers,
    #    from dflash_config or top level, 600-607). SGLang makes the target capture the layers the checkpoint
    #    names, so a list that differs from the deployment's layers means the drafter was trained for another
    #    target configuration than the one this deployment caches, evaluates and serves with
    r.checked.append("target_layer_ids")
    raw_ids = dc.get("target_layer_ids", config.get("target_layer_ids"))
    ids: list[int] = []
    if raw_ids is None:
        r.problems.append("target_layer_ids missing: SGLang would pick them by its own rule "
                          "(build_target_layer_ids, dflash_utils.py:348-385), not the layers trained on")
    elif not isinstance(raw_ids, list) or not raw_ids or any(_int(x) is None for x in raw_ids):
        r.problems.append(f"target_layer_ids must be a non-empty list of ints, got {raw_ids!r}")
    else:
        ids = [int(x) for x in raw_ids]
        if ids != list(served.layer_ids):
            r.problems.append(f"target_layer_ids {ids} differ from the served target's layers "
                              f"{list(served.layer_ids)} (SGLang would capture the checkpoint's; this deployment's "
                              f"cache and evaluation use its own)")
        out = [i for i in ids if not 0 <= i < served.num_layers]
        if out:
            r.problems.append(f"target_layer_ids {out} are out of range for the {served.num_layers}-layer target")
        ntl = _int(dc.get("num_target_layers", config.get("num_target_layers")))
        if ntl is not None and ntl != served.num_layers:
            r.problems.append(f"num_target_layers {ntl} differs from the served target's {served.num_layers} layers")
    r.facts["target_layer_ids"] = ids
    return ids


def _check_mask_token(r: MatchReport, config: Mapping[str, Any], dc: Mapping[str, Any], served: ServedTarget) -> None:
    # mask token: dflash_utils.py:677-701 (mask_token a non-empty string, default <|MASK|>; mask_token_id a
    #    non-negative int); dflash_worker_v2.py:1399-1421 (id < the target's vocab; equal to the tokenizer's id
    #    of mask_token when the tokenizer has that token)
    r.checked.append("mask_token_id")
    mask_token = dc.get("mask_token", config.get("mask_token")) or DEFAULT_MASK_TOKEN
    raw_mask = dc.get("mask_token_id", config.get("mask_token_id"))
    mask_id = _int(raw_mask)
    if raw_mask is None:
        r.problems.append("mask_token_id missing: SGLang would look up the tokenizer's "
                          f"{mask_token!r}, not the id the drafter was trained with")
    elif mask_id is None or mask_id < 0:
        r.problems.append(f"mask_token_id must be a non-negative integer, got {raw_mask!r}")
    else:
        if mask_id >= served.vocab_size:
            r.problems.append(f"mask_token_id {mask_id} is outside the served target's {served.vocab_size} "
                              f"embedding rows")
        vocab_id = served.token_ids.get(mask_token)
        if vocab_id is not None and vocab_id != mask_id:
            r.problems.append(f"mask_token_id {mask_id} conflicts with the served tokenizer's id {vocab_id} of "
                              f"{mask_token!r} (SGLang refuses to start)")
    r.facts["mask_token_id"] = mask_id


def _check_tensors(r: MatchReport, tensors: Mapping[str, TensorInfo], dc: Mapping[str, Any], n_layers: int,
                   hidden: int | None, ids: list[int]) -> None:
    # weights: dflash.py:674-678 names the tensors the checkpoint provides; load_weights (886-985) skips a
    #    name it does not know (945-946), so an embedding or lm_head in the checkpoint is silently dropped and
    #    the target's are used: a drafter that trained its own would be served with the wrong ones
    r.checked.append("tensors")
    for name in tensors:
        bare = name.removeprefix("model.")
        if bare.startswith(("embed_tokens", "lm_head")):
            r.problems.append(f"{name} is in the checkpoint: SGLang ignores it and uses the target's "
                              f"(dflash.py:943-946); the drafter must not carry its own embedding or head")
        if bare.startswith(("prefix_gru.", "embed_proj.")) and dc.get("projector_type") != "domino":
            r.problems.append(f"{name}: Domino projector weights without projector_type 'domino' (dflash.py:921-929)")
    bare_names = {n.removeprefix("model.") for n in tensors}
    missing = [n for n in REQUIRED_TENSORS if n not in bare_names]
    missing += [f"layers.{i}.{t}" for i in range(n_layers) for t in LAYER_TENSORS if f"layers.{i}.{t}" not in bare_names]
    if missing:
        shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
        r.problems.append(f"tensors missing from model.safetensors: {shown}")
    extra_layers = sorted({int(n.split(".")[1]) for n in bare_names
                           if n.startswith("layers.") and n.split(".")[1].isdigit()} - set(range(n_layers)))
    if extra_layers:
        r.problems.append(f"model.safetensors has layers {extra_layers} beyond num_hidden_layers {n_layers}")
    # dflash.py:948-974: fc.weight must be [hidden_size, K * hidden_size], K = len(target_layer_ids)
    fc = tensors.get("fc.weight") or tensors.get("model.fc.weight")
    if fc is not None and hidden and ids and tuple(fc.shape) != (hidden, len(ids) * hidden):
        r.problems.append(f"fc.weight has shape {list(fc.shape)}, SGLang expects [{hidden}, {len(ids) * hidden}] "
                          f"for {len(ids)} target layers of hidden size {hidden}")


def _check_dtype(r: MatchReport, config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> None:
    # dtype: one float dtype (FP16/BF16/FP32, dflash.py:125-129) in every tensor, the one config.json names
    r.checked.append("dtype")
    dtypes = sorted({t.dtype for t in tensors.values()})
    bad = [d for d in dtypes if d not in FLOAT_DTYPES]
    if bad:
        r.problems.append(f"tensor dtypes {bad} are not FP16/BF16/FP32")
    if len(dtypes) > 1:
        r.problems.append(f"tensors mix dtypes {dtypes}")
    declared = config.get("torch_dtype", config.get("dtype"))
    if declared is not None and len(dtypes) == 1 and FLOAT_DTYPES.get(dtypes[0]) != str(declared).removeprefix("torch."):
        r.problems.append(f"config.json says dtype {declared!r} but the tensors are {dtypes[0]}")
    r.facts["dtype"] = dtypes


def _check_training_data(r: MatchReport, provenance: Mapping[str, Any] | None, served: ServedTarget) -> None:
    # the data the drafter learnt from: chat template and thinking mode equal the served target's
    r.checked.append("chat_template_and_thinking")
    target = (provenance or {}).get("target") or {}
    if not target:
        r.problems.append("no provenance.json target identity: the chat template and thinking mode the samples "
                          "were made with are unknown")
    else:
        if target.get("chat_template_hash") != served.template_hash:
            r.problems.append(f"chat template hash {target.get('chat_template_hash')!r} of the training samples "
                              f"differs from the served target's {served.template_hash!r} ({served.source})")
        if target.get("thinking") != served.thinking:
            r.problems.append(f"thinking mode {target.get('thinking')!r} of the training samples differs from the "
                              f"served target's {served.thinking!r} ({served.source})")
    r.facts["served"] = {"model_path": served.model_path, "template_hash": served.template_hash,
                         "thinking": served.thinking, "source": served.source}


def served_target_from_spec(spec: Any, *, num_draft_tokens: int | None = None,
                            token_names: tuple[str, ...] = (DEFAULT_MASK_TOKEN,)) -> ServedTarget:
    """The deployment's target settings (a ``TargetModelSpec``) as the served side: loads config and tokenizer."""
    facts = spec.validate()
    vocab = spec.load_tokenizer().get_vocab()
    names = set(token_names) | ({facts.mask_token} if facts.mask_token else set())
    return ServedTarget(
        model_path=facts.model_path, num_layers=facts.num_layers, hidden_size=facts.hidden_size,
        vocab_size=facts.model_vocab_size, layer_ids=tuple(facts.layer_ids),
        token_ids={n: vocab.get(n) for n in names}, template_hash=facts.template_hash,
        thinking=bool(facts.chat.thinking) if facts.chat is not None else False,
        num_draft_tokens=num_draft_tokens)


def checkpoint_serving_match(store: Any, recipe_name: str, served: ServedTarget) -> MatchReport:
    """Read the recipe's published checkpoint (its manifest) from ``store`` and check it against ``served``."""
    from dflash_assets.store import layout

    files = layout.drafter_checkpoint_files(store, recipe_name, ("config.json", "model.safetensors", "provenance.json"))
    missing = [f for f in ("config.json", "model.safetensors") if f not in files]
    if missing:
        raise FileNotFoundError(f"recipe {recipe_name!r} has no published {' or '.join(missing)}: materialize "
                                f"drafter_checkpoint first")
    config = json.loads(store.read_bytes(files["config.json"]))
    tensors = safetensors_header(store.read_bytes(files["model.safetensors"]))
    provenance = json.loads(store.read_bytes(files["provenance.json"])) if "provenance.json" in files else None
    trained_block = ((provenance or {}).get("recipe") or {}).get("block_size")
    return check_serving_match(config, tensors, served, provenance, trained_block_size=trained_block)
