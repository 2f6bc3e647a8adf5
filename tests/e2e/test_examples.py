"""The README's "Use it from your app" examples, run as written against a live stack
(the demo's front door; the base URL ``http://127.0.0.1:8080`` of ``make demo`` is
replaced by the test's): curl's closed loop with bash, the browser one in headless
Chromium on the demo page, the Python and the OpenAI ones with this interpreter (the
gateway key ``make demo`` prints replaced by this stack's), the AI SDK one as the
README says to run it (``cd clients/aisdk && npm ci && node example.mjs``, the file
being the README's block). Each must print the reply the session's backlog holds (the
OpenAI one: a reply at all; curl: the turn's frames, ended by its ``done`` frame, and
not a byte on stderr).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode
from tests.e2e.test_aisdk import AISDK, _npm_ready
from tests.e2e.test_browser import CHROMIUM, LAUNCH_ARGS
from tests.support import demo as demo_harness
from tests.support.cli import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DEMO_BASE = "http://127.0.0.1:8080"
DEMO_KEY = "THE-KEY-MAKE-DEMO-PRINTED"  # the README's stand-in for the key make demo prints
KEY = "examples-gateway-key-0123456789"


def example(name: str, readme: Path = ROOT / "README.md") -> str:
    """The code block after ``<!-- example: name -->`` in ``readme`` (this README.md)."""
    text = readme.read_text()
    m = re.search(rf"<!-- example: {name} -->\n```\w+\n(.*?)```", text, re.S)
    assert m, f"README.md has no example {name!r}"
    return m.group(1)


@pytest.fixture(scope="module")
async def base(cluster: ClusterInfo) -> AsyncIterator[str]:
    async with demo_harness.front_door(cluster, decode_tok_per_s=200, gateway_keys=[KEY]) as (
        url,
        _stack,
    ):
        yield url


async def replies(cluster: ClusterInfo) -> set[str]:
    """Every reply text of the sessions this module's stack served (their backlogs)."""
    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    out: set[str] = set()
    try:
        async for raw_key in redis.scan_iter(match="tr:{*}:log", count=1000):
            sid = raw_key.decode().split("{")[1].split("}")[0]
            raw, _first, _last = await read_backlog(redis, sid, 0, 10_000)
            texts: dict[int, str] = {}
            for data in raw:
                f = decode(data)
                if f.kind == "token":
                    texts[f.turn] = texts.get(f.turn, "") + f.text
            out.update(texts.values())
    finally:
        await redis.aclose()
    return out


async def run(argv: list[str], cwd: Path, timeout_s: float = 60, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    ran = await run_cli(argv, cwd=cwd, env=full, timeout_s=timeout_s, merge=True)
    assert ran.code == 0, ran.out[-3000:]
    return ran.out


async def test_curl_example(base: str, tmp_path: Path) -> None:
    """Ends by itself with the turn, and prints no progress meter (nothing on stderr)."""
    code = example("curl")
    assert DEMO_BASE in code
    script = tmp_path / "example.sh"
    script.write_text("set -eu\n" + code.replace(DEMO_BASE, base))
    ran = await run_cli(["bash", str(script)], cwd=tmp_path, timeout_s=60)
    assert ran.code == 0, ran.err
    assert ran.err == "", ran.err
    events = [line.split(": ", 1)[1] for line in ran.out.splitlines() if line.startswith("event: ")]
    assert events[-1] == "done", ran.out[-2000:]
    assert "token" in events, ran.out[-2000:]


async def test_openai_example(base: str, tmp_path: Path) -> None:
    pytest.importorskip("openai", reason="pip install openai")
    code = example("openai")
    assert DEMO_BASE in code
    assert DEMO_KEY in code
    script = tmp_path / "example.py"
    script.write_text(code.replace(DEMO_BASE, base).replace(DEMO_KEY, KEY))
    printed = (await run([sys.executable, str(script)], tmp_path)).strip()
    assert len(printed) > 20, printed


async def test_python_example(base: str, cluster: ClusterInfo, tmp_path: Path) -> None:
    code = example("python")
    assert DEMO_BASE in code
    script = tmp_path / "example.py"
    script.write_text(code.replace(DEMO_BASE, base))
    printed = (await run([sys.executable, str(script)], tmp_path)).strip()
    assert len(printed) > 20
    assert printed in {r.strip() for r in await replies(cluster)}


async def test_aisdk_example(base: str, cluster: ClusterInfo) -> None:
    why = await _npm_ready()  # fills npm's cache from the registry if need be
    if why is not None:
        pytest.skip(why)
    code = example("aisdk")
    assert code == (AISDK / "example.mjs").read_text(), "the README's block is the file"
    assert DEMO_BASE in code
    command = example("aisdk-run").strip()
    assert command == "cd clients/aisdk && npm ci && node example.mjs", command
    # as the README says, from the repository's root; the base URL from the environment
    # (the file reads TOKENRELAY_BASE), npm from its cache
    out = await run(["bash", "-c", command], ROOT, 300, TOKENRELAY_BASE=base,
                    npm_config_prefer_offline="true")  # fmt: skip
    printed = out.strip().splitlines()[-1]
    assert len(printed) > 20
    assert printed in {r.strip() for r in await replies(cluster)}


async def test_browser_example(base: str, cluster: ClusterInfo) -> None:
    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    from playwright.async_api import async_playwright

    code = example("browser")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = await browser.new_page()
            logs: list[str] = []
            page.on("console", lambda msg: logs.append(msg.text))
            await page.goto(base)
            # As pasted into the console: an async body whose last log is the reply.
            await asyncio.wait_for(page.evaluate(f"async () => {{ {code} }}"), 60)
        finally:
            await browser.close()
    assert "live" in " ".join(logs)
    printed = logs[-1].strip()
    assert len(printed) > 20
    assert printed in {r.strip() for r in await replies(cluster)}
