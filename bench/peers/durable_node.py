"""The reference side of :mod:`bench.peers.durable`: ``@durable-streams/server`` installed
from the committed lock in ``bench/peers/durable_js/`` and run as one Node process.

- :func:`ensure_reference`: ``npm ci`` of ``bench/peers/durable_js/package-lock.json`` into
  ``~/.cache/tokenrelay/peer-durable`` (``$XDG_CACHE_HOME`` is honoured), once per lock;
  returns the ``node_modules`` directory, or the reason it cannot (no node or npm, node
  older than 18, the install failed or timed out: no access to the npm registry).
- :func:`reference_server`: ``node bench/peers/durable_js/server.cjs PORT [DATA_DIR]``
  listening on a free loopback port: file-backed with a data directory (log files and
  LMDB, an fdatasync per append), in memory without; stopped by its pid.

Node finds the packages through ``NODE_PATH``; nothing is installed in the repository.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

from bench._util import free_port
from bench.peers.node import npm_ci, peer_cache
from bench.relay.harness import RelayProc
from devstack.procs import launched, log_line

__all__ = ["PACKAGE", "cache_dir", "ensure_reference", "reference_server", "reference_version"]

PACKAGE = Path(__file__).resolve().parent / "durable_js"


def cache_dir() -> Path:
    return peer_cache("peer-durable")


def ensure_reference(cache: Path | None = None) -> Path | str:
    """The ``node_modules`` directory with the locked packages (``npm ci``, once per lock),
    or the reason it cannot be had."""
    return npm_ci(PACKAGE, cache or cache_dir(), "the reference server")


def reference_version(modules: Path) -> str:
    with contextlib.suppress(OSError, ValueError, KeyError):
        path = modules / "@durable-streams" / "server" / "package.json"
        return str(json.loads(path.read_text())["version"])
    return "unknown"


@contextlib.asynccontextmanager
async def reference_server(
    modules: Path, log_dir: Path, data_dir: Path | None
) -> AsyncIterator[RelayProc]:
    """``server.cjs`` as its own process (file-backed in ``data_dir``, else in memory),
    listening; stopped by pid."""
    port = free_port()
    argv = ["node", str(PACKAGE / "server.cjs"), str(port)]
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        argv.append(str(data_dir))
    mode = "file" if data_dir is not None else "memory"
    async with launched(
        argv, log=log_dir / f"reference-{mode}-{port}.log", ready=log_line(f"ready {port}"),
        name=f"reference server ({mode})", env={**os.environ, "NODE_PATH": str(modules)},
    ) as proc:  # fmt: skip
        yield RelayProc(proc, port)
