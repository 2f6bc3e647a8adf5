"""A throwaway certificate authority for TLS tests, made with the ``openssl`` command.

:func:`make_pki` writes into a directory a CA, a server certificate for 127.0.0.1 /
localhost (serverAuth and clientAuth: a Redis node presents it to its peers too) and a
client certificate, all signed by that CA and valid for one day, and returns them as a
:class:`devstack.cluster.launcher.ClusterTLS`. :func:`openssl_missing` says why it cannot run.
Keys are P-256 EC keys; nothing leaves the directory.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from devstack.cluster.tls import ClusterTLS

__all__ = ["make_ca", "make_pki", "openssl_missing"]

_LEAF_EXT = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = {usage}
subjectAltName = {san}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def openssl_missing() -> str | None:
    """None when the ``openssl`` command is there, else the reason to skip."""
    return None if shutil.which("openssl") else "no openssl command on PATH to make certificates"


def _run(*args: str) -> None:
    # Not run_cli: the certificates are made by plain functions, from sync and async code
    # alike, before any server starts; openssl only writes files and exits at once.
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _key(path: Path) -> None:
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _key(key)
    _run(
        "req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "1",
        "-subj", f"/CN=tokenrelay test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
    )  # fmt: skip
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], usage: str) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}.{ext}" for ext in ("pem", "key", "csr"))
    ext = directory / f"{name}.ext"
    ext.write_text(_LEAF_EXT.format(usage=usage, san="IP:127.0.0.1, DNS:localhost"))
    _key(key)
    _run("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _run(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


def make_pki(directory: Path) -> ClusterTLS:
    """CA, server and client certificates in ``directory`` (see the module docstring)."""
    ca = make_ca(directory)
    server = _leaf(directory, "server", ca, "serverAuth, clientAuth")
    client = _leaf(directory, "client", ca, "clientAuth")
    return ClusterTLS(
        ca=str(ca[0]),
        server_cert=str(server[0]),
        server_key=str(server[1]),
        client_cert=str(client[0]),
        client_key=str(client[1]),
    )
