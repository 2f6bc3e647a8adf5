"""The browser client (clients/js/tokenrelay.js) under Node's built-in test runner: its
pure parts (no network), and its I/O shell over SSE against a live stack (token refresh
hook, refusals, resume, clean close); and the demo page serving that very file. In a
browser, with a relay killed mid-reply: tests/test_browser.py.

Skips with the reason where Node is missing (or older than 18: no ``node --test``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from tests.support import demo as demo_harness

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "js"
NODE = shutil.which("node")


def _node_major() -> int:
    if NODE is None:
        return 0
    out = subprocess.run([NODE, "--version"], capture_output=True, text=True, check=False)
    return int(out.stdout.strip().lstrip("v").split(".")[0] or 0)


def test_pure_parts_under_node_test_runner() -> None:
    if _node_major() < 18:
        pytest.skip("node >= 18 is needed for `node --test` (apt-get install nodejs)")
    run = subprocess.run(
        [NODE or "node", "--test", "test/pure.test.js"],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout
    assert "# skipped 0" in run.stdout


@pytest.fixture(scope="module")
async def base(cluster: ClusterInfo) -> AsyncIterator[str]:
    async with demo_harness.front_door(cluster, decode_tok_per_s=200) as (url, _stack):
        yield url


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_io_shell_against_a_live_stack(base: str) -> None:
    if _node_major() < 18:
        pytest.skip("node >= 18 is needed for `node --test` (apt-get install nodejs)")
    # Not subprocess.run: the front door serves the client's requests from this loop.
    proc = await asyncio.create_subprocess_exec(
        NODE or "node", "--test", "test/live.test.js", cwd=CLIENT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TOKENRELAY_BASE": base},
    )  # fmt: skip
    try:
        raw, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = raw.decode(errors="replace")
    assert proc.returncode == 0, out[-5000:]
    assert "# fail 0" in out
    assert "# skipped 0" in out


def test_demo_page_serves_the_client_itself() -> None:
    """The page imports the client from /static/tokenrelay.js, which is the published
    file (a link into the package data), not a copy that could drift."""
    served = ROOT / "devstack" / "demo" / "static" / "tokenrelay.js"
    assert served.resolve() == (CLIENT / "tokenrelay.js").resolve()
    app = (ROOT / "devstack" / "demo" / "static" / "app.js").read_text()
    assert 'import { watch } from "./tokenrelay.js";' in app
    assert "new EventSource" not in app
    assert "new WebSocket" not in app
    index = (ROOT / "devstack" / "demo" / "static" / "index.html").read_text()
    assert '<script type="module" src="/static/app.js">' in index
