"""What a run may change: deployment resources are not run config, a run's paths and
sampling stay within limits, and no value of the stage's environment reaches a command line or the event log.

Each test mounts an attack that would work if a resource were a ``ConfigurableResource`` the launchpad could
override (a run with ``command_prefix: ["sh", "-c", "id > file"]`` would run as the orchestrator's user) or if
variables without a secret-looking name went on the ssh command line.
"""

import json
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from dagster_project.config import GenerationStageConfig, HiddenStateCacheConfig, IngestConfig, SourceNotAllowed
from dagster_project.pipes import GpuHostLauncher, GpuLauncherParam, build_launch, check_specs_for, with_ssh_keepalive
from dagster_project.resources import StoreParam, StoreResource, deployment_resource
from dflash_assets.store.backends import open_store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def defs(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_PROFILE", "local")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    from dagster_project.definitions import defs

    return defs


# ---------------------------------------------------------------- item 1: run config cannot set deployment resources


ATTEMPTS = {
    "gpu_launcher": {"command_prefix": ["sh", "-c", "id > {marker}"], "python": "/bin/sh"},
    "store": {"uri": "s3://attacker-bucket/loot", "endpoint_url": "http://attacker.example:9000"},
    "engines": {"endpoints": ["openai:http://attacker.example:8000"]},
    "target": {"chat_template_path": "/etc/passwd", "model_path": "/root"},
}


@pytest.mark.parametrize("resource", sorted(ATTEMPTS))
def test_run_config_cannot_set_a_deployment_resource(defs, tmp_path, resource):
    marker = tmp_path / "pwned"
    config = {k: ([part.replace("{marker}", str(marker)) for part in v] if isinstance(v, list) else v)
              for k, v in ATTEMPTS[resource].items()}
    job = defs.resolve_implicit_global_asset_job_def()
    with pytest.raises(dg.DagsterInvalidConfigError) as info:
        job.execute_in_process(run_config={"resources": {resource: {"config": config}}},
                               instance=dg.DagsterInstance.ephemeral())
    assert f"root:resources:{resource}:config" in str(info.value)
    assert "unexpected config entr" in str(info.value)
    assert not marker.exists()


def test_every_resource_of_the_definitions_is_bound_as_a_deployment_setting(defs):
    for name, resource in defs.resources.items():
        assert isinstance(resource, dg.ResourceDefinition), name
        assert "not by run config" in (resource.description or ""), name
        assert resource.config_schema.as_field().config_type.fields == {}, name


def test_a_deployment_resource_is_frozen():
    launcher = GpuHostLauncher()
    with pytest.raises(Exception, match="frozen"):
        launcher.command_prefix = ["sh", "-c"]
    with pytest.raises(TypeError, match="DeploymentResource"):
        deployment_resource({"uri": "/tmp"})


def test_a_run_ingests_only_sources_the_deployment_allows(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_PROMPT_SOURCE", raising=False)
    monkeypatch.delenv("DFLASH_PROMPT_SOURCE_ROOTS", raising=False)
    from dflash_assets.prompts.sources import embedded_sharegpt_path

    assert IngestConfig().resolved_source() == str(embedded_sharegpt_path())
    for hostile in ("/etc/passwd", str(tmp_path / "secrets.jsonl"), "s3://other-team/private.jsonl"):
        with pytest.raises(SourceNotAllowed, match="DFLASH_PROMPT_SOURCE_ROOTS"):
            IngestConfig(source_uri=hostile).resolved_source()

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    monkeypatch.setenv("DFLASH_PROMPT_SOURCE_ROOTS", f"{corpora},s3://prompts/shared")
    assert IngestConfig(source_uri=str(corpora / "a.jsonl")).resolved_source() == str(corpora / "a.jsonl")
    assert IngestConfig(source_uri="s3://prompts/shared/b.jsonl").resolved_source() == "s3://prompts/shared/b.jsonl"
    for escape in (str(corpora / ".." / "secrets.jsonl"), str(corpora) + "-evil/x.jsonl", "s3://prompts/shared-x/b"):
        with pytest.raises(SourceNotAllowed):
            IngestConfig(source_uri=escape).resolved_source()


def test_prompt_corpus_refuses_a_hostile_source_before_reading_it(defs, tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_PROMPT_SOURCE_ROOTS", raising=False)
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"conversations": [{"from": "human", "value": "the orchestrator's secret"}]}) + "\n")
    store = StoreResource(uri=str(tmp_path / "store"))
    result = dg.materialize(defs.assets, selection=["prompt_corpus"], instance=dg.DagsterInstance.ephemeral(),
                            resources={**defs.resources, "store": deployment_resource(store)},
                            run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(secret)}}}},
                            raise_on_error=False)
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data
    assert "not a source this deployment allows" in failure.user_failure_data.description
    assert store.open().list("") == []  # nothing was ingested


