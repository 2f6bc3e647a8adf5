"""The Socket.IO side of :mod:`bench.peers.socketio`: its npm install and its two node
processes (the scripts are in ``bench/peers/js/``).

- :func:`ensure_socketio`: ``npm install`` of :data:`PINS` into
  ``~/.cache/tokenrelay/peer-socketio`` (``$XDG_CACHE_HOME`` is honoured) once per cache;
  returns the ``node_modules`` directory, or the reason it cannot (no node or npm, node
  older than 18, the install failed or timed out: no access to the npm registry).
- :func:`socketio_server`: ``node bench/peers/js/socketio_server.cjs`` listening on a free
  loopback port (one process: Socket.IO 4.8, WebSocket transport, the sharded Redis
  adapter); stopped by its pid.
- :func:`emit`: ``node bench/peers/js/socketio_emit.cjs``, the paced publisher (a second
  Socket.IO instance broadcasting with ``io.to(room).emit``); stopped by its pid.

Node finds the packages through ``NODE_PATH``; nothing is installed in the repository.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench._util import free_port, run_json
from bench.relay.harness import RelayProc
from devstack.procs import launched, log_line
from relay.protocol.slotmap import Addr

__all__ = [
    "PINS", "cache_dir", "emit", "ensure_socketio", "installed_versions", "node_missing", "npm_ci",
    "peer_cache", "socketio_server",
]  # fmt: skip

PINS = {
    "socket.io": "4.8.4", "@socket.io/redis-adapter": "8.3.0",
    "@socket.io/redis-streams-adapter": "0.3.1", "redis": "4.7.1",
}  # fmt: skip
SCRIPTS = Path(__file__).resolve().parent / "js"


def peer_cache(name: str) -> Path:
    """``~/.cache/tokenrelay/<name>`` (``$XDG_CACHE_HOME`` honoured): a peer's npm install."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenrelay" / name


def cache_dir() -> Path:
    return peer_cache("peer-socketio")


def node_missing(side: str) -> str | None:
    """Why node >= 18 and npm cannot run ``side`` (None: they can)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return f"node and npm are needed for {side} (not on PATH)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = version.stdout.strip().lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < 18:
        return f"node >= 18 is needed, found {version.stdout.strip() or 'no version'}"
    return None


def _npm(args: list[str], cache: Path) -> str | None:
    """``npm <args>`` in ``cache``; the reason it failed, or None."""
    npm = shutil.which("npm") or "npm"
    try:
        done = subprocess.run(
            [npm, *args, "--no-audit", "--no-fund", "--omit=dev", "--loglevel=error",
             "--fetch-retries=2", "--fetch-timeout=30000"],
            cwd=cache, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"npm {args[0]} took more than 300 s (no access to the npm registry?)"
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"npm {args[0]} failed ({done.returncode}): {tail[0][:200]}"
    return None


def npm_ci(package: Path, cache: Path, side: str, probe: str = "") -> Path | str:
    """``npm ci`` of ``package``'s committed package.json and lock into ``cache``, once per
    lock (redone when either changes or ``node_modules/<probe>`` is missing): the
    ``node_modules`` directory, or the reason it cannot be had."""
    missing = node_missing(side)
    if missing is not None:
        return missing
    manifest, lock = (package / "package.json").read_bytes(), (package / "package-lock.json")
    digest = hashlib.sha256(lock.read_bytes() + manifest).hexdigest()
    modules, stamp = cache / "node_modules", cache / "installed.sha256"
    with contextlib.suppress(OSError):
        if stamp.read_text() == digest and (modules / probe).is_dir():
            return modules
    cache.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(package / name, cache / name)
    failed = _npm(["ci"], cache)
    if failed is not None:
        return failed
    stamp.write_text(digest)
    return modules


def ensure_socketio(cache: Path | None = None) -> Path | str:
    """The ``node_modules`` directory with :data:`PINS` installed (npm, once per cache),
    or the reason it cannot be had (no node, no npm, the install failed)."""
    cache = cache or cache_dir()
    missing = node_missing("the Socket.IO side")
    if missing is not None:
        return missing
    modules = cache / "node_modules"
    stamp = cache / "installed.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_text()) == PINS and modules.is_dir():
            return modules
    cache.mkdir(parents=True, exist_ok=True)
    manifest = {"name": "tokenrelay-peer-socketio", "private": True, "dependencies": PINS}
    (cache / "package.json").write_text(json.dumps(manifest, indent=2))
    failed = _npm(["install"], cache)
    if failed is not None:
        return failed
    stamp.write_text(json.dumps(PINS))
    return modules


def installed_versions(modules: Path) -> dict[str, str]:
    out = {}
    for name in [*PINS, "engine.io", "ws"]:
        with contextlib.suppress(OSError, ValueError, KeyError):
            out[name] = json.loads((modules / name / "package.json").read_text())["version"]
    return out


def _node_env(modules: Path) -> dict[str, str]:
    return {**os.environ, "NODE_PATH": str(modules)}


@contextlib.asynccontextmanager
async def socketio_server(
    modules: Path, seed: Addr, log_dir: Path, adapter: str = "sharded"
) -> AsyncIterator[RelayProc]:
    """``socketio_server.cjs`` as its own process, listening; stopped by pid. ``adapter``:
    ``sharded`` (at most once) or ``streams`` (the streams adapter, state recovery on)."""
    port = free_port()
    argv = ["node", str(SCRIPTS / "socketio_server.cjs"), str(port), f"{seed.host}:{seed.port}",
            adapter]  # fmt: skip
    async with launched(
        argv, log=log_dir / f"socketio-{adapter}-{port}.log", ready=log_line(f"ready {port}"),
        name="Socket.IO server", env=_node_env(modules),
    ) as proc:  # fmt: skip
        yield RelayProc(proc, port)


async def emit(
    modules: Path, seed: Addr, sids: list[str], rate: float, secs: float,
    plan: list[list[int]] | None = None, adapter: str = "sharded",
) -> dict[str, Any]:  # fmt: skip
    """Run ``socketio_emit.cjs`` (a child process) and return its JSON line: even pacing,
    or the tick schedule ``plan`` of an LLM-rate phase."""
    spec: dict[str, Any] = {"seed": f"{seed.host}:{seed.port}", "rooms": sids, "rate": rate,
                            "seconds": secs, "adapter": adapter}  # fmt: skip
    if plan is not None:
        spec["ticks"] = plan
    argv = ["node", str(SCRIPTS / "socketio_emit.cjs")]
    return await run_json(
        argv, spec, name="Socket.IO emitter", timeout_s=secs + 60, env=_node_env(modules)
    )
