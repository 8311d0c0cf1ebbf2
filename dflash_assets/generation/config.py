"""What a regeneration samples with: ``GenerationConfig`` (hashed into every completion row), its Hugging Face
``generate`` form, and the comparable id of a model.

The engines (``engines``), the completions stage, the planning stage and the
Dagster run config all take it from here, so it does not live inside an HTTP
client. Reads and writes nothing.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflash_assets.cache_keys import content_key

__all__ = ["GenerationConfig", "candidate_settings", "hf_generation_settings", "normalize_model_id"]


class GenerationConfig(BaseModel):
    """Sampling settings of the regeneration; hashed into every completion row.

    Defaults follow Qwen3's advice for thinking mode (temperature 0.6, top_p
    0.95, top_k 20). ``top_k``/``min_p``/``repetition_penalty`` are not
    OpenAI fields: SGLang and vLLM accept them, ``transformers serve`` rejects
    them, so the OpenAI client leaves them out for that server (see
    ``EndpointConfig.extra_sampling_params``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(2048, ge=1, description="Cap on generated tokens per assistant turn.")
    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int | None = Field(20, description="None or -1: not sent / disabled.")
    min_p: float | None = None
    repetition_penalty: float | None = None
    enable_thinking: bool = Field(True, description="Thinking mode of the target's chat template.")
    max_turns: int = Field(8, ge=1, description="Regenerate at most this many assistant turns per conversation.")
    stop_token_ids: tuple[int, ...] = Field((), description="Extra stop ids (the template's end-of-turn ids are added).")
    seed: int | None = Field(None, description="Per-request seed where the engine supports one.")
    skip_special_tokens: bool = Field(False, description="SGLang native: passed through; ids are decoded here anyway.")
    stop_after_truncated_turn: bool = Field(
        True, description="End a conversation at a turn cut by max_new_tokens (later user turns are dropped)."
    )
    max_context_tokens: int | None = Field(
        None, ge=1, description="Generate no token past this position of a conversation, e.g. the drafter's "
        "max_length (training cuts every sample there): a turn is cut to fit, a later turn that does not fit ends "
        "its conversation, a first turn that does not fit is listed as failed with its reason but does not count "
        "against max_failed_ratio. None: the engines' own context only. Hashed only when set.")

    def config_hash(self, target_model: str | None = None, seed_honoured: bool | None = None,
                    target_fingerprint: str | None = None) -> str:
        """16 hex chars over every field, the (normalized) target model id, the target's fingerprint when one is
        known and, when a seed is set, whether the engines honour it (``seed_honoured``: SGLang only with
        ``--enable-deterministic-inference``).

        ``target_fingerprint``: ``TargetModelSpec.generation_fingerprint()`` of a local target directory (its
        config, tokenizer and template files and a sample of its weights), so a fine-tune written in place, or
        ``/models/v2/X`` after ``/models/v1/X``, never shares a hash with the old target's rows. Without one (a
        remote engine serving a hub id, no local directory known) the target is named by its normalized id
        alone, and no fingerprint enters the hash. Without a seed likewise; with one, rows generated where the
        seed had no effect never share a hash with rows where it did.
        """
        # hashed only when set, so rows generated without the field keep the hash they were written with
        unset = {"max_context_tokens"} if self.max_context_tokens is None else set()
        payload: dict[str, Any] = {"generation": self.model_dump(mode="json", exclude=unset),
                                   "target": normalize_model_id(target_model or "")}
        if target_fingerprint:
            payload["target_fingerprint"] = target_fingerprint
        if self.seed is not None:
            payload["seed_honoured"] = bool(seed_honoured)
        return content_key(payload)


def candidate_settings(ran: list[GenerationConfig], thinking: bool) -> list[dict[str, Any]]:
    """The sampling settings that may have made a set of completions, as provenance records them: the defaults,
    then each config a run that last wrote one of the shards asked for (``ran``, duplicates left out), each in the
    target's thinking mode and the other (a run config may turn it either way). The drafter's provenance keeps those
    whose ``config_hash`` its samples carry."""
    out: list[dict[str, Any]] = []
    for config in [GenerationConfig(), *ran]:
        for mode in (thinking, not thinking):
            settings = config.model_copy(update={"enable_thinking": mode}).model_dump(mode="json")
            if settings not in out:
                out.append(settings)
    return out


def hf_generation_settings(gen: GenerationConfig) -> dict[str, Any]:
    """The sampling part of `gen` as Hugging Face `GenerationConfig` fields (what `model.generate` does).

    Temperature 0 is greedy decoding; otherwise sampling with temperature,
    top_p and top_k (0: off), plus min_p / repetition_penalty when set.
    """
    if gen.temperature == 0:
        return {"do_sample": False}
    settings: dict[str, Any] = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p,
                                "top_k": gen.top_k if gen.top_k is not None and gen.top_k > 0 else 0}
    if gen.min_p is not None:
        settings["min_p"] = gen.min_p
    if gen.repetition_penalty is not None:
        settings["repetition_penalty"] = gen.repetition_penalty
    return settings


def normalize_model_id(model: str) -> str:
    """Comparable id of a model: basename of a path or repo id, lower-case, no revision.

    ``/models/Qwen3.6-27B/``, ``Qwen/Qwen3.6-27B`` and ``qwen3.6-27b@main`` all
    give ``qwen3.6-27b``.
    """
    model = (model or "").strip().rstrip("/")
    if "@" in model and not os.path.exists(model):
        model = model.split("@", 1)[0]
    return model.rsplit("/", 1)[-1].lower()