@pytest.mark.parametrize("field, value", [("temperature", 50.0), ("top_p", 0.0), ("max_new_tokens", 10**9),
                                          ("max_turns", 0)])
def test_sampling_stays_within_limits(field, value):
    with pytest.raises(Exception, match=field):
        GenerationStageConfig(**{field: value})


def test_gpu_host_paths_are_not_run_config():
    assert "scratch_dir" not in HiddenStateCacheConfig.model_fields
    with pytest.raises(Exception, match="device"):
        HiddenStateCacheConfig(devices=["cuda:0; rm -rf /"])


# ---------------------------------------------------------------- item 5: secrets and hung stages

STAGE_ENV = {
    "OPENAI_API_KEY": "sk-live-111", "DB_PASSWD": "hunter2", "GITHUB_PAT": "ghp_222",
    "DATABASE_URL": "postgresql://dagster:pw333@pg:5432/dagster", "PLAIN_LOOKING": "value444",
    "DFLASH_STORE": "s3://bucket/prefix", "PYTHONPATH": "/opt/site",
}


@pytest.mark.parametrize("remote_shell", [True, False])
def test_no_value_reaches_the_remote_command_line(remote_shell):
    spec = build_launch(stage="hidden_state_cache", remote_env=STAGE_ENV, command_prefix=["ssh", "{host}"],
                        remote_shell=remote_shell, host="gpu-1")
    visible = " ".join(spec.argv) + spec.display
    leaked = [v for k, v in STAGE_ENV.items() if k != "PYTHONPATH" and v in visible]
    assert leaked == []
    assert json.loads(spec.stdin) == {k: v for k, v in STAGE_ENV.items() if k != "PYTHONPATH"}
    assert "PYTHONPATH=/opt/site" in visible  # needed before Python starts, and no secret
    assert set(spec.env_names) == set(STAGE_ENV)


def test_ssh_gets_keepalives_unless_it_sets_its_own():
    assert with_ssh_keepalive(["ssh", "-o", "BatchMode=yes", "{host}"])[:5] == [
        "ssh", "-o", "ServerAliveInterval=30", "-o", "ServerAliveCountMax=4"]
    own = ["/usr/bin/ssh", "-o", "ServerAliveInterval=5", "{host}"]
    assert with_ssh_keepalive(own) == own
    assert with_ssh_keepalive(["kubectl", "exec", "-i", "{host}", "--"]) == ["kubectl", "exec", "-i", "{host}", "--"]
    spec = build_launch(stage="s", remote_env={}, command_prefix=["ssh", "{host}"], host="gpu-2")
    assert spec.argv[:5] == ["ssh", "-o", "ServerAliveInterval=30", "-o", "ServerAliveCountMax=4"]


SHARDS = dg.StaticPartitionsDefinition(["shard-00000"])


def _selftest(payload: dict):
    @dg.asset(partitions_def=SHARDS, check_specs=check_specs_for("selftest", "gpu_selftest"))
    def gpu_selftest(context: dg.AssetExecutionContext, gpu: GpuLauncherParam, store: StoreParam):
        return gpu.run(context, "selftest", {"input_key": "in.bin", "output_key": "out.bin", **payload},
                       store).get_materialize_result()

    return gpu_selftest


