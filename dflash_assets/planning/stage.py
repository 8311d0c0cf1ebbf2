"""The ``generation_plan`` stage: the corpus's cost plan from the target, the store and the fleet.

:func:`plan_corpus` measures what it can and falls back, figure by figure, to
what it cannot measure:

- generation wall time: a pilot of ``pilot_prompts`` real prompts through the
  whole completions path (only while no completions exist), else a throughput
  burst per endpoint whose requests are real ones (the completions', else the
  raw prompts' first turns, else one fixed prompt); on a fleet of one in-process
  Transformers engine, the pilot's lengths and shares with the engine's generate
  calls replayed over the corpus's own prompts, each priced by a cost model of
  one call timed on this host (``planning.batch_costs``), since on a CPU a call's
  time follows its prompt tokens, which a few pilot prompts do not represent;
- output tokens per turn: the config, else the completions, else the pilot,
  else ``max_new_tokens``;
- turns per prompt: the completions, else the pilot, else the raw prompts'
  user turns (capped at ``max_turns``), else the config (1.0);
- tokens per tokenized sample: the config, else the completions, else the
  pilot scaled to the corpus's prompt lengths, else the pilot, else turns x
  output tokens (capped at ``max_length``).

Each figure's source is in the returned metadata. The cache bytes and GPU-hours
are ``planning.costs``' arithmetic over the target's config and DFlash layers.

Reads the target's config.json and tokenizer (through its spec), the corpus
index and a few columns of the ``completions`` and ``raw_prompts`` shards, and
the fleet's endpoints (a burst, or a pilot that writes into a temporary
directory). Writes nothing to the store: the plan is returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.fleet import EngineFleetConfig
from dflash_assets.planning.batch_costs import estimate_inprocess, inprocess_endpoint
from dflash_assets.planning.costs import CorpusShape, CostPlan, GenerationCost, TargetShape, plan_costs
from dflash_assets.planning.measurements import (
    CompletionsMeasure,
    PilotMeasure,
    PromptsMeasure,
    measure_completions,
    measure_prompts,
    partition_rows,
    pilot,
    plan_generation,
    sample_prompt_rows,
)
from dflash_assets.prompts.corpus import corpus_prompt_count, list_shard_keys
from dflash_assets.tokenization.samples import TokenizeConfig

__all__ = ["CorpusPlan", "plan_corpus"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorpusPlan:
    """The cost plan and its metadata: the plan's figures, the measurements and where each figure came from."""

    plan: CostPlan
    metadata: dict[str, Any]

    def markdown(self) -> str:
        return self.plan.markdown()


