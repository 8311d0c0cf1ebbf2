"""The `dagster dev` harness (tests/dagster_dev.py) that the UI and daemon tests run: its stop warns about a group
that ignores SIGINT, with the end of its log, then ends it at once by SIGTERM (its reaped leader no longer holds
the wait open); and what it starts gets the default SIGINT whatever the shell that started pytest ignored."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.dagster_dev import _stop_group, with_default_signals

# SIGTERM made the default and unblocked in the child: the test is about the stop, not about what pytest's
# process inherited
IGNORES_SIGINT = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.pthread_sigmask(signal.SIG_UNBLOCK, "
                  "{signal.SIGTERM}); print('ready', flush=True); time.sleep(60)")


def test_a_group_deaf_to_sigint_is_warned_about_and_terminated_without_waiting(tmp_path):
    log = tmp_path / "dagster-dev.log"
    log.write_text("starting\nthe last line of the log\n")
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_SIGINT], start_new_session=True, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"  # its SIGINT handler is set
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"still running 1 s after SIGINT(.|\n)*the last line of the log"):
        _stop_group(proc, log, grace_s=1.0)
    assert proc.returncode == -15  # SIGTERM
    assert time.monotonic() - t0 < 3.0  # not the 5 s a zombie leader would keep the group "alive" for


def test_what_the_harness_starts_gets_the_default_sigint(tmp_path):
    """A shell's background job ignores SIGINT, and a Python started with SIGINT ignored keeps ignoring it: dagster
    dev then never stops on the harness's SIGINT. The harness starts it with the default SIGINT."""
    import signal

    report = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `cmd &` in a non-interactive shell
    try:
        plain = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True)
        reset = subprocess.run(with_default_signals([sys.executable, "-c", report]), capture_output=True, text=True,
                               check=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert plain.stdout.strip() == "False" and reset.stdout.strip() == "True"