def test_the_event_log_names_the_stage_environment_but_holds_no_value(tmp_path, monkeypatch):
    root = tmp_path / "store"
    open_store(str(root)).write_bytes("in.bin", b"abc")
    for name, value in STAGE_ENV.items():
        if name != "PYTHONPATH":
            monkeypatch.setenv(name, value)
    # a remote-style launch: `sh -c` stands in for ssh; every variable travels on stdin
    gpu = GpuHostLauncher(command_prefix=["sh", "-c"], python=sys.executable, forward_env=sorted(STAGE_ENV),
                          env={"PYTHONPATH": str(REPO)})
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([_selftest({})], partition_key="shard-00000", instance=instance,
                            resources={"gpu": deployment_resource(gpu),
                                       "store": deployment_resource(StoreResource(uri=str(root)))})
    assert result.success
    (mat,) = result.get_asset_materialization_events()
    assert set(STAGE_ENV) - {"DFLASH_STORE"} <= set(mat.materialization.metadata["env_names"].value)  # arrived
    events = "\n".join(repr(e) for e in instance.all_logs(result.run_id))
    leaked = [v for k, v in STAGE_ENV.items() if k not in ("PYTHONPATH", "DFLASH_STORE") and v in events]
    assert leaked == []
    names_line = next(e.user_message for e in instance.all_logs(result.run_id)
                      if "names only" in (e.user_message or ""))
    assert "OPENAI_API_KEY" in names_line and "sk-live" not in names_line


def test_a_hung_stage_is_stopped_by_its_timeout(tmp_path):
    root = tmp_path / "store"
    open_store(str(root)).write_bytes("in.bin", b"abc")
    gpu = GpuHostLauncher(timeout_s=3)
    start = time.monotonic()
    result = dg.materialize([_selftest({"hang_s": 600})], partition_key="shard-00000",
                            instance=dg.DagsterInstance.ephemeral(),
                            resources={"gpu": deployment_resource(gpu),
                                       "store": deployment_resource(StoreResource(uri=str(root)))},
                            raise_on_error=False)
    assert not result.success
    assert "timed out after 3s" in result.get_step_failure_events()[0].step_failure_data.error.message
    assert time.monotonic() - start < 120  # not the 600 s the stage asked for


def test_ingest_runs_one_at_a_time(defs):
    """Item 3, Dagster's side: prompt_corpus holds the 'ingest' pool, whose limit is 1 in both shipped instances."""
    from dagster_project.instance_config import instance_yaml

    assert defs.get_assets_def("prompt_corpus").op.pool == "ingest"
    for profile in ("local", "cluster"):
        assert "default_limit: 1" in instance_yaml(profile)


