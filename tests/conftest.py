"""Shared fixtures: a store in a temp dir, an S3 store on moto's server, tiny targets, the tiny demo's one run."""

from __future__ import annotations

import os

import pytest

from dflash_assets.store.backends import LocalStore, S3Store
from tests.ports import free_port

# The module that holds every test reading the session's tiny demo (tests/test_architecture.py checks it).
WHOLE_GRAPH_TESTS = "test_end_to_end.py"


def pytest_collection_modifyitems(config, items):
    """The order ``make test``'s pytest-xdist workers take modules in (``--dist loadfile --no-loadscope-reorder``:
    a module's tests on one worker, modules handed out in collection order): the tiny demo's readers first (the
    demo is the longest chain), then the modules with slow tests, then the rest, so the longest modules start
    early and the two workers end together. The order within a module is kept."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path.name != WHOLE_GRAPH_TESTS, item.path not in slow))


@pytest.fixture(autouse=True)
def prompt_sources_under_tmp(tmp_path_factory, monkeypatch):
    """The test session is the deployment: a run may ingest sources under pytest's temp dirs.

    ``tests/test_trust_boundaries.py`` removes this to show what a run may not read.
    """
    monkeypatch.setenv("DFLASH_PROMPT_SOURCE_ROOTS", str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def local_store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 HTTP endpoint (moto's ThreadedMotoServer) on 127.0.0.1."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_store(moto_endpoint, request) -> S3Store:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = "dflash-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    bucket = "".join(c if c.isalnum() or c == "-" else "-" for c in bucket)
    client.create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/root", client)


@pytest.fixture(scope="session")
def tiny_dense_target():
    from dflash_assets.embedded.tiny_targets import tiny_target_path

    return tiny_target_path("dense")


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory, moto_endpoint, tiny_dense_target):
    """``make demo`` of the tiny target on S3, run once per session (tests/demo_run.py): its readers need
    ``@pytest.mark.timeout(1700)``, since the first of them waits for the run."""
    from tests.demo_run import run_shared_demo

    return run_shared_demo(tmp_path_factory.mktemp("tiny-demo"), moto_endpoint,
                           str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def tiny_hybrid_target():
    from dflash_assets.embedded.tiny_targets import tiny_target_path

    return tiny_target_path("hybrid")
