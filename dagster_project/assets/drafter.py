"""Stage 5: DFlash drafter checkpoints per training recipe, and their measured acceptance length.

Both run on the GPU host through Dagster Pipes. ``drafter_checkpoint`` trains
the recipe (``drafter_recipes/<name>.json`` in the store) on the hidden-state
partitions it selects and publishes safetensors + config.json in the layout
public DFlash inference loads. ``drafter_eval`` decodes held-out prompts
speculatively and reports tau; its ``lossless`` check fails if the output
ever differs from the target's own greedy output.

``drafter_checkpoint`` carries three blocking checks:

- ``decontamination`` runs in the asset body before the GPU run is launched (a check on the recipe that
  must decide before GPU hours are spent; a check that ran after the asset would only stop drafter_eval):
  the held-out prompts drafter_eval would decode and the benchmark prompt files listed in
  ``DFLASH_BENCHMARK_PROMPTS`` (paths separated by ``os.pathsep``) against every user turn of the trained
  shards (``dflash_assets.drafter.decontamination``). Contaminated: the check fails and the asset fails
  without training. Its result goes into the checkpoint's ``provenance.json``.
- ``preflight``: on the GPU host, before the long run, the recipe's drafter memorizes a handful of its samples and
  decodes them at tau near the block size, and the cached features are its target layers
  (``dflash_assets.drafter.preflight``); a failure stops the run there, with per-position accuracy and what to look
  at. The run config's ``preflight: false`` skips it (the check then warns).
- ``serving_match``: after training, the published checkpoint against SGLang's DFlash loader rules and the
  served target's chat template and thinking mode (``dflash_assets.drafter.serving_match``); the served side
  is the deployment's target settings (SGLang reports no chat template).

``drafter_eval`` carries the blocking ``promotion`` check: tau of the run's checkpoints (learning-curve ones
and the final one) by slice, against the family's promoted checkpoint (``dflash_assets.drafter.promotion``);
the winner is written to ``drafter_promoted/<family>/manifest.json``, which the serving side reads.
"""

import dagster as dg

from dagster_project.config import DrafterEvalConfig, DrafterTrainingConfig, GenerationStageConfig
from dagster_project.metadata import check_metadata, render_pipes_result
from dagster_project.partitions import drafter_recipes
from dagster_project.pipes import GpuLauncherParam, check_specs_for
from dagster_project.profile import benchmark_prompt_files
from dagster_project.resources import StoreParam, TargetParam
from dagster_project.versions import code_version
from dflash_assets.drafter.checkpoint_checks import (decontamination_outcome, not_run_after, preflight_outcome,
                                                     preflight_report, serving_match_outcome)
from dflash_assets.drafter.decontamination import recipe_decontamination
from dflash_assets.drafter.serving_match import served_target_from_spec
from dflash_assets.drafter.stages import load_recipe, training_shards
from dflash_assets.generation.config import GenerationConfig, candidate_settings
from dflash_assets.stage_io import CheckOutcome


def completions_run_configs(context: dg.AssetExecutionContext, shards: list[str]) -> list[GenerationConfig]:
    """The generation config of each run that last materialized one of ``shards``' completions (Dagster's records)."""
    configs, runs = [], set()
    for shard in shards:
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard]), limit=1).records
        if records and records[0].run_id not in runs:
            runs.add(records[0].run_id)
            run = context.instance.get_run_by_id(records[0].run_id)
            cfg = ((run.run_config or {}).get("ops") or {}).get("completions", {}).get("config") if run else None
            if cfg:
                configs.append(GenerationStageConfig(**cfg).to_library(enable_thinking=False))
    return configs