def test_engine_api_key_comes_from_the_environment_or_a_file_and_is_never_shown(monkeypatch, tmp_path):
    """Item 4's API key, wired through the profile: the fleet gets it, reprs and metadata never show it."""
    from dagster_project.deployment import DeploymentConfigError, engines_for_profile

    monkeypatch.setenv("DFLASH_ENGINE_URLS", "sglang:http://127.0.0.1:9")
    monkeypatch.setenv("DFLASH_ENGINE_API_KEY", "sk-engine-555")
    engines = engines_for_profile("local")
    fleet = engines.fleet_config(target_model="/models/t")
    assert fleet.api_key.get_secret_value() == "sk-engine-555"
    assert "sk-engine-555" not in repr(engines) + repr(fleet) + str(fleet.model_dump())

    monkeypatch.delenv("DFLASH_ENGINE_API_KEY")
    secret = tmp_path / "engine.key"
    secret.write_text("sk-from-file-666\n")
    monkeypatch.setenv("DFLASH_ENGINE_API_KEY_FILE", str(secret))
    assert engines_for_profile("local").fleet_config(target_model="t").api_key.get_secret_value() == "sk-from-file-666"
    monkeypatch.setenv("DFLASH_ENGINE_API_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(DeploymentConfigError, match="DFLASH_ENGINE_API_KEY_FILE"):
        engines_for_profile("local")


def test_each_endpoint_can_have_its_own_api_key_named_in_the_environment(monkeypatch, tmp_path):
    """Item 4's key per endpoint, through the profile: DFLASH_ENGINE_API_KEYS maps an endpoint URL to the variable
    or file holding its key; others get the fleet-wide key. A wrong key is refused naming the endpoint, not a key."""
    from dagster_project.deployment import DeploymentConfigError, engines_for_profile
    from dflash_assets.generation.fleet import probe_fleet
    from tests.support.sglang_loopback import LoopbackServer

    target = "/models/Qwen3.6-27B"
    keys = {"a": "sk-engine-a-777", "b": "sk-engine-b-888", "fleet": "sk-fleet-wide-999"}
    key_file = tmp_path / "b.key"
    key_file.write_text(keys["b"] + "\n")
    monkeypatch.setenv("ENGINE_A_KEY", keys["a"])
    monkeypatch.setenv("DFLASH_ENGINE_API_KEY", keys["fleet"])
    with LoopbackServer(model_path=target, api_key=keys["a"]) as a, \
            LoopbackServer(model_path=target, api_key=keys["b"]) as b, \
            LoopbackServer(model_path=target, api_key=keys["fleet"]) as c:
        monkeypatch.setenv("DFLASH_ENGINE_URLS", f"openai:{a.url},{b.url}/ openai:{c.url}")
        monkeypatch.setenv("DFLASH_ENGINE_API_KEYS", f"{a.url}=ENGINE_A_KEY openai:{b.url}={key_file}")
        engines = engines_for_profile("local")
        fleet = engines.fleet_config(target_model=target)
        probe = probe_fleet(fleet)
        assert [r.status for r in probe.rows] == ["ok", "ok", "ok"], probe.markdown()
        assert a.stats.unauthorized == b.stats.unauthorized == c.stats.unauthorized == 0

        key_file.write_text("sk-wrong-000\n")  # endpoint b's key file now holds a wrong key
        refused = probe_fleet(engines_for_profile("local").fleet_config(target_model=target))
        assert [r.status == "ok" for r in refused.rows] == [True, False, True]
        assert refused.rows[1].endpoint.rstrip("/") == b.url and "HTTP 401" in refused.rows[1].detail
        assert b.url in refused.markdown() and b.stats.unauthorized > 0

    shown = [repr(engines), str(engines.model_dump()), repr(fleet), fleet.model_dump_json(), probe.markdown(),
             refused.markdown(), str(refused.records())]
    for key in [*keys.values(), "sk-wrong-000"]:
        assert not any(key in text for text in shown), key

    # a named variable that is unset, a URL that is no endpoint, or a key pasted in place of a name: errors now,
    # naming the endpoint or the variable, never the value
    monkeypatch.delenv("ENGINE_A_KEY")
    with pytest.raises(DeploymentConfigError, match=f"{a.url}.*ENGINE_A_KEY.*not set"):
        engines_for_profile("local")
    monkeypatch.setenv("DFLASH_ENGINE_API_KEYS", "http://elsewhere:1=ENGINE_A_KEY")
    with pytest.raises(DeploymentConfigError, match="elsewhere:1, which is not in DFLASH_ENGINE_URLS"):
        engines_for_profile("local")
    monkeypatch.setenv("DFLASH_ENGINE_API_KEYS", f"{a.url}=sk-pasted-key-123")
    with pytest.raises(DeploymentConfigError, match="not the token itself") as info:
        engines_for_profile("local")
    assert "sk-pasted-key-123" not in str(info.value)


def test_the_target_is_set_by_the_environment(monkeypatch, tmp_path):
    """The target comes from DFLASH_TARGET_* where the code location runs, not from the launchpad."""
    from dagster_project.deployment import DeploymentConfigError, target_for_profile

    template = tmp_path / "chat.jinja"
    monkeypatch.setenv("DFLASH_TARGET_MODEL", "/models/Qwen3.6-27B")
    monkeypatch.setenv("DFLASH_TARGET_CHAT_TEMPLATE", str(template))
    monkeypatch.setenv("DFLASH_TARGET_LAYER_IDS", "1, 16,31")
    monkeypatch.setenv("DFLASH_TARGET_MASK_TOKEN_ID", "248070")
    monkeypatch.setenv("DFLASH_TARGET_THINKING", "0")
    target = target_for_profile("local")
    assert (target.model_path, target.chat_template_path, target.target_layer_ids, target.mask_token_id,
            target.enable_thinking, target.num_target_layers, target.mask_token) == (
        "/models/Qwen3.6-27B", str(template), [1, 16, 31], 248070, False, 5, "<|MASK|>")
    monkeypatch.setenv("DFLASH_TARGET_LAYER_IDS", "1,x")
    with pytest.raises(DeploymentConfigError, match="DFLASH_TARGET_LAYER_IDS"):
        target_for_profile("local")
