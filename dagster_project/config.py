"""Run configuration of each stage: what a run may choose, within limits; defaults that are safe.

Each class converts to the library's own config object, so a notebook and the
Dagster UI accept the same settings; where the library has a default, the
field takes it from there (``_default``), never restating it. Nothing here names a command, a host, an
address or a path on a host: those are deployment settings (``profile.py``, ``deployment.py``).
The one path a run may give, the ingest's ``source_uri``, must be the
configured source or lie under ``DFLASH_PROMPT_SOURCE_ROOTS``.

Reads: the environment (the allowed prompt sources, through ``profile.py``), when a run's source is resolved.
Writes nothing.
"""

import dataclasses
import enum
import inspect
import os
import re
from typing import Any, Optional, get_args, get_type_hints

import dagster as dg
from pydantic import Field, field_serializer, field_validator

from dflash_assets.drafter.promotion import DEFAULT_MARGIN
from dflash_assets.drafter.stages import eval_recipe
from dflash_assets.generation.completions import aregenerate_shard
from dflash_assets.generation.config import GenerationConfig
from dflash_assets.planning.stage import plan_corpus
from dflash_assets.prompts.config import IngestConfig as LibIngestConfig
from dflash_assets.generation.self_prompts import SelfPromptSampling
from dflash_assets.prompts.prompt_mix import check_weights
from dflash_assets.prompts.text_filters import TextFilterConfig
from dflash_assets.self_generated import SOURCE as SELF_SOURCE
from dflash_assets.self_generated import SelfPromptsConfig, SelfPromptsThresholds
from dflash_assets.tokenization.quality import QualityThresholds
from dflash_assets.tokenization.samples import SUPERVISE_MODES, TokenizeConfig


def _default(library: Any, field: str) -> Any:
    """The library's default of ``field`` in ``library`` (a dataclass, a pydantic model, or a stage function's
    keyword): run config restates none."""
    if dataclasses.is_dataclass(library):
        return next(f.default for f in dataclasses.fields(library) if f.name == field)
    if inspect.isfunction(library):
        return inspect.signature(library).parameters[field].default
    return library.model_fields[field].default


def _choices(name: str, values) -> type[enum.Enum]:
    """A run-config enum of the library's valid values: the launchpad offers them, and a run with another value
    fails at launch naming the field. Its members are the strings themselves (``str`` mixed in)."""
    return enum.Enum(name, {v: v for v in values}, type=str, module=__name__)


LeadingAssistant = _choices("LeadingAssistant", get_args(get_type_hints(LibIngestConfig)["leading_assistant"]))
Supervise = _choices("Supervise", SUPERVISE_MODES)
EvalDtype = _choices("EvalDtype", ("float32", "bfloat16", "float16"))


class SourceNotAllowed(ValueError):
    """A run asked to ingest a source the deployment does not allow."""


def _within(uri: str, root: str) -> bool:
    if uri.startswith("s3://") or root.startswith("s3://"):
        return uri == root or uri.startswith(root.rstrip("/") + "/")
    uri_path, root_path = os.path.realpath(uri), os.path.realpath(root)
    return uri_path == root_path or uri_path.startswith(root_path.rstrip(os.sep) + os.sep)


