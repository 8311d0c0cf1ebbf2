"""The cluster instance on a real PostgreSQL server: deploy/cluster/dagster.yaml, dagster-postgres.

The server comes from Debian's ``postgresql`` package (see postgres_fixture).
A partitioned asset is materialized through an instance loaded from the
shipped cluster file; its run, events and dynamic partitions must be rows in
PostgreSQL, and a second instance (another host of the deployment, with the
same file and variables) must see them.
"""

import os
import shutil
from pathlib import Path

import dagster as dg
import pytest
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage
from tests.postgres_fixture import postgres_server  # noqa: F401  (the fixture)

from dagster_project.instance_config import POSTGRES_ENV

REPO = Path(__file__).resolve().parents[2]
SHARDS = dg.DynamicPartitionsDefinition(name="prompt_shards")


@dg.asset(partitions_def=SHARDS)
def shard_rows(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    context.log.info(f"counting rows of {context.partition_key}")
    return dg.MaterializeResult(metadata={"rows": dg.MetadataValue.int(3), "shard": context.partition_key})


def _cluster_home(path: Path) -> str:
    path.mkdir()
    shutil.copy(REPO / "deploy" / "cluster" / "dagster.yaml", path / "dagster.yaml")
    return str(path)


@pytest.fixture
def pg_env(postgres_server, monkeypatch):  # noqa: F811
    for key, value in postgres_server.env().items():
        monkeypatch.setenv(key, value)
    return postgres_server


def test_server_runs_unprivileged(postgres_server):  # noqa: F811
    with postgres_server.connect() as conn, conn.cursor() as cur:
        cur.execute("SHOW data_directory")
        (data_dir,) = cur.fetchone()
    assert Path(data_dir).is_relative_to(postgres_server.base_dir)
    if os.geteuid() == 0:  # PostgreSQL refuses root: the fixture must have dropped to another account
        assert Path(data_dir).stat().st_uid != 0 and postgres_server.os_user in ("postgres", "nobody")


def test_partitioned_materialization_lands_in_postgres(pg_env, tmp_path):
    instance = dg.DagsterInstance.from_config(_cluster_home(tmp_path / "orchestrator"))
    try:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        instance.add_dynamic_partitions(SHARDS.name, ["shard-00000", "shard-00001"])
        result = dg.materialize([shard_rows], partition_key="shard-00001", instance=instance)
        assert result.success
    finally:
        instance.dispose()

    with pg_env.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_id = %s", (result.run_id,))
        assert cur.fetchall() == [("SUCCESS",)]
        cur.execute(
            "SELECT partition, event FROM event_logs WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'"
            " AND asset_key = %s",
            (result.run_id, dg.AssetKey("shard_rows").to_string()),
        )
        rows = cur.fetchall()
        assert [r[0] for r in rows] == ["shard-00001"] and '"rows"' in rows[0][1]
        cur.execute("SELECT count(*) FROM event_logs WHERE run_id = %s AND event LIKE %s",
                    (result.run_id, "%counting rows of shard-00001%"))
        assert cur.fetchone()[0] == 1  # the asset's log line is an event row too
        cur.execute("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = %s ORDER BY id", (SHARDS.name,))
        assert [r[0] for r in cur.fetchall()] == ["shard-00000", "shard-00001"]
        cur.execute("SELECT to_regclass('jobs'), to_regclass('job_ticks'), to_regclass('instigators')")
        assert all(cur.fetchone())  # schedule/sensor storage tables live here as well

    # another host of the deployment: same file, same variables, same state
    other = dg.DagsterInstance.from_config(_cluster_home(tmp_path / "other-host"))
    try:
        event = other.get_latest_materialization_event(dg.AssetKey("shard_rows"))
        assert event.run_id == result.run_id
        assert event.asset_materialization.partition == "shard-00001"
        assert event.asset_materialization.metadata["rows"].value == 3
        assert other.get_dynamic_partitions(SHARDS.name) == ["shard-00000", "shard-00001"]
    finally:
        other.dispose()


def test_cluster_file_needs_every_pg_variable(pg_env, tmp_path, monkeypatch):
    monkeypatch.delenv(POSTGRES_ENV[3])  # the password
    with pytest.raises(Exception, match="DAGSTER_PG_PASSWORD"):
        dg.DagsterInstance.from_config(_cluster_home(tmp_path / "home"))
