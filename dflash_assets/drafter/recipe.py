"""A drafter training run's definition (:class:`DrafterRecipe`, one ``drafter_recipes`` partition) and its result.

Reads and writes nothing; the recipe's JSON form is what ``drafter_recipes/<name>.json`` holds. Every recipe,
stored or built in Python, passes `recipe_fields_model()` (pydantic: the choices of each field with few valid values,
positive sizes, no unknown field): a bad value fails where the recipe is read, naming the field, the value and
what is allowed, never deep in a training step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

import numpy as np

from dflash_assets.drafter.model import loss_gamma

__all__ = ["DrafterRecipe", "RecipeError", "TrainResult", "OBJECTIVES", "ATTENTION", "CHECKPOINT_DTYPES",
           "check_recipe_fields", "recipe_fields_model"]

OBJECTIVES = ("dflash", "dpace")
ATTENTION = ("auto", "flex", "sdpa")  # auto: flex on a GPU, sdpa on a CPU
CHECKPOINT_DTYPES = ("bfloat16", "float32", "float16")


@functools.cache
def recipe_fields_model() -> type:
    """The pydantic model :class:`DrafterRecipe`'s values pass (built on first use, so that pydantic stays off the
    GPU path's module-level imports)."""
    from pydantic import BaseModel, ConfigDict, Field

    _LayerId = Annotated[int, Field(ge=0)]

    class RecipeFields(BaseModel):
        """What each :class:`DrafterRecipe` field may hold: the checks a recipe passes wherever it comes from. Strict
        (a "16" is not a block size, a bool not a count); values are only checked, the recipe keeps them as given, so
        its fingerprint is what it was."""

        model_config = ConfigDict(extra="forbid", strict=True)

        name: str = Field(min_length=1)
        version: str
        block_size: int = Field(ge=2)  # the anchor and at least one masked position
        num_layers: int = Field(ge=1)
        epochs: int = Field(ge=1)
        lr: float = Field(gt=0)
        warmup_ratio: float = Field(ge=0, lt=1)
        max_length: int = Field(ge=1)
        max_anchors: int = Field(ge=1)
        gamma: Optional[float] = Field(gt=0)
        batch_size: int = Field(ge=1)
        seed: int = Field(ge=0)
        partitions: Union[tuple[str, ...], list[str]]  # JSON gives a list
        online: bool
        weight_decay: float = Field(ge=0)
        grad_clip: float = Field(gt=0)
        target_layer_ids: Optional[Union[tuple[_LayerId, ...], list[_LayerId]]]
        mask_token_id: Optional[int] = Field(ge=0)
        save_every: int = Field(ge=1)
        attention: Literal[ATTENTION]
        compile: bool
        checkpoint_dtype: Literal[CHECKPOINT_DTYPES]
        cache_limit_gb: Optional[float] = Field(gt=0)
        family: Optional[str] = Field(min_length=1)
        init_from: Optional[Literal["promoted"]]
        objective: Literal[OBJECTIVES]
        dpace_alpha: float = Field(ge=0, le=1)
        tau_every: Optional[int] = Field(ge=1)
        tau_prompts: int = Field(ge=0)
        tau_new_tokens: int = Field(ge=1)
        early_stop_patience: Optional[int] = Field(ge=1)

    return RecipeFields


class RecipeError(ValueError):
    """A recipe with a value its field does not allow, or an unknown field: every problem in one message."""


def _choices(field: str) -> tuple | None:
    """The allowed values of a Literal field of the recipe model (None inside Optional left out)."""
    annotation = recipe_fields_model().model_fields[field].annotation
    for arg in (annotation, *get_args(annotation)):
        if getattr(arg, "__origin__", None) is Literal:
            return get_args(arg)
    return None


