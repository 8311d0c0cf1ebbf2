"""`make demo` of the tiny target, run once per test session: the tests of the whole graph read its results.

``run_demo_command`` runs ``python -m dagster_project.demo`` as a user does (a fresh Dagster home, the real command,
its console and exit status). ``run_shared_demo`` runs it once on the tiny target (``--target tiny``: the thinking
format, ``transformers serve`` on 127.0.0.1, the demo's own sizes) with its store on S3 (moto's server on
127.0.0.1, ``DFLASH_STORE=s3://...`` and ``AWS_ENDPOINT_URL``, as a cluster sets them): every stage, the GPU
stages' Pipes subprocesses included, reaches the data only through S3. Its training states go to its own
directory (``DFLASH_DRAFTER_WORK_DIR``), so the drafter trains from scratch, preflight included, however warm
``DFLASH_CACHE`` is. ``DemoRun`` gives the tests its console,
its Dagster instance (the home's SQLite instance, read only) and its store; a test reads them and writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_BUCKET = "dflash-demo"
SHARED_STORE = f"s3://{SHARED_BUCKET}/run"


def run_demo_command(home: Path, *args: str, timeout: int = 1500,
                     env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m dagster_project.demo --home HOME ARGS`` in a fresh environment: no ``DAGSTER_HOME`` or
    ``DFLASH_STORE`` of the caller's unless ``env_extra`` sets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "DFLASH_STORE")} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "dagster_project.demo", "--home", str(home), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@dataclass(frozen=True)
class DemoRun:
    """One finished ``python -m dagster_project.demo --target tiny`` on S3: what the tests read."""

    home: Path
    done: subprocess.CompletedProcess
    store_uri: str
    endpoint: str

    @property
    def stdout(self) -> str:
        return self.done.stdout

    @property
    def console(self) -> str:
        return self.done.stdout + self.done.stderr

    @contextlib.contextmanager
    def instance(self) -> Iterator:
        """The Dagster instance the demo wrote (its home's SQLite storage)."""
        import dagster as dg

        with dg.DagsterInstance.from_ref(dg._core.instance.ref.InstanceRef.from_dir(str(self.home))) as instance:
            yield instance

    def store(self):
        """The demo's S3 store, on moto's server."""
        import boto3

        from dflash_assets.store.backends import S3Store

        return S3Store(self.store_uri, boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1"))


def run_shared_demo(root: Path, endpoint: str, prompt_source_roots: str) -> DemoRun:
    """The tiny demo on S3 in a fresh home under ``root``, whatever its exit status (the tests assert it); its
    console is also kept in ``root/console.txt``."""
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=SHARED_BUCKET)
    home = root / "home"
    done = run_demo_command(home, "--target", "tiny", env_extra={
        "DFLASH_STORE": SHARED_STORE, "AWS_ENDPOINT_URL": endpoint, "DFLASH_PROMPT_SOURCE_ROOTS": prompt_source_roots,
        "DFLASH_DRAFTER_WORK_DIR": str(root / "train")})
    (root / "console.txt").write_text(f"exit status {done.returncode}\n{done.stdout}{done.stderr}")  # for a reader
    return DemoRun(home=home, done=done, store_uri=SHARED_STORE, endpoint=endpoint)
