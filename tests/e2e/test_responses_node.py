"""The official ``openai`` Node SDK against the Responses API of a live stack.

Two relays, a worker and slow mock engines behind the demo's front door (which sends a
response's stream to a relay and the rest to a worker), on the session's cluster:
clients/openai/test/responses.test.js creates a response streamed and resumes a
background one with ``starting_after``, and tools.test.js has the SDK rebuild tool calls
from chat completions and the Responses API, under Node's test runner. The npm package
installs from clients/openai/package-lock.json (``npm ci``); where node, npm or the
registry is missing, the test skips with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import ProcError
from tests.support import demo as demo_harness
from tests.support.cli import run_cli

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "openai"
NODE, NPM = shutil.which("node"), shutil.which("npm")
KEY = "node-sdk-gateway-key-0123456789"


async def _npm_ready() -> str | None:
    """None when clients/openai has its package (installing it if needed), else why not."""
    if NODE is None or NPM is None:
        return "node/npm not installed (apt-get install nodejs npm)"
    if (CLIENT / "node_modules" / "openai" / "package.json").exists():
        return None
    try:
        run = await run_cli([NPM, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, timeout_s=300)
    except ProcError:
        return "npm ci timed out (is the npm registry reachable?)"
    if run.code != 0:
        return f"npm ci failed (is the npm registry reachable?): {run.err.strip()[-300:]}"
    return None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_node_sdk_creates_and_resumes_responses(cluster: ClusterInfo) -> None:
    why = await _npm_ready()
    if why is not None:
        pytest.skip(why)
    # 15 tokens/s: a reply (<= 48 tokens) lasts ~3 s, so the resume lands mid-response
    async with demo_harness.front_door(cluster, decode_tok_per_s=15,
                                       gateway_keys=[KEY]) as (url, _stack):  # fmt: skip
        # run_cli waits without blocking: the front door serves the SDK from this loop
        ran = await run_cli(
            [NODE or "node", "--test", str(CLIENT / "test" / "responses.test.js"),
             str(CLIENT / "test" / "tools.test.js")],
            cwd=CLIENT, timeout_s=240, merge=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TOKENRELAY_BASE": url,
                 "TOKENRELAY_GATEWAY_KEY": KEY},
        )  # fmt: skip
    out = ran.out
    assert ran.code == 0, out[-6000:]
    assert "# fail 0" in out
    assert re.search(r"^# pass [1-9]", out, re.M), out[-3000:]
    assert "# skipped 0" in out, out[-3000:]