class IngestConfig(dg.Config):
    source_uri: Optional[str] = Field(
        default=None,
        description="Prompt source: a local path or s3:// URI (ShareGPT JSON, JSONL, Parquet; .gz/.zst ok). "
        "Default: $DFLASH_PROMPT_SOURCE, else the embedded ShareGPT file.",
    )
    max_prompts_per_shard: int = Field(default=_default(LibIngestConfig, "max_prompts_per_shard"), ge=1, description="At most this many prompts per prompt_shards partition.")
    max_record_chars: int = Field(default=_default(LibIngestConfig, "max_record_chars"), ge=1, description="Records longer than this are quarantined as oversize.")
    leading_assistant: LeadingAssistant = Field(
        default=LeadingAssistant(_default(LibIngestConfig, "leading_assistant")),
        description="Conversations that start with an assistant turn: 'drop' the leading assistant turns "
        "(counted) or 'quarantine' the record.",
    )
    limit: Optional[int] = Field(
        default=_default(LibIngestConfig, "limit"), ge=1, description="Keep only the first N valid prompts (for demos). Counts still cover the whole source."
    )

    def resolved_source(self) -> str:
        """The source to read; a run's ``source_uri`` must be allowed by the deployment."""
        from dagster_project.profile import allowed_prompt_sources

        allowed = allowed_prompt_sources()
        if self.source_uri is None:
            return allowed[0]
        if not any(_within(self.source_uri, root) for root in allowed):
            raise SourceNotAllowed(
                f"source_uri {self.source_uri!r} is not a source this deployment allows: {allowed}. "
                "Set DFLASH_PROMPT_SOURCE, or add its directory or s3:// prefix to DFLASH_PROMPT_SOURCE_ROOTS "
                "where the code location runs."
            )
        return self.source_uri

    def to_library(self):
        return LibIngestConfig(
            max_prompts_per_shard=self.max_prompts_per_shard, max_record_chars=self.max_record_chars,
            leading_assistant=self.leading_assistant.value,
            limit=self.limit,
        )


class TokenizeStageConfig(dg.Config):
    max_length: int = Field(default=_default(TokenizeConfig, "max_length"), description="Samples are cut (and flagged) at this many tokens.")
    supervise: Supervise = Field(
        default=Supervise(_default(TokenizeConfig, "supervise")),
        description="last_turn: one sample per conversation, supervising its final assistant turn; "
        "every_turn: one sample per assistant turn (about 2.6x the tokens on ShareGPT).",
    )
    min_loss_tokens: int = Field(default=_default(QualityThresholds, "min_loss_tokens"), description="A supervised span shorter than this counts as empty.")
    max_empty_ratio: float = Field(default=_default(QualityThresholds, "max_empty_ratio"), description="empty_response_ratio fails when the data show the "
                                   "share is above this (95% Wilson lower bound, dflash_assets.quality_gates).")
    thinking_floor: float = Field(default=_default(QualityThresholds, "thinking_floor"), description="thinking_ratio fails when the data show the share is "
                                  "below this (95% Wilson upper bound; thinking on).")
    truncation_ceiling: float = Field(default=_default(QualityThresholds, "truncation_ceiling"), description="truncation_ratio warns when the data show the "
                                      "share is above this (95% Wilson lower bound).")

    def to_library(self):
        return TokenizeConfig(max_length=self.max_length, supervise=self.supervise.value)

    def thresholds(self, thinking_requested: bool):
        return QualityThresholds(
            min_loss_tokens=self.min_loss_tokens, max_empty_ratio=self.max_empty_ratio,
            thinking_requested=thinking_requested, thinking_floor=self.thinking_floor,
            truncation_ceiling=self.truncation_ceiling, max_length=self.max_length,
        )


class GenerationStageConfig(dg.Config):
    """Sampling of the regenerated completions; hashed into every row (a changed config is visible)."""

    max_new_tokens: int = Field(default=_default(GenerationConfig, "max_new_tokens"), ge=1, le=131_072, description="Cap on generated tokens per assistant turn.")
    temperature: float = Field(default=_default(GenerationConfig, "temperature"), ge=0.0, le=2.0, description="Qwen3 thinking-mode advice: 0.6.")
    top_p: float = Field(default=_default(GenerationConfig, "top_p"), gt=0.0, le=1.0, description="Nucleus sampling.")
    top_k: Optional[int] = Field(default=_default(GenerationConfig, "top_k"), ge=1, le=1000,
                                 description="None: not sent (transformers serve rejects it anyway).")
    max_turns: int = Field(default=_default(GenerationConfig, "max_turns"), ge=1, le=64, description="Regenerate at most this many assistant turns per conversation.")
    seed: Optional[int] = Field(default=_default(GenerationConfig, "seed"), ge=0, description="Per-request seed where the engine supports one.")
    max_context_tokens: Optional[int] = Field(
        default=_default(GenerationConfig, "max_context_tokens"), ge=1, le=1_048_576,
        description="Generate nothing past this position of a conversation: set it to the drafter's max_length, "
        "since training cuts every sample there. A turn is cut to fit, a later turn that does not fit ends its "
        "conversation, a first turn that does not fit is listed as failed (not counted by max_failed_ratio).")
    max_failed_ratio: float = Field(default=_default(aregenerate_shard, "max_failed_ratio"), ge=0.0, le=1.0,
                                    description="The partition fails (nothing published) when more of its prompts "
                                    "fail than this share; the next run retries only the failed ones.")

    def to_library(self, enable_thinking: bool):
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_turns=self.max_turns, seed=self.seed, enable_thinking=enable_thinking,
            max_context_tokens=self.max_context_tokens,
        )


