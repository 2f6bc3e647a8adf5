"""The npm packages of a Node client under ``clients/``, installed for a test from its
committed package-lock.json (``npm ci``) when they are missing.

Order of use::

    why = await npm_ready(ROOT / "clients" / "producer", "ioredis")
    if why is not None:
        pytest.skip(why)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from devstack.procs import ProcError
from tests.support.cli import run_cli

__all__ = ["npm_ready"]


async def npm_ready(package: Path, probe: str) -> str | None:
    """None when ``package`` has ``node_modules/<probe>`` (running ``npm ci`` there if
    needed), else why not (node or npm missing, the registry unreachable)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "node/npm not installed (apt-get install nodejs npm)"
    if (package / "node_modules" / probe / "package.json").exists():
        return None
    try:
        run = await run_cli([npm, "ci", "--no-audit", "--no-fund"], cwd=package, timeout_s=300)
    except ProcError:
        return "npm ci timed out (is the npm registry reachable?)"
    if run.code != 0:
        return f"npm ci failed (is the npm registry reachable?): {run.err.strip()[-300:]}"
    return None