def check_recipe_fields(values: dict[str, Any]) -> None:
    """RecipeError naming each bad field, its value and what is allowed (choices, bounds, the known fields)."""
    from pydantic import ValidationError

    model = recipe_fields_model()
    try:
        model.model_validate(values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"][:1]) if err["loc"] else "?"
            value = err.get("input")
            if err["type"] == "extra_forbidden":
                problems.append(f"{field}: unknown field (a recipe has {', '.join(model.model_fields)})")
            elif _choices(field) and err["type"] == "literal_error":
                allowed = ", ".join(str(c) for c in _choices(field))
                problems.append(f"{field} must be one of {allowed}, got {value!r}")
            else:
                problems.append(f"{field}: {err['msg'].lower()}, got {value!r}")
        name = values.get("name")
        raise RecipeError(f"recipe {name!r}: " + "; ".join(dict.fromkeys(problems))) from None


@dataclass(frozen=True)
class DrafterRecipe:
    """Everything that defines a drafter training run (a `drafter_recipes` partition)."""

    name: str
    version: str = "1"
    block_size: int = 16
    num_layers: int = 5
    epochs: int = 6
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    max_length: int = 3072
    max_anchors: int = 512
    gamma: float | None = None  # None: derived from block_size (7 for 16, 5 for 10, 4 for 8)
    batch_size: int = 1  # sequences per process per step
    seed: int = 0
    partitions: tuple[str, ...] = ()  # data selection: partition keys of the cache / samples
    online: bool = False  # compute target hidden states during training instead of the cache
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    target_layer_ids: tuple[int, ...] | None = None  # None: cache metadata, else the default rule
    mask_token_id: int | None = None  # None: the target tokenizer's <|MASK|> / known family id
    save_every: int = 500  # steps between resumable training states
    attention: str = "auto"  # auto (flex on GPU, sdpa on CPU) | flex | sdpa
    compile: bool = True  # GPU only: torch.compile the decoder layers and the loss chunks
    checkpoint_dtype: str = "bfloat16"  # dtype of the published drafter weights
    # Offline: at most this many GB of cache parts on the training host's disk (parts read from the store are
    # fetched ahead and evicted behind); online: decoded Parquet row groups held in memory. Samples are then
    # shuffled within windows of parts (row groups) of half this size, so reads stay local. None: offline reads
    # every part where the store keeps it (an S3 store downloads all of them, unbounded), online holds 1 GB.
    cache_limit_gb: float | None = None
    # Promotion (``drafter.promotion``): recipes of one family share ``drafter_promoted/<family>/``. None: the
    # name without its version suffix (``demo-v2`` -> ``demo``).
    family: str | None = None
    # "promoted": start from the family's promoted drafter's weights when its shapes match (a refresh after the
    # target changed); None: random init.
    init_from: str | None = None
    # The training objective (``loss``): "dpace", each position's cross-entropy weighted by its expected contribution
    # to the acceptance length (``loss.dpace_weights``, the drafter's probabilities of the labels smoothed as
    # (1 - dpace_alpha) * p + dpace_alpha); "dflash", the cross-entropy decayed by block position (gamma). dpace is
    # the default: at equal training tokens it reached the higher held-out tau (BENCHMARKS.md, "Training objectives").
    # A stored recipe that names no objective reads as dflash (``from_dict``), the objective it was trained with.
    objective: str = "dpace"
    dpace_alpha: float = 0.5
    # tau while training (``tau_estimate``): the expected acceptance length on held-out prompts, teacher-forced along
    # the target's greedy continuations, every tau_every steps (None: at every saved state) and at the end, on
    # tau_prompts prompts (0: off) of tau_new_tokens tokens each.
    tau_every: int | None = None
    tau_prompts: int = 8
    tau_new_tokens: int = 64
    # Stop when the estimate has not improved for this many evaluations in a row (None: never).
    early_stop_patience: int | None = None

    def __post_init__(self):
        check_recipe_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.objective not in OBJECTIVES:
            raise ValueError(f"recipe {self.name!r}: objective must be one of {', '.join(OBJECTIVES)}, "
                             f"got {self.objective!r}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"recipe {self.name!r}: dpace_alpha must lie in [0, 1], got {self.dpace_alpha}")
        if self.early_stop_patience is not None and (self.early_stop_patience < 1 or self.tau_prompts < 1):
            raise ValueError(f"recipe {self.name!r}: early_stop_patience needs a patience >= 1 and tau_prompts >= 1")

    @property
    def family_name(self) -> str:
        return self.family or re.sub(r"-v\d+$", "", self.name)

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else loss_gamma(self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterRecipe":
        """The recipe of a stored JSON object: every field checked (`recipe_fields_model`), all problems in one
        RecipeError, before anything is built. A recipe stored without an objective was trained with dflash, and
        reads so (its fingerprint and work dir are found again)."""
        d = {"objective": "dflash", **d}
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        check_recipe_fields({**defaults, **d})
        for k in ("partitions", "target_layer_ids"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)

    def fingerprint(self) -> str:
        """Hash of the fields that change the run (not save_every / compile / attention, nor the tau estimate's
        settings unless an early stop depends on them)."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("save_every", "compile", "attention")}
        # unset: left out, so a recipe without the field keeps its fingerprint
        for unset in ("cache_limit_gb", "family", "init_from", "early_stop_patience"):
            if d.get(unset) is None:
                d.pop(unset, None)
        if d.pop("objective") != "dflash":  # dflash (and its unused alpha) is left out: stored recipes keep their hash
            d["objective"] = self.objective
        else:
            d.pop("dpace_alpha")
        if self.early_stop_patience is None:  # the estimate is only watched: it changes no weight
            for k in ("tau_every", "tau_prompts", "tau_new_tokens"):
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]


@dataclass
class TrainResult:
    checkpoint_dir: Path | None  # the published drafter (None if stopped before the end)
    state_dir: Path | None  # the last resumable training state
    steps: int
    total_steps: int
    losses: list[float]  # global loss of every step from step 1
    tokens_per_s: float  # sequence tokens (all ranks) per second, this invocation
    accuracy_by_position: list[float]  # k = 1..B-1, over the last (possibly partial) epoch
    resumed_from_step: int | None
    wall_s: float
    num_sequences: int
    world_size: int
    config: dict[str, Any] = field(default_factory=dict)
    data_stats: dict[str, Any] = field(default_factory=dict)  # the bounded part cache's counters, when one was used
    draft_tokens: int = 0  # block tokens trained (anchors x block size, all ranks), this invocation
    sequence_tokens: int = 0  # sequence tokens trained (all ranks), this invocation
    draft_slots: int = 0  # block tokens computed, padding included (all ranks), this invocation
    context_slots: int = 0  # context tokens computed, padding included (all ranks), this invocation
    # tau while training: one {"step", "tokens", "tau", "acceptance_by_position", ...} per evaluation, over every
    # invocation (a resume keeps the earlier ones); best: the evaluation with the highest tau (its step is the
    # checkpoint marked best)
    tau_history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    stop_reason: str = ""  # why the run ended: "completed", "early stop: ...", or "" while unfinished
    profile: dict[str, Any] | None = None  # step_profile.StepProfiler's summary of the profiled window, if one ran
    flex_kernel_options: dict[str, Any] = field(default_factory=dict)  # flex's tiles in the steps (empty: flex's own)
    # the same tokens per second of the steps alone: the loop's time less aside_s, its seconds in tau estimates and
    # saved states (this invocation; compiles and the loader's waits stay in)
    steps_tokens_per_s: float = 0.0
    aside_s: float = 0.0
    # the steps alone past the first step of each batch shape (where a compiled step compiles): new_shape_steps such
    # steps took new_shape_s seconds, left out of warm_tokens_per_s with aside_s (this invocation)
    warm_tokens_per_s: float = 0.0
    new_shape_steps: int = 0
    new_shape_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.steps >= self.total_steps

    def to_metadata(self) -> dict[str, Any]:
        tail = self.losses[-50:]
        return {
            "steps": self.steps,
            "total_steps": self.total_steps,
            "final_loss": float(np.mean(tail)) if tail else float("nan"),
            "first_loss": self.losses[0] if self.losses else float("nan"),
            "tokens_per_s": self.tokens_per_s,
            "accuracy_by_position": self.accuracy_by_position,
            "mean_accuracy": float(np.mean(self.accuracy_by_position)) if self.accuracy_by_position else 0.0,
            "resumed_from_step": self.resumed_from_step,
            "wall_s": self.wall_s,
            "num_sequences": self.num_sequences,
            "world_size": self.world_size,
            "draft_tokens_per_sequence_token": self.draft_tokens / self.sequence_tokens if self.sequence_tokens else 0.0,
            # the share of the computed block and context tokens that was padding (0: none, or nothing trained)
            "padded_block_share": 1.0 - self.draft_tokens / self.draft_slots if self.draft_slots else 0.0,
            "padded_context_share": 1.0 - self.sequence_tokens / self.context_slots if self.context_slots else 0.0,
            "tau_history": self.tau_history,
            "best": self.best,
            "stop_reason": self.stop_reason,
        }