_DEVICE = re.compile(r"^(cpu|cuda(:\d{1,2})?|mps)$")


def _check_device(value: Optional[str]) -> Optional[str]:
    if value is not None and not _DEVICE.match(value):
        raise ValueError(f"device {value!r}: expected cpu, cuda or cuda:N")
    return value


class HiddenStateCacheConfig(dg.Config):
    """A run chooses devices and batching; the scratch disk is the deployment's (``DFLASH_GPU_SCRATCH_DIR``).

    The defaults restate ``hidden_states.stage.cache_partition_for_shard``'s: that module (through ``capture``)
    costs the code location about 2 s of imports it otherwise never loads (the stage runs on the GPU host)."""

    devices: list[str] = Field(
        default_factory=lambda: ["cpu"],
        description="Devices on the GPU host, one worker each (e.g. ['cuda:0', 'cuda:1']); cpu for the tiny target.",
    )
    tokens_per_batch: int = Field(default=16384, ge=1, description="Samples are packed into batches of this many tokens.")
    budget_gb: Optional[float] = Field(
        default=None, gt=0, description="Refuse to compute when the cache would grow past this many GB (None: no limit)."
    )
    max_part_gb: float = Field(default=16.0, gt=0, description="Split a partition's safetensors file above this size.")

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: list[str]) -> list[str]:
        return [_check_device(v) for v in value]

    def to_stage_payload(self, scratch_dir: Optional[str] = None) -> dict:
        return {
            "devices": self.devices, "tokens_per_batch": self.tokens_per_batch,
            "budget_bytes": int(self.budget_gb * 1e9) if self.budget_gb is not None else None,
            "max_part_bytes": int(self.max_part_gb * 2**30), "scratch_dir": scratch_dir,
        }


class DrafterTrainingConfig(dg.Config):
    """A run chooses the device; the training-state directory is the deployment's (``DFLASH_DRAFTER_WORK_DIR``)."""

    device: Optional[str] = Field(default=None, description="Training device on the GPU host (None: cuda if present).")
    preflight: bool = Field(default=True, description="Before the long run, the recipe's drafter must memorize a "
                            "handful of its samples and decode them at tau near the block size (check 'preflight'; "
                            "minutes at most): a misaligned layout, labels or target layers fail here, not after "
                            "hours.")

    @field_validator("device")
    @classmethod
    def _device(cls, value: Optional[str]) -> Optional[str]:
        return _check_device(value)

    def to_stage_payload(self, work_dir: Optional[str] = None) -> dict:
        return {"device": self.device, "work_dir": work_dir, "preflight": self.preflight}


