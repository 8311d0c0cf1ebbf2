"""Jobs: one per stage range, so each kind of host runs only its own stages.

- ``ingest_prompts_job``: ``prompt_corpus`` alone (unpartitioned). Reads the
  prompt source, registers new ``prompt_shards`` partitions. The target of
  ``prompt_source_sensor``.
- ``prepare_data_job``: the per-shard CPU stages: ``raw_prompts`` and what
  follows it in groups ``prompts``, ``generation`` and ``tokenization``
  (``completions`` -> ``tokenized_samples`` and their checks), partitioned by
  ``prompt_shards``. Runs where the orchestrator runs; generation goes over
  HTTP to the engines.
- ``plan_generation_job``: the corpus-level (unpartitioned) assets of those
  groups besides the ingest: ``generation_plan``, the corpus's cost plan
  (generation wall time, cache bytes, GPU-hours of capture and training,
  offline or online) to materialize after an ingest and before any backfill.
- ``self_prompts_job``: group ``self_prompts`` (``self_generated_prompts``),
  partitioned by ``prompt_shards``: the target, loaded in the run's process,
  writes a shard's prompts; apart from ``prepare_data_job`` so that preparing
  a shard never samples prompts unasked.
- ``hidden_states_job``: group ``hidden_states`` (``hidden_state_cache``),
  partitioned by ``prompt_shards``; its steps hold the ``gpu`` pool and the
  work itself goes to a GPU host through Dagster Pipes.
- ``drafter_job``: group ``drafter`` (``drafter_checkpoint``,
  ``drafter_eval``), partitioned by ``drafter_recipes``; GPU as above.
- ``refresh_drafter_job``: the same assets, launched for a refresh recipe
  (``init_from: promoted``) after the target changed: warm start from the
  promoted drafter, tau old vs new in the ``promotion`` check.

The GPU stages are two jobs, not one: an asset job has one partitions
definition, and hidden states (per prompt shard) and the drafter (per recipe)
have different ones. Selections are by group name (and, for the CPU stages,
downstream of ``raw_prompts``), so a group whose assets do not exist yet gives
an empty job rather than an error, and a stage joins its job by declaring
``group_name``. Each job carries a ``dflash/host_kind`` run tag (``cpu`` or
``gpu``) that ``tag_concurrency_limits`` in ``dagster.yaml`` can cap.

Where the runs show in the UI (checked against ``dagster dev`` 1.13.27):
a run launched from an asset's page (**Materialize…**, or a backfill from
its partitions dialog) or from the global lineage runs as Dagster's hidden
``__ASSET_JOB``: the UI picks the first job the assets share in sorted
order, ``__ASSET_JOB`` sorts first, and the backfill daemon runs every asset
backfill as that job. Such runs are listed under **Runs** (a backfill as one
row; its runs with "Show runs within backfills"), on the backfill's page and
on each asset's partitions, never under these jobs, and they carry no
``dflash/host_kind`` tag. A run launched from a job's page (Jobs -> the job
-> **Materialize all…**; for a partitioned job pick the partitions ->
**Launch backfill**) or by ``prompt_source_sensor`` is that job's own: it
shows on the job's Runs tab and carries the tag. The descriptions say so,
since they are what the job's page shows.

Reads and writes nothing itself.
"""

from __future__ import annotations

import dagster as dg


__all__ = [
    "HOST_KIND_TAG",
    "CPU_GROUPS",
    "HIDDEN_STATES_GROUP",
    "SELF_PROMPTS_GROUP",
    "DRAFTER_GROUP",
    "ingest_prompts_job",
    "prepare_data_job",
    "plan_generation_job",
    "self_prompts_job",
    "hidden_states_job",
    "drafter_job",
    "refresh_drafter_job",
    "ALL_JOBS",
]

HOST_KIND_TAG = "dflash/host_kind"
LAUNCH_HERE = (" Launch from this page (Materialize all…) to keep the runs under this job; runs launched from an "
               "asset's page run as __ASSET_JOB and are listed under Runs.")
CPU_GROUPS = ("prompts", "generation", "tokenization")
HIDDEN_STATES_GROUP = "hidden_states"
SELF_PROMPTS_GROUP = "self_prompts"
DRAFTER_GROUP = "drafter"

ingest_prompts_job = dg.define_asset_job(
    "ingest_prompts_job",
    selection=dg.AssetSelection.assets("prompt_corpus"),
    description="Ingest the prompt source and register new prompt_shards partitions (prompt_corpus)." + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "cpu"},
)

_CPU = dg.AssetSelection.groups(*CPU_GROUPS)
# Per shard: raw_prompts and its descendants in the CPU groups. Corpus-level assets (the ingest, the
# generation plan) stay out: a partitioned run would otherwise redo them for every shard.
_PER_SHARD_CPU = dg.AssetSelection.assets("raw_prompts").downstream() & _CPU

prepare_data_job = dg.define_asset_job(
    "prepare_data_job",
    selection=_PER_SHARD_CPU,
    description="CPU hosts, per prompt shard: raw prompts -> completions -> tokenized samples, with their checks."
    + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "cpu"},
)

plan_generation_job = dg.define_asset_job(
    "plan_generation_job",
    selection=_CPU - _PER_SHARD_CPU - dg.AssetSelection.assets("prompt_corpus"),
    description="Corpus-level CPU assets (generation_plan): the cost plan, measured on the engines: generation "
    "wall time, cache bytes, capture and training GPU-hours, offline or online. Run after an ingest, before any "
    "backfill." + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "cpu"},
)

self_prompts_job = dg.define_asset_job(
    "self_prompts_job",
    selection=dg.AssetSelection.groups(SELF_PROMPTS_GROUP),
    description="Per prompt shard: the target writes prompts itself (self_generated_prompts, with its blocking "
    "check), in the run's process; raw_prompts mixes them in by its run config's weight." + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "cpu"},
)

hidden_states_job = dg.define_asset_job(
    "hidden_states_job",
    selection=dg.AssetSelection.groups(HIDDEN_STATES_GROUP),
    description="GPU hosts, per prompt shard: target hidden states of the DFlash layers (pool 'gpu')." + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "gpu"},
)

drafter_job = dg.define_asset_job(
    "drafter_job",
    selection=dg.AssetSelection.groups(DRAFTER_GROUP),
    description="GPU hosts, per drafter recipe: train the DFlash drafter and measure its acceptance length."
    + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "gpu"},
)

refresh_drafter_job = dg.define_asset_job(
    "refresh_drafter_job",
    selection=dg.AssetSelection.groups(DRAFTER_GROUP),
    description="After the target changed (its fingerprint is in the code version of completions and everything "
    "downstream, so the UI marks them stale): for a recipe with init_from 'promoted', train warm-started from the "
    "family's promoted drafter (when the shapes match) and measure tau of new and promoted on the same held-out "
    "prompts (check 'promotion': old tau, new tau, delta). Materialize the stale per-shard stages first "
    "(prepare_data_job, hidden_states_job)." + LAUNCH_HERE,
    tags={HOST_KIND_TAG: "gpu", "dflash/refresh": "true"},
)

# The stage jobs: every asset in exactly one. refresh_drafter_job repeats drafter_job's assets for another purpose,
# so it is registered beside them (definitions.py), not among them.
ALL_JOBS = [ingest_prompts_job, prepare_data_job, plan_generation_job, self_prompts_job, hidden_states_job,
            drafter_job]
