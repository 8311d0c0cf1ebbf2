"""Deployment profiles (DFLASH_PROFILE) and the shipped dagster.yaml files."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster._core.storage.config import pg_config
from dagster_postgres.utils import pg_url_from_config

from dagster_project import deployment
from dagster_project.deployment import (
    DeploymentConfigError,
    fleet_settings,
    get_profile,
    missing_settings,
    resources_for_profile,
)
from dagster_project.instance_config import INSTANCE_YAML, instance_yaml, postgres_env, write_instance_yaml
from dagster_project.pipes import GpuHostLauncher, check_specs_for
from dagster_project.resources import StoreResource

REPO = Path(__file__).resolve().parents[1]
CLUSTER_ENV = ("DFLASH_STORE", "DFLASH_GPU_HOSTS", "DFLASH_ENGINE_URLS", "DFLASH_GPU_LAUNCH", "DFLASH_GPU_PYTHON",
               "DFLASH_GPU_WORKDIR", "DFLASH_GPU_ENV", "DFLASH_GPU_REMOTE_SHELL", "DFLASH_ENGINE_KIND",
               "DFLASH_ENGINE_CONCURRENCY", "DFLASH_PROFILE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value, profile", [(None, "local"), ("", "local"), ("local", "local"),
                                            ("cluster", "cluster"), (" Cluster ", "cluster")])
def test_get_profile(monkeypatch, value, profile):
    if value is not None:
        monkeypatch.setenv("DFLASH_PROFILE", value)
    assert get_profile() == profile


def test_unknown_profile_is_refused(monkeypatch):
    monkeypatch.setenv("DFLASH_PROFILE", "prod")
    with pytest.raises(DeploymentConfigError, match="expected one of"):
        get_profile()


def test_local_profile_needs_no_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    res = resources_for_profile()
    assert set(res) == {"store", "gpu_launcher"}
    assert res["store"].uri == str(tmp_path / "dflash-store")
    assert res["gpu_launcher"].command_prefix == [] and res["gpu_launcher"].hosts == []
    assert fleet_settings("local") == {"endpoints": []}


def test_cluster_profile_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("DFLASH_GPU_HOSTS", "gpu-1")
    assert missing_settings("cluster") == ["DFLASH_STORE", "DFLASH_ENGINE_URLS"]
    with pytest.raises(DeploymentConfigError, match="DFLASH_STORE, DFLASH_ENGINE_URLS"):
        resources_for_profile("cluster")


def test_cluster_profile_settings(monkeypatch):
    monkeypatch.setenv("DFLASH_STORE", "s3://dflash/prod")
    monkeypatch.setenv("DFLASH_GPU_HOSTS", "gpu-1, gpu-2,gpu-3")
    monkeypatch.setenv("DFLASH_ENGINE_URLS", "http://router:30000")
    monkeypatch.setenv("DFLASH_GPU_PYTHON", "/opt/dflash/.venv/bin/python")
    monkeypatch.setenv("DFLASH_GPU_ENV", "HF_HOME=/nvme/hf CUDA_VISIBLE_DEVICES=0,1")
    res = resources_for_profile("cluster")
    gpu = res["gpu_launcher"]
    assert gpu.command_prefix == ["ssh", "-o", "BatchMode=yes", "{host}"] and gpu.remote_shell
    assert gpu.hosts == ["gpu-1", "gpu-2", "gpu-3"] and gpu.python == "/opt/dflash/.venv/bin/python"
    assert gpu.env == {"HF_HOME": "/nvme/hf", "CUDA_VISIBLE_DEVICES": "0,1"}
    with dg.build_resources({"store": res["store"]}) as built:  # the store URI is a dg.EnvVar, read at run time
        assert built.store.uri == "s3://dflash/prod"

    monkeypatch.setenv("DFLASH_GPU_LAUNCH", "kubectl exec -i -n gpu {host} --")
    monkeypatch.setenv("DFLASH_GPU_REMOTE_SHELL", "0")
    gpu = resources_for_profile("cluster")["gpu_launcher"]
    assert gpu.command_prefix == ["kubectl", "exec", "-i", "-n", "gpu", "{host}", "--"] and not gpu.remote_shell


def test_fleet_hook_builds_an_engine_fleet_config(monkeypatch):
    from dflash_assets.engine_fleet import EngineFleetConfig

    monkeypatch.setenv("DFLASH_ENGINE_URLS", "http://gpu-1:30000,http://gpu-2:30000")
    monkeypatch.setenv("DFLASH_ENGINE_CONCURRENCY", "64")
    config = EngineFleetConfig(**fleet_settings("local"), target_model="Qwen/Qwen3.6-27B")
    assert [(e.url, e.kind, e.max_concurrency) for e in config.endpoints] == [
        ("http://gpu-1:30000", "openai", 64), ("http://gpu-2:30000", "openai", 64)]
    monkeypatch.setenv("DFLASH_STORE", "s3://b/p")
    monkeypatch.setenv("DFLASH_GPU_HOSTS", "gpu-1")
    assert {e["kind"] for e in fleet_settings("cluster")["endpoints"]} == {"sglang"}


def test_cluster_profile_runs_a_stage_end_to_end(s3_store, moto_endpoint, monkeypatch):
    """DFLASH_PROFILE=cluster against the moto S3 server; the launch prefix stands in for ssh."""
    monkeypatch.setenv("DFLASH_PROFILE", "cluster")
    monkeypatch.setenv("DFLASH_STORE", s3_store.uri)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("DFLASH_GPU_HOSTS", "gpu_a,gpu_b")
    monkeypatch.setenv("DFLASH_GPU_LAUNCH", "env GPU_NAME={host} sh -c")
    monkeypatch.setenv("DFLASH_GPU_PYTHON", sys.executable)
    monkeypatch.setenv("DFLASH_GPU_ENV", f"PYTHONPATH={REPO}")
    monkeypatch.setenv("DFLASH_ENGINE_URLS", "http://127.0.0.1:9")
    s3_store.write_bytes("in/x.bin", b"12345")

    @dg.asset(check_specs=check_specs_for("selftest", "staged"))
    def staged(context: dg.AssetExecutionContext, gpu_launcher: GpuHostLauncher, store: StoreResource):
        payload = {"input_key": "in/x.bin", "output_key": "out/x.bin"}
        return gpu_launcher.run(context, "selftest", payload, store).get_materialize_result()

    defs = dg.Definitions(assets=[staged], resources=resources_for_profile(get_profile()))
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process()
    assert result.success
    assert s3_store.read_bytes("out/x.bin") == b"54321"
    (mat,) = result.get_asset_materialization_events()
    assert mat.materialization.metadata["gpu_host"].value in ("gpu_a", "gpu_b")
    assert "GPU_NAME" in mat.materialization.metadata["env_names"].value


# ---------------------------------------------------------------- dagster.yaml


@pytest.mark.parametrize("profile", sorted(INSTANCE_YAML))
def test_deploy_files_are_the_templates(profile):
    assert (REPO / "deploy" / profile / "dagster.yaml").read_text() == instance_yaml(profile)


def test_local_instance_is_sqlite(tmp_path):
    home = write_instance_yaml(tmp_path / "home", "local").parent
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 2
    finally:
        instance.dispose()


def test_cluster_file_is_a_valid_instance_config(tmp_path, monkeypatch):
    for key, value in postgres_env("db.internal", 5432, "dagster", "secret", "dagster").items():
        monkeypatch.setenv(key, value)
    shutil.copytree(REPO / "deploy" / "cluster", tmp_path / "home")
    config, _ = dagster_instance_config(str(tmp_path / "home"))
    assert config["storage"]["postgres"]["postgres_db"]["password"] == {"env": "DAGSTER_PG_PASSWORD"}
    resolved = process_config(pg_config(), config["storage"]["postgres"])  # what dagster-postgres receives
    assert resolved.success
    assert pg_url_from_config(resolved.value) == "postgresql+psycopg2://dagster:secret@db.internal:5432/dagster"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    limits = config["concurrency"]["runs"]["tag_concurrency_limits"]
    assert limits == [{"key": "dflash/gpu_host", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]
    assert "secret" not in (REPO / "deploy" / "cluster" / "dagster.yaml").read_text()


def test_settings_table_covers_every_variable_read():
    source = Path(deployment.__file__).read_text()
    read = set(re.findall(r'"(DFLASH_[A-Z_]+)"', source)) - {"DFLASH_PROFILE"}
    assert read <= set(deployment.SETTINGS)


def test_cluster_env_example_sets_every_required_variable(monkeypatch):
    """deploy/cluster/dflash.env.example, sourced by a shell, is a complete cluster profile."""
    example = REPO / "deploy" / "cluster" / "dflash.env.example"
    out = subprocess.run(["bash", "-c", f"set -a; . {example}; env -0"], capture_output=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.decode()
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    known = set(deployment.SETTINGS) | set(postgres_env("h", 1, "u", "p", "d")) | {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
    ours = {k for k in env if k.startswith(("DFLASH_", "DAGSTER_PG_", "AWS_"))}
    assert ours <= known
    for key in ours:
        monkeypatch.setenv(key, env[key])
    assert get_profile() == "cluster" and missing_settings("cluster") == []
    gpu = resources_for_profile()["gpu_launcher"]
    assert gpu.hosts == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"] and gpu.env == {"HF_HOME": "/nvme/hf"}
