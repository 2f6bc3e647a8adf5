"""The TypeScript producer's examples, run as written against a live stack (the demo's
front door, its relays and worker, on the session's cluster): ``examples/node.mjs``
(plain Node), ``examples/next-route.mjs`` (a Next.js route handler's ``POST``, called
with a web ``Request``), ``examples/usechat-route.mjs`` (useChat with one's own backend:
the AI SDK's stock ``DefaultChatTransport`` against the route served by Node's http
server as Next.js serves it) and the README's TypeScript block ("Stream from your own
backend") as written, its model this stack's OpenAI gateway (the environment the demo's
``backend.env`` gives). Each reply must reach a viewer: an SSE client of the front door,
with the token the example minted, reads the turn's frames from the start and gets the
text the example wrote, ended by its ``done`` frame.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.backend import backend_env
from devstack.demo.stack import Stack
from devstack.procs import Proc, log_line
from relay.protocol.auth import issue_token
from tests.e2e.test_examples import example
from tests.support import demo as demo_harness
from tests.support.cli import run_cli
from tests.support.npm import npm_ready
from tests.support.sse import SSEClient

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "clients" / "producer"
NODE = shutil.which("node")
GATEWAY_KEY = "producer-examples-gateway-key-0123456789"


@pytest.fixture(scope="module")
async def stack(cluster: ClusterInfo) -> AsyncIterator[tuple[str, Stack]]:
    async with demo_harness.front_door(
        cluster, decode_tok_per_s=200, gateway_keys=[GATEWAY_KEY]
    ) as door:
        yield door


@pytest.fixture(autouse=True)
async def _packages() -> None:
    why = await npm_ready(PKG, "ai")
    if why is not None:
        pytest.skip(why)


def _env(base: str, st: Stack, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "TOKENRELAY_BASE": base, "TOKENRELAY_SECRET": st.spec.secret, **extra}  # fmt: skip


async def watch(base: str, sid: str, token: str, after: int = 0) -> tuple[str, dict[str, Any]]:
    """What a viewer of the front door gets: the reply of the session's turn and its
    ``done`` frame."""
    url = f"{base}/v1/sessions/{sid}/events?last_event_id={after}"
    text: list[str] = []
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http, http.get(url, headers=auth) as resp:
        assert resp.status == 200, await resp.text()
        client = SSEClient(resp)
        while True:
            ev = await asyncio.wait_for(client.next_event(), 30)
            assert ev is not None, "the stream ended before the done frame"
            _id, kind, frame = ev
            if kind == "token":
                text.append(frame["text"])
            assert kind != "error", frame
            if kind == "done":
                return "".join(text), frame


async def test_the_node_example(stack: tuple[str, Stack]) -> None:
    base, st = stack
    ran = await run_cli([NODE or "node", "examples/node.mjs"], cwd=PKG, timeout_s=120,
                        env=_env(base, st))  # fmt: skip
    assert ran.code == 0, ran.out[-3000:] + ran.err[-3000:]
    lines = ran.out.strip().splitlines()
    where = json.loads(lines[0])
    assert where["events"] == f"{base}/v1/sessions/{where['session']}/events"
    reply, done = await watch(base, where["session"], where["token"])
    assert reply == lines[-1]
    assert len(reply) > 20
    assert done["meta"]["finish_reason"] == "stop"
    assert done["meta"]["chars"] == len(reply)


async def test_the_next_route_example(stack: tuple[str, Stack], tmp_path: Path) -> None:
    base, st = stack
    harness = tmp_path / "call-route.mjs"
    route = (PKG / "examples" / "next-route.mjs").as_uri()
    harness.write_text(
        f"const {{ POST }} = await import({json.dumps(route)});\n"
        "const call = async (body) => {\n"
        "  const res = await POST(new Request('http://app.local/api/chat', { method: 'POST',\n"
        "    headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) }));\n"
        "  console.log(JSON.stringify({ status: res.status, body: await res.json() }));\n"
        "};\n"
        "await call({ message: 'What does a relay do?' });\n"
        "await call({ message: 'x', session: 'not a session!' });\n"
        "console.log('called');\n"
    )
    proc = Proc.start([NODE or "node", str(harness)], log=tmp_path / "route.log", cwd=PKG,
                      env=_env(base, st))  # fmt: skip
    try:
        await proc.ready(log_line("called"), timeout_s=60)
        ok, bad = (json.loads(x) for x in proc.output().strip().splitlines()[:2])
        assert ok["status"] == 200, ok
        assert bad["status"] == 400
        assert bad["body"]["error"] == "invalid_session"
        body = ok["body"]
        reply, done = await watch(base, body["session"], body["token"], body["offset"] - 1)
        assert len(reply) > 20
        assert done["turn"] == body["turn"]
        assert done["meta"]["chars"] == len(reply)
    finally:
        await proc.stop()


# The route served as Next.js serves it (a web Request in, a web Response streamed out),
# read by the AI SDK's stock transport: a whole reply, then the resume GET once it ended.
USECHAT_HARNESS = """
import { createServer } from 'node:http';
import { Readable } from 'node:stream';
import { DefaultChatTransport, readUIMessageStream } from 'ai';
const { POST, GET } = await import(ROUTE);
const server = createServer(async (req, res) => {
  const url = new URL(req.url, 'http://app.local');
  const body = req.method === 'POST' ? Readable.toWeb(req) : undefined;
  const request = new Request(url, { method: req.method, headers: req.headers, body,
    duplex: 'half' });
  const resume = url.pathname.match(/^\\/api\\/chat\\/([^/]+)\\/stream$/);
  const response = req.method === 'POST' && url.pathname === '/api/chat' ? await POST(request)
    : req.method === 'GET' && resume
      ? await GET(request, { params: Promise.resolve({ id: resume[1] }) })
    : new Response(null, { status: 404 });
  res.writeHead(response.status, Object.fromEntries(response.headers));
  if (response.body) for await (const chunk of response.body) res.write(chunk);
  res.end();
});
await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
const api = `http://127.0.0.1:${server.address().port}/api/chat`;
const transport = new DefaultChatTransport({ api });
const chatId = `chat-${Date.now()}`;
const stream = await transport.sendMessages({
  chatId, trigger: 'submit-message', messageId: undefined, abortSignal: undefined,
  messages: [{ id: 'm1', role: 'user', parts: [{ type: 'text', text: 'hello' }] }],
});
let reply;
for await (const message of readUIMessageStream({ stream })) reply = message;
const text = reply.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');
const after = await transport.reconnectToStream({ chatId });
console.log(JSON.stringify({ chatId, id: reply.id, text, resumedAfterEnd: after }));
process.exit(0);
"""


async def test_the_usechat_route_example(stack: tuple[str, Stack], tmp_path: Path) -> None:
    base, st = stack
    harness = tmp_path / "usechat.mjs"
    route = (PKG / "examples" / "usechat-route.mjs").as_uri()
    harness.write_text(f"const ROUTE = {json.dumps(route)};\n" + USECHAT_HARNESS)
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "ai").symlink_to(PKG / "node_modules" / "ai")
    ran = await run_cli([NODE or "node", str(harness)], cwd=PKG, timeout_s=60,
                        env=_env(base, st))  # fmt: skip
    assert ran.code == 0, ran.out[-3000:] + ran.err[-3000:]
    out = json.loads(ran.out.strip().splitlines()[0])
    # the transport got the turn's whole reply, as a viewer of the session sees it
    token = issue_token(st.spec.secret, out["chatId"], 300, time.time())
    reply, done = await watch(base, out["chatId"], token)
    assert out["text"] == reply
    assert len(reply) > 20
    assert out["id"] == f"{out['chatId']}-1"
    assert done["meta"]["chars"] == len(reply)
    assert out["resumedAfterEnd"] is None  # nothing runs: the resume GET is a 204


async def test_the_readme_typescript_block(stack: tuple[str, Stack], cluster: ClusterInfo,
                                           tmp_path: Path) -> None:  # fmt: skip
    """As written, in an app that installed the package, with the environment the demo's
    backend.env gives (this stack's Redis, secret and OpenAI gateway)."""
    why = await npm_ready(PKG, "@ai-sdk/openai")
    if why is not None:
        pytest.skip(why)
    base, st = stack
    # as an app that installed the package: node_modules/@tokenrelay/producer, ai, ...
    mods = tmp_path / "node_modules"
    (mods / "@tokenrelay").mkdir(parents=True)
    (mods / "@tokenrelay" / "producer").symlink_to(PKG)
    for dep in ("ai", "@ai-sdk", "zod"):
        (mods / dep).symlink_to(PKG / "node_modules" / dep)
    (tmp_path / "backend.mjs").write_text(example("producer-ts"))
    env = backend_env(cluster.url, st.spec.secret, base, GATEWAY_KEY, st.spec.model)
    ran = await run_cli([NODE or "node", "backend.mjs"], cwd=tmp_path, timeout_s=120,
                        env={**_env(base, st), **env})  # fmt: skip
    assert ran.code == 0, ran.out[-3000:] + ran.err[-3000:]
    first, *_, printed = ran.out.strip().splitlines()
    sid, token = first.split(" ")
    reply, done = await watch(base, sid, token)
    assert reply == printed
    assert len(reply) > 20
    assert done["meta"]["finish_reason"] in ("stop", "length")
