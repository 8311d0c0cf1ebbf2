"""Stage 4: hidden-state caches of the target's DFlash layers.

Runs on whichever host has the GPU, through Dagster Pipes (``GpuHostLauncher``;
a local subprocess by default). The host reads ``tokenized_samples/<shard>``
from the store, refuses a partition whose blocking checks failed, captures
the chosen layers with forward hooks (the model cut after the last one) and
writes its parts under ``hidden_state_cache/<shard>/<version>/``, then the
manifest ``hidden_state_cache/<shard>.manifest.json`` naming them. Limited by
the ``gpu`` pool.
"""

import dagster as dg

from dagster_project.config import HiddenStateCacheConfig
from dagster_project.partitions import prompt_shards
from dagster_project.pipes import GpuLauncherParam
from dagster_project.resources import StoreParam, TargetParam
from dagster_project.versions import code_version


@dg.asset(
    deps=["tokenized_samples"],
    partitions_def=prompt_shards,
    group_name="hidden_states",
    kinds={"pytorch", "safetensors", "gpu"},
    owners=["team:ml-training"],
    code_version=code_version("1", HiddenStateCacheConfig, target=True),
    pool="gpu",
)
def hidden_state_cache(context: dg.AssetExecutionContext, config: HiddenStateCacheConfig, store: StoreParam,
                       target: TargetParam, gpu_launcher: GpuLauncherParam) -> dg.MaterializeResult:
    """Target hidden states of the DFlash layers for every token: ``hidden`` [tokens, n_layers*H],
    ``input_ids``, ``loss_mask``, ``cu_seqlens`` (safetensors, memory-mappable per sample)."""
    payload = {**config.to_stage_payload(scratch_dir=gpu_launcher.scratch_dir), "target": target.spec().model_dump()}
    return gpu_launcher.run(context, "hidden_state_cache", payload, store).get_materialize_result()
