"""Stage 5: DFlash drafter checkpoints per training recipe, and their measured acceptance length.

Both run on the GPU host through Dagster Pipes. ``drafter_checkpoint`` trains
the recipe (``drafter_recipes/<name>.json`` in the store) on the hidden-state
partitions it selects and publishes safetensors + config.json in the layout
public DFlash inference loads. ``drafter_eval`` decodes held-out prompts
speculatively and reports tau; its ``lossless`` check fails if the output
ever differs from the target's own greedy output.
"""

import dagster as dg

from dagster_project.config import DrafterEvalConfig, DrafterTrainingConfig
from dagster_project.metadata import render_pipes_result
from dagster_project.partitions import drafter_recipes
from dagster_project.pipes import GpuLauncherParam, check_specs_for
from dagster_project.resources import StoreParam, TargetParam
from dagster_project.versions import code_version


@dg.asset(
    deps=[dg.AssetDep("hidden_state_cache", partition_mapping=dg.AllPartitionMapping())],
    partitions_def=drafter_recipes,
    group_name="drafter",
    kinds={"pytorch", "safetensors", "gpu"},
    owners=["team:ml-training"],
    code_version=code_version("1", DrafterTrainingConfig, target=True),
    pool="gpu",
)
def drafter_checkpoint(context: dg.AssetExecutionContext, config: DrafterTrainingConfig, store: StoreParam,
                       target: TargetParam, gpu_launcher: GpuLauncherParam) -> dg.MaterializeResult:
    """A trained DFlash drafter (``DFlashDraftModel``): model.safetensors + config.json, resumable training."""
    payload = {**config.to_stage_payload(work_dir=gpu_launcher.work_dir), "target": target.spec().model_dump()}
    return render_pipes_result(gpu_launcher.run(context, "drafter_checkpoint", payload, store).get_materialize_result())


@dg.asset(
    deps=[drafter_checkpoint],
    partitions_def=drafter_recipes,
    group_name="drafter",
    kinds={"pytorch", "gpu"},
    owners=["team:ml-training"],
    code_version=code_version("1", DrafterEvalConfig, target=True),
    pool="gpu",
    check_specs=check_specs_for("drafter_eval", "drafter_eval"),
)
def drafter_eval(context: dg.AssetExecutionContext, config: DrafterEvalConfig, store: StoreParam,
                 target: TargetParam, gpu_launcher: GpuLauncherParam):
    """Acceptance length tau (tokens per verification) of the checkpoint against its target, per category."""
    payload = {**config.model_dump(), "target": target.spec().model_dump()}
    for result in gpu_launcher.run(context, "drafter_eval", payload, store).get_results():
        yield render_pipes_result(result)
