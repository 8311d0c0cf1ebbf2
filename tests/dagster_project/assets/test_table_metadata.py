"""The tabular assets report Dagster's table keys per partition: the catalog shows their columns and rows.

raw_prompts, completions and tokenized_samples run for real (a loopback engine serving the tiny target's
tokenizer); their materializations are read back from the instance's event log and compared with the Parquet
files in the store.
"""

import json

import dagster as dg

from dagster_project.definitions import defs
from dagster_project.metadata import arrow_type_name
from dagster_project.resources import EngineFleetResource, StoreResource
from dflash_assets.store.backends import LocalStore
from tests.support.sglang_loopback import LoopbackServer

TABLES = {"raw_prompts": "raw_prompts/{}.parquet", "completions": "completions/{}.parquet",
          "tokenized_samples": "tokenized_samples/{}.parquet"}


def test_each_tabular_partition_reports_its_column_schema_and_row_count(tmp_path, tiny_dense_target):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Prompt {i}"}]}) + "\n"
                              for i in range(5)))
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine, dg.instance_for_test() as instance:
        resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")),
                     "engines": EngineFleetResource(endpoints=[f"sglang:{engine.url}"], max_concurrency=2)}
        dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                       run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
        (shard,) = instance.get_dynamic_partitions("prompt_shards")
        dg.materialize(defs.assets, selection=list(TABLES), partition_key=shard, instance=instance,
                       resources=resources, raise_on_error=False,  # a blocking check may fail on tiny answers
                       run_config={"ops": {"completions": {"config": {"max_new_tokens": 16}}}})
        events = {name: instance.get_latest_materialization_event(dg.AssetKey(name)) for name in TABLES}

    store = LocalStore(tmp_path / "store")
    for name, key in TABLES.items():
        assert events[name] is not None, f"{name} was not materialized"
        materialization = events[name].asset_materialization
        assert materialization.partition == shard
        table = store.read_parquet(key.format(shard))
        schema = materialization.metadata["dagster/column_schema"].value
        assert isinstance(schema, dg.TableSchema)
        assert [(c.name, c.type) for c in schema.columns] == [(f.name, arrow_type_name(f.type)) for f in table.schema]
        assert materialization.metadata["dagster/row_count"].value == table.num_rows == 5, name
        assert materialization.metadata["dagster/partition_row_count"].value == table.num_rows
    prompt_columns = {c.name for c in events["raw_prompts"].asset_materialization.metadata["dagster/column_schema"].value.columns}
    assert {"prompt_id", "user_turns"} <= prompt_columns
    messages = next(c for c in events["completions"].asset_materialization.metadata["dagster/column_schema"].value.columns
                    if c.name == "messages")
    assert messages.type == "list<struct<role: string, content: string, reasoning_content: string>>"
    sample_columns = {c.name for c in events["tokenized_samples"].asset_materialization.metadata["dagster/column_schema"].value.columns}
    assert {"input_ids", "loss_mask"} <= sample_columns