class DrafterEvalConfig(dg.Config):
    num_prompts: int = Field(default=_default(eval_recipe, "num_prompts"), ge=1, description="Held-out prompts decoded speculatively.")
    max_new_tokens: int = Field(default=_default(eval_recipe, "max_new_tokens"), ge=1, le=32_768, description="Tokens generated per prompt.")
    device: Optional[str] = Field(default=None, description="Device on the GPU host (None: cuda if present).")
    dtype: Optional[EvalDtype] = Field(default=None, description="Target precision (None: float32 on CPU, bfloat16 on "
                                 "GPU; float32 makes the lossless check exact).")
    @field_serializer("dtype")
    def _dtype_name(self, value: Optional[EvalDtype]) -> Optional[str]:
        """The payload the GPU host reads holds the plain name ("float32"), not the enum member."""
        return value.value if value is not None else None

    speed_prompts: int = Field(default=_default(eval_recipe, "speed_prompts"), ge=0, description="Also time batch-1 decoding, target alone vs "
                               "speculative, on this many of the prompts (metadata decode_speed).")
    serving_speed_prompts: int = Field(default=_default(eval_recipe, "serving_speed_prompts"), ge=0,
                                       description="Also time batch-1 decoding as a server runs it (bfloat16, static "
                                       "caches, a CUDA graph per step on both sides) on this many of the prompts "
                                       "(metadata serving_speed).")
    curve_prompts: int = Field(default=_default(eval_recipe, "curve_prompts"), ge=0, description="Also measure tau of the run's learning-curve "
                               "checkpoints on this many prompts (metadata learning_curve).")
    workers: int = Field(default=_default(eval_recipe, "workers"), ge=1, le=64, json_schema_extra={"output": False},
                         description="Processes on the GPU host that decode the prompts, each with its own copy of the "
                         "target (batch-1 decoding leaves the GPU mostly idle): same tau, less wall time. The speed "
                         "measurement runs alone.")
    promotion_margin: float = Field(default=DEFAULT_MARGIN, ge=0, description="Promotion (check 'promotion'): the run's best "
                                    "checkpoint becomes the family's promoted drafter only if its tau beats the "
                                    "promoted one's and no slice (thinking, tools, prompt length, category) falls "
                                    "below the promoted one's by more than this.")

    @field_validator("device")
    @classmethod
    def _device(cls, value: Optional[str]) -> Optional[str]:
        return _check_device(value)


class GenerationPlanConfig(dg.Config):
    probe_max_new_tokens: int = Field(default=_default(plan_corpus, "probe_max_new_tokens"), description="Tokens per probe request.")
    probe_requests: Optional[int] = Field(default=_default(plan_corpus, "probe_requests"), description="Probe requests per endpoint (None: pilot_prompts when set, else 2x concurrency).")
    expected_output_tokens: Optional[float] = Field(
        default=_default(plan_corpus, "expected_output_tokens"),
        description="Mean output tokens per assistant turn. None: measured from the completions materialized so "
        "far, else max_new_tokens of the generation config (a thinking model often hits it).",
    )
    turns_per_prompt: Optional[float] = Field(
        default=_default(plan_corpus, "turns_per_prompt"),
        description="Assistant turns per prompt, the last fallback: used only when nothing measured them (the "
        "completions' num_turns, else the pilot's, else raw_prompts' user turns capped at max_turns). None: 1.0.",
    )
    completions: GenerationStageConfig = Field(
        default_factory=GenerationStageConfig,
        description="The completions' run config the backfill will use (max_new_tokens, max_turns, sampling): the "
        "burst and the pilot generate with it.",
    )
    pilot_prompts: int = Field(
        default=_default(plan_corpus, "pilot_prompts"), ge=0,
        description="Before any completions exist: regenerate this many real prompts (the first of raw_prompts) "
        "through the whole completions path into a scratch store and scale its wall time and lengths to the "
        "corpus (the honest measure; twice the fleet's concurrency keeps every slot busy). On one in-process "
        "Transformers engine its lengths are kept and its wall time is not scaled: the engine's generate calls "
        "are replayed over the corpus's prompts and priced by calls timed on this host. 0: no pilot, the "
        "generation time comes from the throughput burst.",
    )
    cache_budget_gb: Optional[float] = Field(
        default=_default(plan_corpus, "cache_budget_gb"), gt=0,
        description="Hidden-state cache budget in GB (1e9 B). When the corpus's cache exceeds it, the plan says so "
        "and recommends online training. None: no budget.",
    )
    tokens_per_sample: Optional[float] = Field(
        default=_default(plan_corpus, "tokens_per_sample"), gt=0,
        description="Mean tokens of a tokenized sample. None: measured (last turn's prompt + completion tokens of "
        "the completions, else of the pilot); without either, turns x output tokens per turn.",
    )


