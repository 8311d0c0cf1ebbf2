"""`make test`'s two pytest-xdist workers: the tests that read the shared tiny demo run on one worker, so the
demo's session fixture is set up once per suite.

Runs pytest itself (two workers, ``--dist loadgroup``) on a throw-away test directory whose conftest uses this
suite's own collection hook, and counts the setups of a session fixture named like the demo's.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os, time, pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook under test)

@pytest.fixture(scope="session")
def tiny_demo():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)
'''

TESTS = '''
import time, pytest

@pytest.mark.parametrize("i", range(6))
def test_reader(tiny_demo, i):
    time.sleep(0.1)

@pytest.mark.parametrize("i", range(12))
def test_other(i):
    time.sleep(0.1)
'''


def test_the_tiny_demo_readers_share_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_readers.py").write_text(TESTS)
    setups = tmp_path / "setups"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "SETUPS": str(setups), "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "18 passed" in done.stdout
    assert len(setups.read_text().split()) == 1, "the demo's readers ran on both workers"
