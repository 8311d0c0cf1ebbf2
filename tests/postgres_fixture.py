"""A real PostgreSQL server for tests, from Debian's ``postgresql`` package, on 127.0.0.1.

``running_postgres()`` runs ``initdb`` into a fresh directory under the system
temp dir, starts the server with ``pg_ctl`` on a free port (TCP on 127.0.0.1
only, its Unix socket inside that directory), creates a database owned by a
password-protected role, and on exit stops the server and removes the
directory. PostgreSQL refuses to run as root, so when the tests run as root
(CI does) every server command runs through ``runuser`` as the ``postgres``
user the package creates (``nobody`` if it is missing), in a directory that
user owns. Durability is switched off (fsync, synchronous_commit): test data.

Needs ``apt-get install -y postgresql`` (binaries in /usr/lib/postgresql/N/bin;
``$PG_BIN`` overrides) and psycopg2 (dagster-postgres depends on it).
Use the ``postgres_server`` fixture: ``from postgres_fixture import postgres_server``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.ports import free_port

__all__ = ["PostgresServer", "find_pg_bin", "running_postgres", "postgres_server"]


def find_pg_bin() -> Path:
    """The directory holding initdb/pg_ctl: ``$PG_BIN``, the newest /usr/lib/postgresql/*/bin, or PATH."""
    candidates = [os.environ.get("PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True)
    if initdb := shutil.which("initdb"):
        candidates.append(str(Path(initdb).parent))
    for cand in candidates:
        if cand and (Path(cand) / "initdb").exists() and (Path(cand) / "pg_ctl").exists():
            return Path(cand)
    raise RuntimeError("PostgreSQL server binaries not found (initdb, pg_ctl): apt-get install -y postgresql")


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str
    db_name: str
    base_dir: Path
    os_user: str | None  # the account the server runs as, when started by root

    @property
    def url(self) -> str:
        return f"postgresql://{quote(self.user)}:{quote(self.password, safe='')}@{self.host}:{self.port}/{self.db_name}"

    def env(self) -> dict[str, str]:
        """The DAGSTER_PG_* variables of deploy/cluster/dagster.yaml."""
        return {"DAGSTER_PG_HOST": self.host, "DAGSTER_PG_PORT": str(self.port), "DAGSTER_PG_USER": self.user,
                "DAGSTER_PG_PASSWORD": self.password, "DAGSTER_PG_DB": self.db_name}

    def connect(self, db_name: str | None = None):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                                dbname=db_name or self.db_name, connect_timeout=10)


def _server_account() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no 'postgres' or 'nobody' account to run PostgreSQL as")


def _run(account: str | None, cmd: list[str], timeout: float = 120) -> None:
    argv = ["runuser", "-u", account, "--", *cmd] if account else cmd
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


@contextlib.contextmanager
def running_postgres(user: str = "dflash", password: str = "p@ss w/rd:1", db_name: str = "dagster") -> Iterator[PostgresServer]:
    """Start a throwaway server; yield its address; stop it and delete its files afterwards."""
    pg_bin = find_pg_bin()
    account = _server_account()
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))  # under /tmp: the server account can reach it
    data, log, pwfile = base / "data", base / "server.log", base / "pwfile"
    started = False
    try:
        pwfile.write_text(password + "\n")
        if account:
            entry = pwd.getpwnam(account)
            for path in (base, pwfile):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        _run(account, [str(pg_bin / "initdb"), "-D", str(data), "-U", user, f"--pwfile={pwfile}",
                       "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync"])
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            port = free_port()
            opts = (f"-h 127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off "
                    "-c full_page_writes=off -c max_connections=60")
            try:
                _run(account, [str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o", opts, "start"])
                started = True
                break
            except RuntimeError:
                if attempt == 2:
                    raise RuntimeError(f"PostgreSQL did not start:\n{log.read_text() if log.exists() else ''}") from None
        server = PostgresServer("127.0.0.1", port, user, password, db_name, base, account)
        conn = server.connect("postgres")  # over TCP, with the password: the path Dagster takes
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{db_name}"')
        conn.close()
        yield server
    finally:
        if started:
            with contextlib.suppress(Exception):
                _run(account, [str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"])
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server
