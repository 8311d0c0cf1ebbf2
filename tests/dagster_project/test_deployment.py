"""Deployment profiles (DFLASH_PROFILE), the engine each profile generates with, the shipped dagster.yaml
files, and how ``make ui`` stops."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
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
    engines_for_profile,
    get_profile,
    gpu_launcher_for_profile,
    missing_settings,
    resources_for_profile,
    store_for_profile,
)
from dagster_project.instance_config import INSTANCE_YAML, instance_yaml, postgres_env, write_instance_yaml
from dagster_project.pipes import GpuLauncherParam, check_specs_for
from dagster_project.resources import EngineFleetResource, StoreParam, StoreResource, deployment_resource

REPO = Path(__file__).resolve().parents[2]
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
    assert set(resources_for_profile()) == {"store", "target", "engines", "gpu_launcher"}
    with dg.build_resources(resources_for_profile()) as built:
        assert built.store.uri == str(tmp_path / "dflash-store")
        assert built.gpu_launcher.command_prefix == [] and built.gpu_launcher.hosts == []
        assert built.engines.endpoints == [] and built.target.model_path is None


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
    gpu = gpu_launcher_for_profile("cluster")
    assert gpu.command_prefix == ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=30", "-o",
                                  "ServerAliveCountMax=4", "{host}"] and gpu.remote_shell
    assert gpu.hosts == ["gpu-1", "gpu-2", "gpu-3"] and gpu.python == "/opt/dflash/.venv/bin/python"
    assert gpu.env == {"HF_HOME": "/nvme/hf", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu.timeout_s == 48 * 3600  # a hung stage frees its gpu pool slot
    assert store_for_profile("cluster").uri == "s3://dflash/prod"

    monkeypatch.setenv("DFLASH_GPU_LAUNCH", "kubectl exec -i -n gpu {host} --")
    monkeypatch.setenv("DFLASH_GPU_REMOTE_SHELL", "0")
    monkeypatch.setenv("DFLASH_GPU_STAGE_TIMEOUT_S", "3600")
    gpu = gpu_launcher_for_profile("cluster")
    assert gpu.timeout_s == 3600
    assert gpu.command_prefix == ["kubectl", "exec", "-i", "-n", "gpu", "{host}", "--"] and not gpu.remote_shell


def test_the_profile_builds_the_engine_fleet_from_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_ENGINE_URLS", "http://gpu-1:30000,http://gpu-2:30000")
    monkeypatch.setenv("DFLASH_ENGINE_CONCURRENCY", "64")
    config = engines_for_profile("local").fleet_config(target_model="Qwen/Qwen3.6-27B")
    assert [(e.url, e.kind, e.max_concurrency) for e in config.endpoints] == [
        ("http://gpu-1:30000", "openai", 64), ("http://gpu-2:30000", "openai", 64)]
    monkeypatch.setenv("DFLASH_STORE", "s3://b/p")
    monkeypatch.setenv("DFLASH_GPU_HOSTS", "gpu-1")
    assert {e.kind for e in engines_for_profile("cluster").fleet_config(target_model="t").endpoints} == {"sglang"}



def test_the_completions_asset_is_tagged_with_the_engines_in_use():
    """The UI's kind tags name the engine the deployment generates with, not always SGLang: the definitions are
    loaded in a fresh process per environment, as a code location loads them."""
    code = ("import dagster as dg; from dagster_project.definitions import defs; "
            "print(sorted(defs.resolve_assets_def('completions').specs_by_key[dg.AssetKey('completions')].kinds))")
    seen = {}
    for urls in ("", "sglang:http://gpu-1:30000,openai:http://gpu-2:8000"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")} | {"DFLASH_ENGINE_URLS": urls}
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                              cwd=Path(__file__).parents[2], check=True)
        seen[urls] = done.stdout.strip().splitlines()[-1]
    assert seen[""] == "['parquet', 'transformers']"  # local: the embedded transformers serve
    assert seen["sglang:http://gpu-1:30000,openai:http://gpu-2:8000"] == "['openai', 'parquet', 'sglang']"

def test_unset_settings_are_the_librarys_defaults(monkeypatch):
    """A default is written once, in the library: an empty environment gives exactly its values, and a set
    variable still wins (including 0 for the read timeout: only the turn limit)."""
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.target_model.conventions import DEFAULT_NUM_TARGET_LAYERS, MASK_TOKEN

    for name in ("DFLASH_ENGINE_READ_TIMEOUT_S", "DFLASH_TARGET_NUM_LAYERS", "DFLASH_TARGET_MASK_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DFLASH_ENGINE_URLS", "http://gpu-1:30000")
    fleet = engines_for_profile("local").fleet_config(target_model="t")
    library = EngineFleetConfig(target_model="t")
    assert fleet.endpoints[0].max_concurrency == EndpointConfig(url="u").max_concurrency
    assert (fleet.read_timeout_s, fleet.request_timeout_s, fleet.max_retries) == (
        library.read_timeout_s, library.request_timeout_s, library.max_retries)
    target = deployment.target_for_profile("local")
    assert (target.num_target_layers, target.mask_token) == (DEFAULT_NUM_TARGET_LAYERS, MASK_TOKEN)

    monkeypatch.setenv("DFLASH_ENGINE_READ_TIMEOUT_S", "0")
    monkeypatch.setenv("DFLASH_TARGET_NUM_LAYERS", "3")
    assert engines_for_profile("local").fleet_config(target_model="t").read_timeout_s is None
    assert deployment.target_for_profile("local").num_target_layers == 3


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
    def staged(context: dg.AssetExecutionContext, gpu_launcher: GpuLauncherParam, store: StoreParam):
        payload = {"input_key": "in/x.bin", "output_key": "out/x.bin"}
        return gpu_launcher.run(context, "selftest", payload, store).get_materialize_result()

    defs = dg.Definitions(assets=[staged], resources=resources_for_profile(get_profile()))
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process()
    assert result.success
    assert s3_store.read_bytes("out/x.bin") == b"54321"
    (mat,) = result.get_asset_materialization_events()
    assert mat.materialization.metadata["gpu_host"].value in ("gpu_a", "gpu_b")
    assert "GPU_NAME" in mat.materialization.metadata["env_names"].value


# ---------------------------------------------------------------- the engine of each profile


@pytest.mark.parametrize("profile, target", [("cluster", "embedded"), ("local", "/models/Qwen3.6-27B")])
def test_an_empty_fleet_says_how_to_start_an_engine(monkeypatch, profile, target):
    """Only the local profile with the embedded tiny target starts an engine by itself; elsewhere: how to start one."""
    from dflash_assets.embedded.defaults import embedded_default_target

    monkeypatch.setenv("DFLASH_PROFILE", profile)
    target_model = str(embedded_default_target()) if target == "embedded" else target
    with pytest.raises(dg.Failure) as info:
        EngineFleetResource(endpoints=[]).fleet_config(target_model=target_model)
    message = info.value.description
    assert "dflash engine --start" in message and f"--target {target_model}" in message
    assert "DFLASH_ENGINE_URLS=" in message and f"DFLASH_PROFILE={profile}" in message
    assert info.value.allow_retries is False  # nothing serves the target: no retry can help


def test_configured_endpoints_are_used_as_given(monkeypatch):
    monkeypatch.setenv("DFLASH_PROFILE", "local")
    fleet = EngineFleetResource(endpoints=["sglang:http://gpu-1:30000", "http://gpu-2:8000"], default_kind="openai",
                                max_concurrency=8).fleet_config(target_model="/models/Qwen3.6-27B")
    assert [(e.url, e.kind, e.max_concurrency) for e in fleet.endpoints] == [
        ("http://gpu-1:30000", "sglang", 8), ("http://gpu-2:8000", "openai", 8)]


@pytest.mark.slow
def test_local_profile_generates_on_an_embedded_engine_it_starts_and_stops(tmp_path, monkeypatch):
    """No engine configured, the embedded default: completions materializes; its engine is gone afterwards."""
    from tests.dagster_dev import process_tree

    from dagster_project.definitions import defs

    monkeypatch.setenv("DFLASH_PROFILE", "local")
    monkeypatch.delenv("DFLASH_ENGINE_URLS", raising=False)
    store = StoreResource(uri=str(tmp_path / "store"))
    resources = {**defs.resources, "store": deployment_resource(store),
                 "engines": deployment_resource(EngineFleetResource())}
    with dg.instance_for_test() as instance:
        ingest = {"ops": {"prompt_corpus": {"config": {"limit": 3, "max_prompts_per_shard": 3}}}}
        assert dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                              run_config=ingest).success
        [shard] = instance.get_dynamic_partitions("prompt_shards")
        generation = {"ops": {"completions": {"config": {"max_new_tokens": 64, "max_turns": 1}}}}
        result = dg.materialize(defs.assets, selection=["raw_prompts", "completions"], partition_key=shard,
                                instance=instance, resources=resources, run_config=generation)
        assert result.success
        messages = [e.user_message for e in instance.all_logs(result.run_id) if "embedded engine" in e.user_message]
    assert any(m.startswith("embedded engine ready at http://127.0.0.1:") for m in messages), messages
    assert any(m.startswith("embedded engine stopped") for m in messages), messages
    [mat] = result.asset_materializations_for_node("completions")
    assert mat.metadata["prompts_done"].value == 3 and mat.metadata["prompts_failed"].value == 0
    assert store.open().read_parquet(f"completions/{shard}.parquet").num_rows == 3
    leftovers = [cmd for cmd in process_tree(os.getpid()).values() if " serve " in cmd]
    assert leftovers == []


# ---------------------------------------------------------------- make ui: Ctrl-C

# deploy/local/ui.py SIGKILLs what is left 15 s after the stop request; a graceful stop took 5.6-6.5 s on the
# 2-core shared dev VM, with or without a run in flight. The limit leaves room for a loaded CI machine.
UI_STOP_LIMIT_S = 20.0


@pytest.mark.slow
def test_make_ui_stops_on_ctrl_c_with_a_run_in_flight(tmp_path):
    """``make ui`` in its own process group, a completions run starting its embedded engine, then SIGINT to the
    group (Ctrl-C): make, the launcher, dagster dev, webserver, daemon, code servers, run worker, step process and
    engine are all gone within UI_STOP_LIMIT_S, and the run was marked failed by its worker, not left started."""
    from tests.dagster_dev import DagsterDev, process_tree, still_running, wait_until_ready, write_prompt_source
    from tests.ports import free_port

    port, home = free_port(), tmp_path / "home"
    source = write_prompt_source(tmp_path / "prompts.jsonl", 4)
    env = {**os.environ, "PORT": str(port), "DAGSTER_HOME": str(home), "DFLASH_STORE": str(tmp_path / "store"),
           "DFLASH_PROMPT_SOURCE": str(source), "DFLASH_PROFILE": "local", "DFLASH_ENGINE_URLS": ""}
    log_path = tmp_path / "make-ui.log"
    with open(log_path, "wb") as log:  # -o: never reinstall here, run the ui recipe as it is
        make = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "ui-tiny"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    processes: dict = {}
    try:
        dev = DagsterDev(url=f"http://127.0.0.1:{port}", home=home, log_path=log_path, proc=make)
        wait_until_ready(dev, 300, required_daemons=("BACKFILL",))
        ingest = {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": 4}}}}
        assert dev.wait_for_run(dev.launch_run(["prompt_corpus"], ingest)) == "SUCCESS", dev.log_tail()
        [shard] = dev.instance().get_dynamic_partitions("prompt_shards")
        run_id = dev.launch_run(["raw_prompts", "completions"], tags={"dagster/partition": shard})
        deadline = time.monotonic() + 300
        while True:
            processes = process_tree(make.pid)
            if any(" serve " in cmd for cmd in processes.values()):
                break
            assert time.monotonic() < deadline, f"no engine started; log:\n{dev.log_tail()}"
            assert dev.run_status(run_id) not in ("SUCCESS", "FAILURE"), dev.log_tail()
            time.sleep(0.2)
        assert dev.run_status(run_id) == "STARTED"
        kinds = " ".join(processes.values())
        for part in ("deploy/local/ui.py", "dagster dev", "dagster_webserver", "dagster._daemon", "code-server",
                     "api grpc", "transformers serve"):
            assert part in kinds, f"{part!r} not among the processes of make ui:\n{kinds}"

        os.killpg(make.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        stopped_at = time.monotonic()
        while (left := still_running(processes)) and time.monotonic() - stopped_at < UI_STOP_LIMIT_S + 10:
            time.sleep(0.1)
        elapsed = time.monotonic() - stopped_at
    finally:
        for pid, _ in still_running(processes) or {}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    print(f"make ui: every one of {len(processes)} processes gone {elapsed:.1f} s after SIGINT")
    assert not left and elapsed <= UI_STOP_LIMIT_S, f"{elapsed:.1f} s, still running: {sorted(left.values())}"
    output = log_path.read_text(errors="replace")
    assert "No child processes" not in output
    assert re.search(r"ui: stopped, every process gone [0-9.]+ s after the SIGINT", output), output[-3000:]
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.FAILURE  # recorded, not left STARTED
    finally:
        instance.dispose()


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
    """One list of settings: every DFLASH_* variable the code reads is in deployment.SETTINGS and docs/deployment.md."""
    sources = [*(REPO / "dflash_assets").rglob("*.py"), *(REPO / "dagster_project").rglob("*.py")]
    read = set()
    for path in sources:
        read |= set(re.findall(r'(?:environ(?:\.get)?|_value|env_text)\(\s*"(DFLASH_[A-Z_]+)"', path.read_text()))
        read |= set(re.findall(r'EnvVar\("(DFLASH_[A-Z_]+)"\)', path.read_text()))
    assert {"DFLASH_STORE", "DFLASH_TARGET_MODEL", "DFLASH_ENGINE_URLS", "DFLASH_CACHE"} <= read  # the scan finds them
    assert read <= set(deployment.SETTINGS)
    readme = (REPO / "docs" / "deployment.md").read_text()
    assert [name for name in sorted(set(deployment.SETTINGS) | read) if f"| `{name}`" not in readme] == []


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
    gpu = gpu_launcher_for_profile(get_profile())
    assert gpu.hosts == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"] and gpu.env == {"HF_HOME": "/nvme/hf"}


def test_make_ui_serves_make_demos_target_unless_told_otherwise(monkeypatch, tmp_path):
    """After `make demo` (SmolLM2), `make ui` runs the code location on the same target and engine, so the demo's
    materializations are current there; a set DFLASH_TARGET_MODEL, another profile or --target tiny win."""
    import importlib.util

    from dflash_assets.embedded.smollm2 import smollm2_target_path

    spec = importlib.util.spec_from_file_location("local_ui", Path(__file__).parents[2] / "deploy/local/ui.py")
    ui = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ui)
    for name in ("DFLASH_PROFILE", "DFLASH_TARGET_MODEL", "DFLASH_ENGINE_URLS"):
        monkeypatch.delenv(name, raising=False)
    smollm2 = smollm2_target_path()
    assert ui.target_settings("smollm2") == {"DFLASH_TARGET_MODEL": str(smollm2), "DFLASH_TARGET_DTYPE": "float32",
                                            "DFLASH_ENGINE_URLS": f"transformers:inprocess://{smollm2.name}"}
    monkeypatch.setenv("DFLASH_ENGINE_URLS", "sglang:http://gpu-1:30000")  # a configured engine is kept
    assert "DFLASH_ENGINE_URLS" not in ui.target_settings("smollm2")
    assert ui.target_settings("tiny") == {}
    monkeypatch.setenv("DFLASH_TARGET_MODEL", str(tmp_path))
    assert ui.target_settings("smollm2") == {}
    monkeypatch.delenv("DFLASH_TARGET_MODEL")
    monkeypatch.setenv("DFLASH_PROFILE", "cluster")
    assert ui.target_settings("smollm2") == {}


def test_benchmark_prompt_files_are_read_by_the_settings_module(monkeypatch, tmp_path):
    import os

    from dagster_project.profile import benchmark_prompt_files

    monkeypatch.delenv("DFLASH_BENCHMARK_PROMPTS", raising=False)
    assert benchmark_prompt_files() == []
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    monkeypatch.setenv("DFLASH_BENCHMARK_PROMPTS", f"{a}{os.pathsep}{os.pathsep} {b}")
    assert benchmark_prompt_files() == [str(a), str(b)]  # empty entries dropped, blanks around a path too