class SelfGeneratedPromptsConfig(dg.Config):
    """Prompts the target writes itself (its template cut after the user header), and the partition's check."""

    samples: int = Field(default=_default(SelfPromptsConfig, "samples"), ge=1, le=1_000_000, description="Conversations sampled per partition; those passing every filter are kept.")
    batch_size: int = Field(default=_default(SelfPromptsConfig, "batch_size"), ge=1, le=65_536, description="Rows per generate call; a batch is what the journal keeps, so a killed run resumes after the last one written.")
    seed: int = Field(default=_default(SelfPromptsConfig, "seed"), ge=0, description="Sampling seed (with the batch's first index and the turn).")
    max_new_tokens: int = Field(default=_default(SelfPromptSampling, "max_new_tokens"), ge=1, le=8192, description="Cap on a user turn's tokens: one that does not end its turn by then is filtered (no_end_of_turn).")
    temperature: float = Field(default=_default(SelfPromptSampling, "temperature"), gt=0.0, le=2.0, description="User-turn sampling temperature.")
    top_p: float = Field(default=_default(SelfPromptSampling, "top_p"), gt=0.0, le=1.0, description="User-turn nucleus sampling.")
    turns: int = Field(default=_default(SelfPromptSampling, "turns"), ge=1, le=16, description="User turns per conversation: the target answers each, then writes the next one the same way.")
    system_prompt: Optional[str] = Field(default=_default(SelfPromptSampling, "system_prompt"), description="A system turn before the user header. None: what the template renders there by itself (SmolLM2: its default system prompt; without one SmolLM2 ends only 22% of its turns).")
    answer_max_new_tokens: int = Field(default=_default(SelfPromptSampling, "answer_max_new_tokens"), ge=1, le=32_768, description="Cap on the target's answers between user turns (an answer cut there ends the conversation).")
    language: Optional[str] = Field(default=_default(TextFilterConfig, "language"), description="The language the prompts must read as (script, and common words for 'en'). None: any.")
    min_words: int = Field(default=_default(TextFilterConfig, "min_words"), ge=0, description="Shorter user turns are filtered (too_short).")
    max_chars: int = Field(default=_default(TextFilterConfig, "max_chars"), ge=1, description="Longer user turns are filtered (too_long).")
    near_duplicate_threshold: float = Field(default=_default(SelfPromptsConfig, "near_duplicate_threshold"), gt=0.0, le=1.0, description="MinHash Jaccard (word 5-grams) at or above which a prompt is a near duplicate.")
    against_corpus: bool = Field(default=_default(SelfPromptsConfig, "against_corpus"), description="Deduplicate against every user turn of the prompt corpus too.")
    device: str = Field(default=_default(SelfPromptsConfig, "device"), description="'auto' (cuda when available), cpu, cuda or cuda:N.")
    min_distinct_ratio: float = Field(default=_default(SelfPromptsThresholds, "min_distinct_ratio"), ge=0.0, le=1.0, description="The check fails under this share of distinct first turns (of those that ended).")
    min_kept_ratio: float = Field(default=_default(SelfPromptsThresholds, "min_kept_ratio"), ge=0.0, le=1.0, description="The check fails when fewer samples than this share pass every filter.")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return value if value == "auto" else _check_device(value)

    def to_library(self) -> SelfPromptsConfig:
        sampling = SelfPromptSampling(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                      top_p=self.top_p, turns=self.turns, system_prompt=self.system_prompt,
                                      answer_max_new_tokens=self.answer_max_new_tokens)
        filters = TextFilterConfig(language=self.language, min_words=self.min_words, max_chars=self.max_chars)
        return SelfPromptsConfig(samples=self.samples, batch_size=self.batch_size, seed=self.seed, sampling=sampling,
                                 filters=filters, near_duplicate_threshold=self.near_duplicate_threshold,
                                 against_corpus=self.against_corpus, device=self.device)

    def thresholds(self) -> SelfPromptsThresholds:
        return SelfPromptsThresholds(min_distinct_ratio=self.min_distinct_ratio, min_kept_ratio=self.min_kept_ratio)


class PromptMixConfig(dg.Config):
    """Which sources a raw_prompts partition holds, by weight against its corpus shard (1.0)."""

    weights: dict[str, float] = Field(
        default_factory=dict,
        description="Other sources by weight against the corpus shard (1.0): {'self_generated': 0.25} adds a "
        "quarter as many of the partition's self-generated prompts (its first kept ones) as the "
        "shard holds. Empty: the corpus shard alone.")

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        check_weights(value, [SELF_SOURCE])  # known sources, none negative, the corpus 1.0: a bad mix fails naming it
        return value

    def checked(self) -> dict[str, float]:
        return check_weights(self.weights, [SELF_SOURCE])