def plan_corpus(store: Any, target: Any, fleet: EngineFleetConfig, *, generation: GenerationConfig,
                max_length: int | None = None, pilot_prompts: int = 0, probe_requests: int | None = None,
                probe_max_new_tokens: int = 256, expected_output_tokens: float | None = None,
                turns_per_prompt: float | None = None, tokens_per_sample: float | None = None,
                cache_budget_gb: float | None = None, max_partitions: int = 16,
                log: Callable[[str], None] = logger.info) -> CorpusPlan:
    """The corpus's cost plan (see the module for what is measured and each fallback).

    ``target`` is a ``TargetModelSpec``; ``generation`` the completions' settings the backfill will use (the
    burst and the pilot generate with them); ``max_length`` caps tokens per sample as ``tokenized_samples``
    does (default: ``TokenizeConfig``'s). ``probe_requests`` is also the number of real requests sampled for
    the burst (default: ``pilot_prompts`` when a pilot was asked for, else 2x each endpoint's busy_concurrency);
    its turns are capped at the lesser of ``probe_max_new_tokens`` and ``generation.max_new_tokens``.
    On one in-process Transformers endpoint the pilot's wall time is not scaled: the engine's generate calls
    are replayed over the prompts of ``max_partitions`` partitions (all, or an evenly spaced sample) and priced
    by a cost model timed on this host (``planning.batch_costs``).
    """
    prompts = corpus_prompt_count(store)
    partitions = max(1, len(list_shard_keys(store)))
    max_length = max_length if max_length is not None else TokenizeConfig().max_length
    tokenizer = target.load_tokenizer()
    sample = probe_requests or 64
    done = measure_completions(store, sample=sample, max_length=max_length)  # a few columns, one shard at a time
    seen = measure_prompts(store, max_turns=generation.max_turns, sample=sample)
    trial = rows = None
    if done is None and pilot_prompts > 0:
        rows = sample_prompt_rows(store, pilot_prompts)
        if rows is not None:
            trial = pilot(fleet, rows, generation=generation, tokenizer=tokenizer, max_length=max_length)
            log(f"pilot: {trial.done} of {trial.prompts} prompts in {trial.wall_s:.1f} s "
                f"({trial.dispatch_s:.1f} s dispatch), {trial.turns} turns, {trial.completion_tokens} tokens")
    measured = trial if trial is not None and trial.done else None
    output_tokens, output_source = _output_tokens_per_turn(expected_output_tokens, done, measured, generation)
    turns, turns_source = _turns_per_prompt(turns_per_prompt, done, measured, seen)
    per_sample, sample_source = _tokens_per_sample(tokens_per_sample, done, measured, seen, max_length,
                                                   turns * output_tokens)
    metadata: dict[str, Any] = {}
    engine_ep = inprocess_endpoint(fleet) if measured else None
    if measured and engine_ep is not None:
        shards, replayed = partition_rows(store, max_partitions)
        estimate = estimate_inprocess(fleet, target.chat(), generation, replayed, total_partitions=max(shards, 1),
                                      pilot=measured, pilot_rows=rows.to_pylist(), log=log)
        log(f"generation wall time {estimate.wall_s:.1f} s on {estimate.describe()}")
        cost = GenerationCost.from_inprocess(estimate, measured, prompts, engine_ep.url)
        metadata.update(measured.to_metadata(prompts, partitions))
        metadata.update(estimate.to_metadata())
    elif measured:
        cost = GenerationCost.from_pilot(measured, prompts, partitions)
        metadata.update(measured.to_metadata(prompts, partitions))
        metadata["generation_model"] = "the pilot's prompts per second of dispatch scaled to the corpus, plus " \
                                       "its run less its dispatch once per partition"
    else:
        # The burst: no longer than the run's own turns, and as small as a pilot the caller asked for (a second
        # `make demo` ran 64 requests of 256 tokens here, 927 s on 2 CPU cores, where the first run's pilot took 15 s)
        estimate = plan_generation(
            fleet, prompts=prompts, output_tokens_per_turn=output_tokens, turns_per_prompt=turns,
            tokenizer=tokenizer, generation=generation,
            max_new_tokens=min(probe_max_new_tokens, generation.max_new_tokens),
            requests=probe_requests or (pilot_prompts if pilot_prompts > 0 else None),
            conversations=(done.sample if done else ()) or (seen.sample if seen else None))
        cost = GenerationCost.from_estimate(estimate)
        metadata.update(estimate.to_metadata())
        metadata["generation_model"] = "output tokens over the tokens per second a burst measured per endpoint"
        metadata["burst_prompts"] = "completions" if done and done.sample else ("raw_prompts" if seen else "fixed")
    model_config = target.load_config()
    shape = TargetShape.from_config(model_config, target.layer_ids(model_config), name=Path(target.model_path).name,
                                    dtype_bytes=4 if target.dtype == "float32" else 2)
    corpus = CorpusShape(prompts, max(per_sample, 1.0), turns, output_tokens, partitions=partitions,
                         source=sample_source)
    budget = int(cache_budget_gb * 1e9) if cache_budget_gb is not None else None
    plan = plan_costs(shape, corpus, generation=cost, budget_bytes=budget)
    log(f"cost plan:\n{plan.markdown()}")
    metadata.update(plan.to_metadata())
    metadata.update({"estimated_wall_s": metadata["generation_wall_s"], "estimated_wall": metadata["generation_wall"],
                     "output_tokens_source": output_source, "turns_source": turns_source})
    return CorpusPlan(plan, metadata)


def _output_tokens_per_turn(given: float | None, done: CompletionsMeasure | None, measured: PilotMeasure | None,
                            generation: GenerationConfig) -> tuple[float, str]:
    """Generated tokens per assistant turn and where the figure came from."""
    if given:
        return given, "config"
    if done:
        return done.output_tokens_per_turn, "completions"
    if measured:
        return measured.completion_tokens / max(measured.turns, 1), "pilot"
    return generation.max_new_tokens, "max_new_tokens"


def _turns_per_prompt(given: float | None, done: CompletionsMeasure | None, measured: PilotMeasure | None,
                      seen: PromptsMeasure | None) -> tuple[float, str]:
    """Assistant turns regenerated per prompt and where the figure came from (the config is the last resort)."""
    if done:
        return done.turns_per_prompt, "completions"
    if measured:
        return measured.turns / measured.done, "pilot"
    if seen:
        return seen.turns_per_prompt, "raw_prompts"
    return given or 1.0, "config"


def _tokens_per_sample(given: float | None, done: CompletionsMeasure | None, measured: PilotMeasure | None,
                       seen: PromptsMeasure | None, max_length: int, generated: float) -> tuple[float, str]:
    """Mean tokens of a tokenized sample and where the figure came from; ``generated``: turns x output tokens."""
    if given:
        return given, "config"
    if done:
        return done.tokens_per_sample, "completions"
    if measured and seen:
        return measured.scaled_tokens_per_sample(seen.user_chars_per_prompt), "pilot + the corpus's prompt lengths"
    if measured:
        return measured.tokens_per_sample, "pilot"
    return min(max_length, generated), "assumed: turns x output tokens"
