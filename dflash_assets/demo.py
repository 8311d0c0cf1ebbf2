"""The embedded demo's library parts: its recipe, the answers it previews, the plan checked against the run, tau
of an untrained drafter, and what a failed check means in words.

``dagster_project.demo`` (``make demo``) materializes the graph through
Dagster and calls these on what the runs wrote; a notebook can call them on
any store the stages wrote. Reads the store (completions, the recipe, the
drafter's config, the hidden-state manifests) and the target; writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHECK_ADVICE", "PlanCheck", "answer_line", "demo_recipe", "first_answers", "plan_checks", "untrained_tau"]

# What a failed check means and what to do next, in words (printed by the demo, kept in the summary).
CHECK_ADVICE = {
    "empty_response_ratio": (
        "too many answers are stubs or empty (the reasoning never closed, or nothing came after </think>); "
        "a drafter trained on them learns nothing, so the shard's GPU stage did not run",
        "open the check in the UI (make ui -> tokenized_samples -> Checks) and read the example prompt_ids; "
        "if turns were cut at max_new_tokens, raise it, else fix the engine or target; then materialize "
        "completions and tokenized_samples of the shard again"),
    "schema": (
        "the samples table breaks its own invariants (column types, list lengths, mask sums)",
        "this is a bug in tokenization: report it with the shard's tokenized_samples file"),
    "thinking_ratio": (
        "too few samples carry reasoning although thinking mode was requested",
        "check that the engine renders the chat template with enable_thinking and splits the reasoning out"),
    "truncation_ratio": (
        "many samples were cut at max_length, so their ends are not trained on",
        "raise tokenized_samples' max_length, or accept it for very long prompts"),
}


@dataclass
class PlanCheck:
    """One prediction of ``generation_plan`` against what the run measured."""

    what: str
    predicted: float
    measured: float
    unit: str
    missing: list[str] = field(default_factory=list)  # shards the plan covers but the run did not measure

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.measured if self.measured else None

    def line(self) -> str:
        ratio = f"{self.ratio:.2f}" if self.ratio is not None else "-"
        skipped = f"; not measured: {', '.join(self.missing)} (skipped after a failed check), so the ratio " \
                  f"overstates the plan" if self.missing else ""
        return f"  plan vs run: {self.what} predicted {self.predicted:,.1f} {self.unit}, measured " \
               f"{self.measured:,.1f} {self.unit} (predicted/measured {ratio}){skipped}"


def demo_recipe(shards: list[str]):
    from dflash_assets.drafter.training import DrafterRecipe

    train = shards[:-1] if len(shards) > 1 else shards
    return DrafterRecipe(name="demo-v1", num_layers=2, block_size=8, epochs=3, lr=3e-3, max_anchors=64,
                         max_length=1024, partitions=tuple(train), save_every=20)



def plan_checks(plan: dict[str, Any], completions: dict[str, dict[str, Any]], store: Any) -> list[PlanCheck]:
    """The cost plan's completions wall time and cache bytes against the run's: the completions' ``wall_s``
    summed over shards, and the cache's bytes as its manifests list them. The plan covers every shard; a shard
    the run did not materialize (a failed check upstream) is named in the check, since its share of the
    prediction has nothing measured against it."""
    from dflash_assets.store import layout

    checks = []
    shards = sorted(completions)
    walls = {s: m["wall_s"] for s, m in completions.items() if "wall_s" in m}
    if "generation_wall_s" in plan and walls:
        checks.append(PlanCheck("completions wall time", float(plan["generation_wall_s"]), float(sum(walls.values())),
                                "s", missing=[s for s in shards if s not in walls]))
    entries = layout.list_hidden_state_entries(store)
    if "cache_bytes" in plan and entries:
        measured = sum(e["bytes"] if e["bytes"] is not None else store.size(e["key"])
                       for parts in entries.values() for e in parts)
        checks.append(PlanCheck("cache bytes", plan["cache_bytes"] / 1e6, measured / 1e6, "MB",
                                missing=[s for s in shards if s not in entries]))
    return checks


def first_answers(store: Any, shard: str, count: int = 2) -> list[tuple[str, str]]:
    """The first ``count`` (user prompt, final answer) pairs of a shard's completions, as the target wrote them."""
    from dflash_assets.generation.examples import answer_examples
    from dflash_assets.store import layout

    return answer_examples(store.read_parquet(layout.completions(shard), columns=["messages"]), count)


def answer_line(user: str, answer: str, width: int = 150) -> str:
    """One console line: a prompt and the target's answer, each on one line and cut to fit."""
    from dflash_assets.generation.examples import one_line

    return f"Q: {one_line(user, 60)}  A: {one_line(answer, width - 70)}"


def untrained_tau(store: Any, recipe_name: str, target: str | None, num_prompts: int, max_new_tokens: int) -> float:
    """tau of a freshly initialized drafter (the recipe's shape and seed, no training) on the held-out prompts
    that ``drafter_eval`` decoded: the floor a trained drafter is measured against."""
    import json

    import torch

    from dflash_assets.drafter.decoding import evaluate_drafter
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig
    from dflash_assets.drafter.stages import heldout_prompts, load_recipe
    from dflash_assets.embedded.defaults import default_target_spec
    from dflash_assets.store import layout
    from dflash_assets.target_model.spec import TargetModelSpec

    spec = default_target_spec() if target is None else TargetModelSpec(model_path=str(target), dtype="float32")
    recipe = load_recipe(store, recipe_name)
    prompts, _ = heldout_prompts(store, recipe, spec, num_prompts)
    files = layout.drafter_checkpoint_files(store, recipe_name, ("config.json",))
    config = DrafterConfig.from_hf_dict(json.loads(store.read_bytes(files["config.json"])))
    torch.manual_seed(recipe.seed)
    stop = sorted(spec.chat().stop_ids)
    return float(evaluate_drafter(DFlashDrafter(config), spec.model_path, prompts, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop, check_lossless=False).tau)