@dg.asset(
    deps=[dg.AssetDep("hidden_state_cache", partition_mapping=dg.AllPartitionMapping())],
    partitions_def=drafter_recipes,
    group_name="drafter",
    kinds={"pytorch", "safetensors", "gpu"},
    owners=["team:ml-training"],
    code_version=code_version("1", DrafterTrainingConfig, target=True),
    pool="gpu",
    check_specs=[
        dg.AssetCheckSpec("decontamination", asset="drafter_checkpoint", blocking=True,
                          description="Held-out and benchmark prompts never appear in the trained shards (exact or "
                                      "near duplicate); decided before training starts."),
        dg.AssetCheckSpec("preflight", asset="drafter_checkpoint", blocking=True,
                          description="Before the long run, the recipe's drafter memorized a handful of its samples "
                                      "and decoded them losslessly at tau near the block size, and the cached "
                                      "features are the drafter's target layers; a failure names per-position "
                                      "accuracy and what to look at, and no long run starts."),
        dg.AssetCheckSpec("serving_match", asset="drafter_checkpoint", blocking=True,
                          description="The checkpoint loads in SGLang's DFlash loader as trained (config fields, "
                                      "block size, layers, mask id, no embedding/head, dtype) and was trained on "
                                      "samples of the served target's chat template and thinking mode."),
    ],
)
def drafter_checkpoint(context: dg.AssetExecutionContext, config: DrafterTrainingConfig, store: StoreParam,
                       target: TargetParam, gpu_launcher: GpuLauncherParam):
    """A trained DFlash drafter (``DFlashDraftModel``): model.safetensors + config.json + provenance.json."""
    st, spec = store.open(), target.spec()
    shards = training_shards(st, load_recipe(st, context.partition_key))
    decontamination = decontamination_outcome(
        recipe_decontamination(st, shards, benchmark_files=benchmark_prompt_files()))
    if not decontamination.passed:  # no GPU time for a recipe whose evaluation would be contaminated
        yield from map(_check_result, [decontamination, *not_run_after("decontamination")])
        raise dg.Failure(description=f"decontamination: {decontamination.description}", allow_retries=False)
    provenance_inputs = {
        "decontamination": dict(decontamination.metadata),
        "generation_settings": candidate_settings(completions_run_configs(context, shards), spec.thinking()),
        "dagster_code_versions": {k.to_user_string(): v for k, v in context.assets_def.code_versions_by_key.items()},
    }
    payload = {**config.to_stage_payload(work_dir=gpu_launcher.work_dir), "target": spec.model_dump(),
               "provenance_inputs": provenance_inputs, "preflight_run": context.run_id}
    try:
        trained = gpu_launcher.run(context, "drafter_checkpoint", payload, store).get_materialize_result()
    except Exception:
        preflight = preflight_outcome(preflight_report(st, context.partition_key, context.run_id), config.preflight)
        if preflight.passed or preflight.severity == "WARN":  # the failure is not the preflight's
            raise
        yield from map(_check_result, [decontamination, preflight, *not_run_after("preflight")])
        raise dg.Failure(description=preflight.description or "preflight failed", allow_retries=False) from None
    yield render_pipes_result(trained)
    preflight = preflight_outcome(preflight_report(st, context.partition_key, context.run_id), config.preflight)
    match = serving_match_outcome(st, context.partition_key, served_target_from_spec(spec))
    yield from map(_check_result, [decontamination, preflight, match])


def _check_result(outcome: CheckOutcome) -> dg.AssetCheckResult:
    """A library check outcome as Dagster's check result."""
    return dg.AssetCheckResult(check_name=outcome.name, passed=outcome.passed,
                               severity=dg.AssetCheckSeverity[outcome.severity],
                               metadata=check_metadata(dict(outcome.metadata)))

@dg.asset(
    deps=[drafter_checkpoint],
    partitions_def=drafter_recipes,
    group_name="drafter",
    kinds={"pytorch", "gpu"},
    owners=["team:ml-training"],
    code_version=code_version("1", DrafterEvalConfig, target=True),
    pool="gpu",
    check_specs=[*check_specs_for("drafter_eval", "drafter_eval"),
                 dg.AssetCheckSpec("promotion", asset="drafter_eval", blocking=True,
                                   description="The run's best checkpoint beats the family's promoted drafter on "
                                               "tau, re-measured on the same held-out prompts, and loses no more "
                                               "than promotion_margin on any slice; then it is promoted "
                                               "(drafter_promoted/FAMILY/manifest.json). Says which slice "
                                               "regressed.")],
)
def drafter_eval(context: dg.AssetExecutionContext, config: DrafterEvalConfig, store: StoreParam,
                 target: TargetParam, gpu_launcher: GpuLauncherParam):
    """Acceptance length tau (tokens per verification) of the checkpoint against its target, per slice; promotes
    the run's best checkpoint when it beats the promoted one (check ``promotion``)."""
    payload = {**config.model_dump(), "target": target.spec().model_dump()}
    for result in gpu_launcher.run(context, "drafter_eval", payload, store).get_results():
        yield render_pipes_result(result)
