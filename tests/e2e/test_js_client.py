"""The browser client (clients/js/tokenrelay.js) under Node's built-in test runner: its
pure parts (no network), and its I/O shell over SSE against a live stack (token refresh
hook, refusals, resume, clean close); and the demo page serving that very file. In a
browser, with a relay killed mid-reply: tests/e2e/test_browser.py.

Skips with the reason where Node is missing (or older than 18: no ``node --test``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from tests.support import demo as demo_harness
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "js"
NODE = shutil.which("node")


async def _node_major() -> int:
    if NODE is None:
        return 0
    out = (await run_cli([NODE, "--version"], timeout_s=60)).out
    return int(out.strip().lstrip("v").split(".")[0] or 0)


async def test_pure_parts_under_node_test_runner() -> None:
    if await _node_major() < 18:
        pytest.skip("node >= 18 is needed for `node --test` (apt-get install nodejs)")
    run = await run_cli([NODE or "node", "--test", "test/pure.test.js"], cwd=CLIENT,
                        timeout_s=120)  # fmt: skip
    assert run.code == 0, run.out[-4000:] + run.err[-2000:]
    assert "# fail 0" in run.out
    assert "# skipped 0" in run.out


@pytest.fixture(scope="module")
async def base(cluster: ClusterInfo) -> AsyncIterator[str]:
    async with demo_harness.front_door(cluster, decode_tok_per_s=200) as (url, _stack):
        yield url


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_io_shell_against_a_live_stack(base: str) -> None:
    if await _node_major() < 18:
        pytest.skip("node >= 18 is needed for `node --test` (apt-get install nodejs)")
    # run_cli waits without blocking: the front door serves the client's requests from this loop
    ran = await run_cli(
        [NODE or "node", "--test", "test/live.test.js"], cwd=CLIENT, timeout_s=120, merge=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TOKENRELAY_BASE": base},
    )  # fmt: skip
    out = ran.out
    assert ran.code == 0, out[-5000:]
    assert "# fail 0" in out
    assert "# skipped 0" in out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_websocket_mode_on_this_node_as_the_readme_states(base: str) -> None:
    """clients/js/README.md: Node >= 20; WebSocket mode uses the global WebSocket of Node
    >= 22, and on Node 20 needs one passed in (``options.WebSocket``). Checked on the Node
    of this machine: whether it has the global, the clear error without one, and a turn
    over WebSocket with the one passed in (on Node 20: the runtime's own, behind
    ``--experimental-websocket``)."""
    major = await _node_major()
    if major == 0:
        pytest.skip("node is not installed (apt-get install nodejs)")
    assert major >= 20, f"clients/js/README.md states Node >= 20; this is {major}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TOKENRELAY_BASE": base}
    probe = await run_cli([NODE or "node", "-e", "console.log(typeof WebSocket)"], env=env,
                          timeout_s=60)  # fmt: skip
    assert probe.out.strip() == ("function" if major >= 22 else "undefined"), probe.out
    flags = [] if major >= 22 else ["--experimental-websocket"]
    ran = await run_cli([NODE or "node", *flags, "--test", "test/ws.test.js"], cwd=CLIENT,
                        timeout_s=120, merge=True, env=env)  # fmt: skip
    assert ran.code == 0, ran.out[-5000:]
    assert "# pass 2" in ran.out, ran.out[-3000:]
    assert "# fail 0" in ran.out


def test_the_stated_node_versions_are_the_package_s() -> None:
    readme = (CLIENT / "README.md").read_text()
    engines = json.loads((CLIENT / "package.json").read_text())["engines"]["node"]
    assert engines == ">=20"
    assert "Node >= 20" in readme
    assert "Node >= 18" not in readme
    assert "on Node 20 pass one in" in " ".join(readme.split())


def test_demo_page_serves_the_client_itself() -> None:
    """The page imports the client from /static/tokenrelay.js, which is the published
    file (a link into the package data), not a copy that could drift."""
    served = ROOT / "devstack" / "demo" / "static" / "tokenrelay.js"
    assert served.resolve() == (CLIENT / "tokenrelay.js").resolve()
    app = (ROOT / "devstack" / "demo" / "static" / "app.js").read_text()
    imports = re.search(r'^import \{([^}]*)\} from "\./tokenrelay\.js";$', app, re.M)
    assert imports is not None
    assert "watch" in [name.strip() for name in imports.group(1).split(",")]
    assert "new EventSource" not in app
    assert "new WebSocket" not in app
    index = (ROOT / "devstack" / "demo" / "static" / "index.html").read_text()
    assert '<script type="module" src="/static/app.js">' in index
