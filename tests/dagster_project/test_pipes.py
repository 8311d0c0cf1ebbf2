"""GPU stages through Dagster Pipes: the launcher, the remote worker, S3 and local transports.

The remote side runs as a real process in a fresh environment (``env -i``,
its own HOME and working directory, only the ``dflash_assets`` package on its
path) and reaches the orchestrator only through the store: the moto S3 server
on 127.0.0.1. Its log lines, metadata and check results must show up in the
Dagster event log.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from dagster_project.pipes import (
    DEFAULT_FORWARD_ENV,
    HOST_TAG,
    GpuHostLauncher,
    GpuLauncherParam,
    build_launch,
    check_specs_for,
    is_secret_name,
    select_host,
)
from dagster_project.resources import StoreParam, StoreResource
from dflash_assets import pipes_worker
from dflash_assets.store.backends import open_store

REPO = Path(__file__).resolve().parents[2]
SHARDS = dg.StaticPartitionsDefinition(["shard-00000", "shard-00001"])
# Set by a shell or by Python itself (PEP 538 locale coercion), never by us.
SHELL_ENV = {"PWD", "OLDPWD", "SHLVL", "_", "LC_CTYPE"}


def _selftest_asset(payload_extra: dict | None = None):
    @dg.asset(partitions_def=SHARDS, check_specs=check_specs_for("selftest", "gpu_selftest"))
    def gpu_selftest(context: dg.AssetExecutionContext, gpu: GpuLauncherParam, store: StoreParam):
        key = context.partition_key
        payload = {"input_key": f"in/{key}.bin", "output_key": f"out/{key}.bin", **(payload_extra or {})}
        return gpu.run(context, "selftest", payload, store).get_materialize_result()

    return gpu_selftest


@pytest.fixture
def fresh_host(tmp_path):
    """A command prefix that starts the worker like a bare remote host: ``env -i ... sh -c``.

    PYTHONPATH holds only a link to ``dflash_assets`` (the package "installed"
    on the host); ``dagster_project`` and the orchestrator's cwd are not there.
    """
    site, home, cwd = tmp_path / "host-site", tmp_path / "host-home", tmp_path / "host-cwd"
    for d in (site, home, cwd):
        d.mkdir()
    (site / "dflash_assets").symlink_to(REPO / "dflash_assets")
    prefix = ["env", "-i", f"PATH={Path(sys.executable).parent}:/usr/bin:/bin", f"HOME={home}",
              f"PYTHONPATH={site}", "sh", "-c"]
    return {"prefix": prefix, "cwd": str(cwd), "allowed": {"PATH", "HOME", "PYTHONPATH"}}


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    "name, secret",
    [("AWS_SECRET_ACCESS_KEY", True), ("AWS_ACCESS_KEY_ID", True), ("AWS_SESSION_TOKEN", True),
     ("HF_TOKEN", True), ("DB_PASSWORD", True), ("OPENAI_API_KEY", True), ("DB_PASSWD", True), ("GITHUB_PAT", True),
     ("PG_DSN", True), ("AWS_ENDPOINT_URL", False), ("DFLASH_STORE", False), ("DAGSTER_PIPES_CONTEXT", False),
     ("PATH", False), ("KEYBOARD_LAYOUT", False)],
)
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


def test_ssh_launch_keeps_every_value_off_the_command_line():
    env = {"DFLASH_STORE": "s3://b/p q", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_ENDPOINT_URL": "http://h:9000",
           "DAGSTER_PIPES_CONTEXT": "eJyrVkrLz1eyUkpKLFKqBQAdegQ0"}
    spec = build_launch(stage="hidden_state_cache", remote_env=env, command_prefix=["ssh", "{host}"],
                        host="gpu-7", workdir="/srv/dflash it", python="/opt/venv/bin/python")
    assert spec.argv[0] == "ssh" and spec.argv[-2] == "gpu-7" and len(spec.argv) == 7  # + keepalive options
    assert not any(value in " ".join(spec.argv) + spec.display for value in env.values())
    assert json.loads(spec.stdin) == env  # every variable travels on stdin
    # the remote shell parses the string back into exactly the intended argv
    words = shlex.split(spec.argv[-1])
    assert words[:4] == ["cd", "/srv/dflash it", "&&", "exec"]
    assert words[4:] == ["/opt/venv/bin/python", "-m", "dflash_assets.pipes_worker", "hidden_state_cache",
                         "--message-interval", "5", "--env-stdin"]


def test_exec_style_and_local_launch():
    spec = build_launch(stage="drafter_eval", remote_env={"X": "1"}, remote_shell=False, workdir="/w",
                        command_prefix=["kubectl", "exec", "-i", "gpu-0", "--"])
    assert spec.argv == ["kubectl", "exec", "-i", "gpu-0", "--", "env", "-C", "/w", "python3", "-m",
                         "dflash_assets.pipes_worker", "drafter_eval", "--message-interval", "5", "--env-stdin"]
    assert json.loads(spec.stdin) == {"X": "1"}
    local = build_launch(stage="drafter_eval", remote_env={"AWS_SECRET_ACCESS_KEY": "k"})
    assert local.argv[0] == sys.executable and local.stdin is None
    assert local.env["AWS_SECRET_ACCESS_KEY"] == "k" and "PATH" in local.env  # local: inherits the environment
    with pytest.raises(ValueError, match="no hosts"):
        build_launch(stage="s", remote_env={}, command_prefix=["ssh", "{host}"])


def test_host_selection_is_stable_and_pinnable():
    hosts = ["gpu-1", "gpu-2", "gpu-3"]
    picks = {k: select_host(hosts, [k], None, "run") for k in (f"shard-{i:05d}" for i in range(30))}
    assert set(picks.values()) == set(hosts)  # spreads
    assert all(select_host(hosts, [k], None, "other-run") == h for k, h in picks.items())  # stable
    assert select_host(hosts, ["shard-00000"], "gpu-2", "run") == "gpu-2"
    first = picks["shard-00000"]
    others = select_host(hosts, ["shard-00000"], None, "run", busy={first})
    assert others != first and others in hosts  # a busy host is skipped while another is free
    assert select_host(hosts, ["shard-00000"], None, "run", busy=set(hosts)) == first  # all busy: queue there
    with pytest.raises(ValueError, match=HOST_TAG):
        select_host(hosts, [], "gpu-9", "run")
    assert select_host([], ["x"], None, "run") is None


def test_stages_are_imported_functions_and_unknown_stages_fail_clearly():
    import inspect

    for name in ("hidden_state_cache", "drafter_checkpoint", "drafter_eval"):
        fn = pipes_worker.resolve_stage(name)
        assert callable(fn) and "import" in inspect.getsource(fn)  # an import an editor can follow, not a string
    with pytest.raises(KeyError, match="unknown stage"):
        pipes_worker.resolve_stage("no_such_stage")


def test_stage_metadata_becomes_pipes_metadata():
    import numpy as np

    meta = pipes_worker._pipes_metadata({"n": np.int64(7), "tau": np.float32(2.5), "ok": True, "skip": None,
                                         "counts": {"a": 1}, "table": "| a |\n| - |", "name": "x"})
    assert meta == {"n": 7, "tau": 2.5, "ok": True, "counts": {"raw_value": {"a": 1}, "type": "json"},
                    "table": {"raw_value": "| a |\n| - |", "type": "md"}, "name": "x"}
    assert type(meta["n"]) is int


def test_worker_refuses_to_run_outside_pipes():
    proc = subprocess.run([sys.executable, "-m", "dflash_assets.pipes_worker", "selftest"], cwd=REPO,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2 and "DAGSTER_PIPES_CONTEXT" in proc.stderr


# ---------------------------------------------------------------- end to end


def _logs(instance, run_id) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if e.user_message]


def test_s3_stage_on_a_fresh_host(s3_store, moto_endpoint, fresh_host, monkeypatch):
    monkeypatch.setenv("DFLASH_LEAK_MARKER", "must-not-reach-the-host")
    s3_store.write_bytes("in/shard-00001.bin", b"hidden states!")
    store = StoreResource(uri=s3_store.uri, endpoint_url=moto_endpoint, region_name="us-east-1")
    gpu = GpuHostLauncher(command_prefix=fresh_host["prefix"], python=sys.executable, workdir=fresh_host["cwd"],
                          poll_interval_s=0)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([_selftest_asset()], partition_key="shard-00001", instance=instance,
                            resources={"gpu": gpu, "store": store})
    assert result.success

    # the work happened on the "host", through the store only
    assert s3_store.read_bytes("out/shard-00001.bin") == b"!setats neddih"
    assert s3_store.list("_pipes") == []  # session objects cleaned up

    (mat,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in mat.materialization.metadata.items()}
    assert mat.materialization.partition == "shard-00001"
    assert meta["bytes"] == 14 and meta["cwd"] == fresh_host["cwd"] and meta["gpu_host"] == "localhost"
    assert meta["partition_keys"] == ["shard-00001"] and meta["imports_dagster"] is False
    names = set(meta["env_names"]) - SHELL_ENV
    assert "DFLASH_LEAK_MARKER" not in names
    forwarded = {n for n in DEFAULT_FORWARD_ENV if n in os.environ}  # AWS_* credentials from the moto fixture
    assert names - fresh_host["allowed"] == forwarded | {
        "DFLASH_STORE", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES",
    }
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names

    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "selftest_roundtrip" and check.passed
    assert check.metadata["sha256"].value == meta["sha256"]

    logs = _logs(instance, result.run_id)
    assert any("selftest: read 14 bytes from in/shard-00001.bin (partition shard-00001)" in m for m in logs)
    assert any("selftest: wrote 14 bytes" in m for m in logs)
    assert not any("testing" in m and "AWS_SECRET" in m for m in logs)  # credentials are never logged


def test_remote_failure_surfaces_in_dagster(s3_store, moto_endpoint, fresh_host):
    s3_store.write_bytes("in/shard-00000.bin", b"x")
    store = StoreResource(uri=s3_store.uri, endpoint_url=moto_endpoint, region_name="us-east-1")
    gpu = GpuHostLauncher(command_prefix=fresh_host["prefix"], python=sys.executable, poll_interval_s=0)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([_selftest_asset({"fail": "boom"})], partition_key="shard-00000", instance=instance,
                            resources={"gpu": gpu, "store": store}, raise_on_error=False)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    assert "exited with code 1" in failure.step_failure_data.error.message
    assert "selftest asked to fail: boom" in failure.step_failure_data.error.message
    assert any("closed with exception" in m for m in _logs(instance, result.run_id))
    assert not s3_store.exists("out/shard-00000.bin")


def test_local_store_local_subprocess(tmp_path):
    """The embedded default: a local store, the worker as a plain subprocess, file transport."""
    root = tmp_path / "store"
    open_store(str(root)).write_bytes("in/shard-00000.bin", b"abc")
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([_selftest_asset()], partition_key="shard-00000", instance=instance,
                            resources={"gpu": GpuHostLauncher(), "store": StoreResource(uri=str(root))})
    assert result.success
    assert (root / "out/shard-00000.bin").read_bytes() == b"cba"
    assert not (root / "_pipes").exists()
    (check,) = result.get_asset_check_evaluations()
    assert check.passed
    assert any("selftest: wrote 3 bytes" in m for m in _logs(instance, result.run_id))


def test_launcher_picks_a_free_host_and_tags_the_run(tmp_path):
    """Two hosts, one held by a running run: the stage goes to the other, and the run is tagged with it."""
    root = tmp_path / "store"
    open_store(str(root)).write_bytes("in/shard-00000.bin", b"abc")
    gpu = GpuHostLauncher(command_prefix=["env", "DFLASH_TEST_HOST={host}", "sh", "-c"], hosts=["gpu_a", "gpu_b"],
                          python=sys.executable, env={"PYTHONPATH": str(REPO)})
    instance = dg.DagsterInstance.ephemeral()
    natural = select_host(gpu.hosts, ["shard-00000"], None, "")
    instance.add_run(dg.DagsterRun(job_name="other", run_id="f" * 36, status=dg.DagsterRunStatus.STARTED,
                                   tags={HOST_TAG: natural}))
    result = dg.materialize([_selftest_asset()], partition_key="shard-00000", instance=instance,
                            resources={"gpu": gpu, "store": StoreResource(uri=str(root))})
    assert result.success
    (mat,) = result.get_asset_materialization_events()
    chosen = mat.materialization.metadata["gpu_host"].value
    assert chosen in gpu.hosts and chosen != natural
    assert instance.get_run_by_id(result.run_id).tags[HOST_TAG] == chosen
    assert "DFLASH_TEST_HOST" in mat.materialization.metadata["env_names"].value
