"""The browser client (clients/js/tokenrelay.js): its pure parts under Node's built-in
test runner, and the demo page serving that very file.

Skips with the reason where Node is missing (or older than 18: no ``node --test``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

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
    tests = sorted(str(p) for p in (CLIENT / "test").glob("*.test.js"))
    assert tests, "no Node tests found"
    run = subprocess.run(
        [NODE or "node", "--test", *tests],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout


def test_demo_page_serves_the_client_itself() -> None:
    """The page imports the client from /static/tokenrelay.js, which is the published
    file (a link into the package data), not a copy that could drift."""
    served = ROOT / "worker" / "static" / "tokenrelay.js"
    assert served.resolve() == (CLIENT / "tokenrelay.js").resolve()
    app = (ROOT / "worker" / "static" / "app.js").read_text()
    assert 'import { watch } from "./tokenrelay.js";' in app
    assert "new EventSource" not in app
    assert "new WebSocket" not in app
    index = (ROOT / "worker" / "static" / "index.html").read_text()
    assert '<script type="module" src="/static/app.js">' in index
