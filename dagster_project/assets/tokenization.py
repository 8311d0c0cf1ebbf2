"""Stage 3: tokenized samples with loss masks, and the data-quality checks that block.

Reads ``completions/<shard>.parquet``, renders each conversation with the
target's chat template, tokenizes it into ``input_ids`` + ``loss_mask`` and
writes ``tokenized_samples/<shard>.parquet``. The checks run on the written
table in the same step; ``empty_response_ratio`` and ``schema`` are blocking,
so a bad partition never reaches the GPU stages. The ratio checks fail only
when the shard's data show the ratio is past its threshold (95% Wilson bound,
``dflash_assets.quality_gates``). Their outcomes are also
written to ``tokenized_samples/<shard>.quality.json`` with the sha256 of the
samples they checked (the gate is pending while the samples are written);
the GPU stages verify both wherever they run.
"""


import dagster as dg

from dagster_project.config import TokenizeStageConfig
from dagster_project.metadata import check_metadata, loss_tokens_chart, table_metadata, to_metadata
from dagster_project.partitions import prompt_shards
from dagster_project.resources import StoreParam, TargetParam
from dagster_project.versions import code_version
from dflash_assets.tokenization.quality import BLOCKING_CHECKS, check_descriptions
from dflash_assets.tokenization.stage import tokenize_partition

SEVERITY = {
    "empty_response_ratio": dg.AssetCheckSeverity.ERROR,
    "thinking_ratio": dg.AssetCheckSeverity.ERROR,
    "truncation_ratio": dg.AssetCheckSeverity.WARN,
    "schema": dg.AssetCheckSeverity.ERROR,
}
# The ratio checks decide by one rule (dflash_assets.quality_gates): on the evidence of the shard, not on its
# observed share alone, so one empty answer in a small shard does not fail it. The descriptions' examples are
# computed from the default thresholds.
CHECK_DESCRIPTIONS = check_descriptions(TokenizeStageConfig().thresholds(thinking_requested=True))


@dg.asset(
    deps=["completions"],
    partitions_def=prompt_shards,
    group_name="tokenization",
    kinds={"python", "parquet"},
    owners=["team:ml-data"],
    code_version=code_version("2", TokenizeStageConfig, target=True),  # 2: ratio checks by the Wilson rule
    check_specs=[
        dg.AssetCheckSpec(name, asset="tokenized_samples", blocking=name in BLOCKING_CHECKS,
                          description=CHECK_DESCRIPTIONS[name], partitions_def=prompt_shards)
        for name in SEVERITY
    ],
)
def tokenized_samples(context: dg.AssetExecutionContext, config: TokenizeStageConfig, store: StoreParam,
                      target: TargetParam):
    """input_ids + loss_mask per sample, rendered with the target's chat template (Parquet).

    The supervised span runs from after the target's assistant header through its end of turn, both read
    off its own template: ``<|im_start|>assistant\\n<think>\\n`` ... ``<|im_end|>\\n``, reasoning included,
    for Qwen3.5/3.6 with thinking (SpecForge's ``qwen3.5`` convention); ``<|im_start|>assistant\\n`` ...
    ``<|im_end|>\\n`` for a ChatML target without thinking (SmolLM2), whose thinking_ratio does not apply.
    """
    spec = target.spec()
    result = tokenize_partition(store.open(), context.partition_key, spec, config.to_library(),
                                config.thresholds(thinking_requested=spec.thinking()), log=context.log.info)
    loss_tokens = loss_tokens_chart(result.table.column("num_loss_tokens").to_numpy(), config.min_loss_tokens)
    metadata = {**to_metadata(result.stats.to_metadata()), **table_metadata(result.table),
                "loss_tokens_histogram": loss_tokens}
    yield dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(result.data_version))
    for name, outcome in result.outcomes.items():
        yield dg.AssetCheckResult(check_name=name, passed=outcome.passed, severity=SEVERITY[name],
                                  description=outcome.description, metadata=check_metadata(outcome.metadata))
