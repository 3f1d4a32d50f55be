"""A local certificate authority for the secured local stack (``pipeline infra up
--secure``, the secure test): its certificate, one server certificate for the brokers
and PostgreSQL (for the addresses they listen on), and client certificates for mutual
TLS. Made once with the ``openssl`` command, under ``home``; kept thereafter.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "3650"


@dataclass(frozen=True)
class Authority:
    home: Path

    @property
    def ca(self) -> Path:
        return self.home / "ca.pem"

    def cert(self, name: str) -> Path:
        return self.home / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.home / f"{name}.key"

    def write_client_files(self, folder: Path, user: str, password: str,
                           comment: str = "") -> tuple[Path, Path]:
        """Kafka client settings for the secured listeners, readable by their owner only:
        ``client.properties`` (SASL_SSL, SCRAM-SHA-512 as ``user``) and
        ``client-mtls.properties`` (``user``'s client certificate)."""
        sasl, mtls = folder / "client.properties", folder / "client-mtls.properties"
        sasl.write_text(f"{comment}security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n"
                        f"sasl.username={user}\nsasl.password={password}\n"
                        f"ssl.ca.location={self.ca}\n")
        mtls.write_text(f"{comment}security.protocol=SSL\nssl.ca.location={self.ca}\n"
                        f"ssl.certificate.location={self.cert(user)}\n"
                        f"ssl.key.location={self.key(user)}\n")
        for path in (sasl, mtls):
            path.chmod(0o600)
        return sasl, mtls

    def keystore(self, name: str) -> Path:
        """The PKCS#12 keystore (key and chain) of ``name``, for the JVM."""
        return self.home / f"{name}.p12"

    @property
    def keystore_password(self) -> str:
        return (self.home / "keystore.password").read_text().strip()

    def ensure(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
               clients: tuple[str, ...] = ("pipeline",)) -> Authority:
        """The authority, the ``server`` certificate for ``hosts`` and one client
        certificate per name in ``clients`` (its common name), made if missing."""
        if shutil.which("openssl") is None:
            raise RuntimeError("the openssl command is needed to make the local certificates")
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o700)
        if not self.ca.exists():
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                     "-nodes", "-keyout", str(self.key("ca")), "-out", str(self.ca),
                     "-days", DAYS, "-subj", "/CN=pipeline local CA")
        if not (self.home / "keystore.password").exists():
            (self.home / "keystore.password").write_text(secrets.token_urlsafe(18) + "\n")
        san = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}" for h in hosts)
        self._issue("server", "/CN=pipeline local server", f"subjectAltName={san}")
        if not self.keystore("server").exists():
            _openssl("pkcs12", "-export", "-in", str(self.cert("server")),
                     "-inkey", str(self.key("server")), "-certfile", str(self.ca),
                     "-name", "server", "-out", str(self.keystore("server")),
                     "-passout", f"pass:{self.keystore_password}")
        for name in clients:
            self._issue(name, f"/CN={name}", "extendedKeyUsage=clientAuth")
        return self

    def _issue(self, name: str, subject: str, extension: str) -> None:
        if self.cert(name).exists():
            return
        request = self.home / f"{name}.csr"
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(self.key(name)), "-out", str(request), "-subj", subject)
        _openssl("x509", "-req", "-in", str(request), "-CA", str(self.ca),
                 "-CAkey", str(self.key("ca")), "-CAcreateserial", "-days", DAYS,
                 "-out", str(self.cert(name)), "-extfile", "/dev/stdin",
                 stdin=extension + "\n")
        request.unlink()
        self.key(name).chmod(0o600)


def _openssl(*args: str, stdin: str | None = None) -> None:
    result = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")
