"""Vercel AI SDK compatibility: the UI message stream parts (pure), the chat body parser
(pure), and the real ``ai`` npm package under Node's test runner against a live stack
(relays, a worker, slow mock engines behind the demo's front door, on the session's
cluster): the SDK's DefaultChatTransport posts to the worker, reconnects mid-turn to a
relay, and readUIMessageStream gets the text an SSE viewer gets.

The npm packages install from clients/aisdk/package-lock.json (``npm ci``) into
clients/aisdk/node_modules; where node, npm or the registry is missing, the Node part
skips with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.fronts.aisdk.wire import UiTurn, encode_chunk
from relay.protocol.frame import Frame
from tests.support import demo as demo_harness
from tests.support.cli import run_cli
from tests.support.npm import npm_ready
from worker.fronts.aisdk.http import ChatError, parse_chat

AISDK = Path(__file__).resolve().parents[2] / "clients" / "aisdk"
NODE = shutil.which("node")


def frame(offset: int, kind: str, text: str = "", turn: int = 2, **meta: Any) -> Frame:
    return Frame(session="s1", turn=turn, offset=offset, kind=kind, text=text,  # type: ignore[arg-type]
                 meta=meta or None)  # fmt: skip


# -- pure ---------------------------------------------------------------------------------


def test_a_turn_becomes_the_sdk_parts_in_order() -> None:
    ui = UiTurn("s1", 2)
    frames = [
        frame(3, "done", turn=1),  # the previous turn: ignored
        frame(4, "meta", turn=2, engine="mock-1", message="hi"),
        frame(5, "token", "Hel"),
        frame(6, "presence"),
        frame(8, "token", "lo", merged=2, **{"from": 7}),
        frame(9, "done", tokens=2, finish_reason="length"),
        frame(10, "token", "late"),  # after finish: nothing
    ]
    parts = [p for f in frames for p in ui.feed(f)]
    assert parts == [
        {"type": "start", "messageId": "s1-2",
         "messageMetadata": {"session": "s1", "turn": 2, "engine": "mock-1"}},
        {"type": "text-start", "id": "text-2"},
        {"type": "text-delta", "id": "text-2", "delta": "Hel"},
        {"type": "text-delta", "id": "text-2", "delta": "lo"},
        {"type": "text-end", "id": "text-2"},
        {"type": "finish", "finishReason": "length",
         "messageMetadata": {"session": "s1", "turn": 2, "tokens": 2, "finish_reason": "length"}},
    ]  # fmt: skip
    assert ui.finished
    assert encode_chunk(parts[2]) == b'data: {"type":"text-delta","id":"text-2","delta":"Hel"}\n\n'


def test_an_error_frame_or_a_gap_ends_the_reply_with_an_error_part() -> None:
    ui = UiTurn("s1", 2)
    parts = [p for f in (frame(4, "meta"), frame(5, "token", "a"), frame(6, "error", "engine down"))
             for p in ui.feed(f)]  # fmt: skip
    assert [p["type"] for p in parts] == ["start", "text-start", "text-delta", "text-end",
                                          "error", "finish"]  # fmt: skip
    assert parts[4] == {"type": "error", "errorText": "engine down"}
    assert parts[5] == {"type": "finish", "finishReason": "error"}
    gap = Frame(session="s1", turn=0, offset=9, kind="gap", text="frames 5..9 are gone")
    ui = UiTurn("s1", 2)
    assert ui.feed(gap) == []  # before the turn began: not this reply's text
    ui.feed(frame(10, "meta"))
    assert [p["type"] for p in ui.feed(gap)] == ["error", "finish"]


def test_the_chat_body_of_the_sdk() -> None:
    body = (b'{"id":"abc_1","trigger":"submit-message","messages":['
            b'{"id":"s","role":"system","parts":[{"type":"text","text":"Be brief."}]},'
            b'{"id":"1","role":"user","parts":[{"type":"text","text":"Hi "},'
            b'{"type":"file","url":"x"},{"type":"text","text":"there"}]}]}')  # fmt: skip
    req = parse_chat(body, 100)
    assert (req.session, req.message, req.system) == ("abc_1", "Hi there", "Be brief.")
    bad = {
        b"[]": "invalid_body",
        b"{": "malformed_json",
        b'{"id":"a b","messages":[]}': "invalid_session",
        b'{"id":"a","messages":[]}': "invalid_messages",
        b'{"id":"a","trigger":"resume","messages":[]}': "unsupported_trigger",
        b'{"id":"a","trigger":"regenerate-message","messageId":5}': "invalid_messages",
        b'{"id":"a","messages":[{"role":"assistant","parts":[]}]}': "invalid_message",
        b'{"id":"a","messages":[{"role":"user","parts":[{"type":"file"}]}]}': "invalid_message",
        b'{"id":"a","messages":[{"role":"user","content":"' + b"x" * 101 + b'"}]}': (
            "message_too_large"
        ),
    }
    regen = parse_chat(b'{"id":"a","trigger":"regenerate-message","messages":[]}', 100)
    assert regen.message is None
    assert regen.replaces is not None
    assert regen.replaces.message_id is None  # the newest reply
    edit = parse_chat(
        b'{"id":"a","messageId":"u1","messages":[{"id":"u1","role":"user","content":"new"}]}', 100
    )
    assert (edit.message, edit.message_id) == ("new", "u1")
    assert edit.replaces is not None
    assert edit.replaces.message_id == "u1"
    for raw, code in bad.items():
        with pytest.raises(ChatError) as info:
            parse_chat(raw, 100)
        assert info.value.code == code, raw


# -- the real SDK against a live stack --------------------------------------------------------


async def _npm_ready() -> str | None:
    """None when clients/aisdk has its packages (installing them if needed), else why not."""
    return await npm_ready(AISDK, "ai")


@pytest.fixture(scope="module")
async def front_door(cluster: ClusterInfo) -> AsyncIterator[str]:
    """Two relays, a worker and slow mock engines behind the demo's front door."""
    # 15 tokens/s: a reply (<= 48 tokens) lasts ~3 s, so a reconnect lands mid-turn
    async with demo_harness.front_door(cluster, decode_tok_per_s=15) as (url, _stack):
        yield url


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_ai_package_reads_the_relay_ui_stream(front_door: str) -> None:
    why = await _npm_ready()
    if why is not None:
        pytest.skip(why)
    tests = sorted(str(p) for p in (AISDK / "test").glob("*.test.js"))
    # run_cli waits without blocking: the front door serves the SDK's requests from this loop
    ran = await run_cli(
        [NODE or "node", "--test", *tests], cwd=AISDK, timeout_s=240, merge=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TOKENRELAY_BASE": front_door},
    )  # fmt: skip
    out = ran.out
    assert ran.code == 0, out[-6000:]
    assert "# fail 0" in out
    assert re.search(r"^# pass [1-9]", out, re.M), out[-3000:]
    assert "# skipped 0" in out, out[-3000:]


@pytest.mark.integration
async def test_ui_stream_refusals_and_204(front_door: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(front_door + "/v1/sessions") as r:
            s = await r.json()
        auth = {"Authorization": f"Bearer {s['token']}"}
        url = f"{front_door}/v1/sessions/{s['session']}/ui-stream"
        async with http.get(url, headers=auth) as r:
            assert r.status == 204  # no turn runs
        async with http.get(url) as r:
            assert r.status == 401
            assert (await r.json())["error"] == "token_missing"
        async with http.get(f"{front_door}/v1/sessions/bad!id/ui-stream", headers=auth) as r:
            assert r.status == 400
        async with http.post(front_door + "/v1/chat", data=b"{}", headers={
            **auth, "Content-Type": "application/json"}) as r:  # fmt: skip
            assert r.status == 400
            assert (await r.json())["error"] == "invalid_session"


async def _bundle(out: Path) -> str | None:
    """Bundle page/chat.js with the SDK (esbuild from the lockfile); None, or why not."""
    esbuild = AISDK / "node_modules" / ".bin" / "esbuild"
    if not esbuild.exists():
        return "esbuild is not installed in clients/aisdk (npm ci)"
    ran = await run_cli(
        [str(esbuild), "page/chat.js", "--bundle", "--format=esm", "--platform=browser",
         f"--outfile={out}", "--log-level=warning"],
        cwd=AISDK, timeout_s=120, merge=True,
    )  # fmt: skip
    assert ran.code == 0, ran.out
    return None


@pytest.mark.integration
@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_page_on_the_sdk_chat_client_streams_and_resumes_on_another_screen(
    cluster: ClusterInfo, tmp_path: Path
) -> None:
    """Two screens run the SDK's own chat client: one sends, the other opens mid-reply
    and resumes the running turn (like useChat({resume: true})); both end with the text
    the backlog holds."""
    from tests.e2e.test_browser import CHROMIUM, LAUNCH_ARGS

    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    why = await _npm_ready() or await _bundle(tmp_path / "chat.bundle.js")
    if why is not None:
        pytest.skip(why)
    from playwright.async_api import Route, async_playwright

    html = (AISDK / "page" / "chat.html").read_bytes()
    bundle = (tmp_path / "chat.bundle.js").read_bytes()

    async def serve(route: Route) -> None:
        if route.request.url.split("#")[0].endswith("/sdk/chat.bundle.js"):
            await route.fulfill(body=bundle, content_type="text/javascript")
        else:
            await route.fulfill(body=html, content_type="text/html")

    # 5 tokens/s: the reply streams for several seconds, long enough for a second
    # screen to load the page (a 1 MB bundle) on a busy machine and resume it
    async with (
        demo_harness.front_door(cluster, decode_tok_per_s=5) as (front_door, _stack),
        async_playwright() as pw,
    ):
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            ctx = await browser.new_context()
            await ctx.route(f"{front_door}/sdk/*", serve)
            one = await ctx.new_page()
            await one.goto(f"{front_door}/sdk/chat.html")
            await one.wait_for_function("document.body.dataset.ready === '1'", timeout=15_000)
            await one.fill("#message", "Tell me about resumable streams")
            await one.press("#message", "Enter")
            await one.wait_for_function(
                "(document.querySelector('.msg.assistant')?.textContent || '').length > 5",
                timeout=20_000,
            )
            two = await ctx.new_page()  # opens mid-reply: resumes the running turn
            await two.goto(one.url)
            for page in (one, two):
                await page.wait_for_function(
                    "document.body.dataset.ready === '1' && "
                    "document.getElementById('status').textContent === 'ready' && "
                    "document.querySelector('.msg.assistant') !== null",
                    timeout=60_000,
                )
            texts = [
                await p.eval_on_selector_all(".msg.assistant", "els => els.map(e => e.textContent)")
                for p in (one, two)
            ]
            errors = [await p.text_content("#error") for p in (one, two)]
            sid = one.url.split("session=")[1].split("&")[0]
        finally:
            await browser.close()
    assert errors == ["", ""]
    assert len(texts[0]) == 1
    assert texts[0] == texts[1]
    assert texts[0][0] == await _reply(cluster, sid, 1)


@pytest.mark.integration
@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_sdk_page_stops_regenerates_and_reloads_to_the_stored_history(
    cluster: ClusterInfo, tmp_path: Path
) -> None:
    """The SDK page's Stop (chat.stop() and the cancel endpoint, as the SDK's docs ask for
    resumable streams), Regenerate (chat.regenerate()) and a reload that starts from the
    stored messages: the page shows what the worker stores."""
    from tests.e2e.test_browser import CHROMIUM, LAUNCH_ARGS

    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    why = await _npm_ready() or await _bundle(tmp_path / "chat.bundle.js")
    if why is not None:
        pytest.skip(why)
    from playwright.async_api import Route, async_playwright

    html = (AISDK / "page" / "chat.html").read_bytes()
    bundle = (tmp_path / "chat.bundle.js").read_bytes()

    async def serve(route: Route) -> None:
        if route.request.url.split("#")[0].endswith("/sdk/chat.bundle.js"):
            await route.fulfill(body=bundle, content_type="text/javascript")
        else:
            await route.fulfill(body=html, content_type="text/html")

    msgs = "els => els.map(e => [e.className, e.textContent])"
    async with (
        demo_harness.front_door(
            cluster,
            decode_tok_per_s=25,  # a reply lasts 2-4 s: a stop lands mid-reply
            engine_args=[
                "--reply-mean-tokens",
                "70",
                "--reply-min-tokens",
                "50",
                "--reply-max-tokens",
                "100",
            ],
        ) as (front_door, _stack),  # fmt: skip
        async_playwright() as pw,
    ):
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            ctx = await browser.new_context()
            await ctx.route(f"{front_door}/sdk/*", serve)
            page = await ctx.new_page()
            await page.goto(f"{front_door}/sdk/chat.html")
            await page.wait_for_function("document.body.dataset.ready === '1'", timeout=15_000)
            await page.fill("#message", "Tell me a long story")
            await page.press("#message", "Enter")
            await page.wait_for_function(
                "(document.querySelector('.msg.assistant')?.textContent || '').length > 5",
                timeout=20_000,
            )
            await page.click("#stop")
            sid = page.url.split("session=")[1].split("&")[0]
            stopped = await _terminal(cluster, sid, 1)
            assert stopped["finish_reason"] == "cancelled"
            await page.wait_for_function(
                "document.getElementById('status').textContent === 'ready'", timeout=20_000
            )
            await page.click("#regenerate")
            done = await _terminal(cluster, sid, 2)
            assert done["finish_reason"] != "cancelled"
            await page.wait_for_function(
                "document.getElementById('status').textContent === 'ready' && "
                "document.querySelectorAll('.msg.assistant').length === 1 && "
                "!document.getElementById('regenerate').hidden",
                timeout=30_000,
            )
            shown = await page.eval_on_selector_all(".msg", msgs)
            await page.reload()
            await page.wait_for_function("document.body.dataset.ready === '1'", timeout=15_000)
            reloaded = await page.eval_on_selector_all(".msg", msgs)
        finally:
            await browser.close()
    stored = [("msg " + m["role"], m["content"]) for m in await _history(cluster, sid)]
    assert [tuple(x) for x in shown] == stored
    assert [tuple(x) for x in reloaded] == stored
    assert stored[1][1] == await _reply(cluster, sid, 2)


async def _terminal(cluster: ClusterInfo, sid: str, turn: int) -> dict[str, Any]:
    """The meta of ``turn``'s done frame, once the backlog holds it."""
    from redis.asyncio.cluster import RedisCluster

    from tests.support.worker import wait_turn

    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        frames = await wait_turn(redis, sid, turn, timeout_s=30)
    finally:
        await redis.aclose()
    assert frames[-1].kind == "done", frames[-1]
    return dict(frames[-1].meta or {})


async def _history(cluster: ClusterInfo, sid: str) -> list[dict[str, Any]]:
    import json

    from redis.asyncio.cluster import RedisCluster

    from relay.protocol.keys import hist_key

    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        return [json.loads(x) for x in await redis.lrange(hist_key(sid), 0, -1)]
    finally:
        await redis.aclose()


async def _reply(cluster: ClusterInfo, sid: str, turn: int) -> str:
    """A turn's reply as the session's backlog holds it."""
    from redis.asyncio.cluster import RedisCluster

    from relay.broker.rediscluster.publisher import read_backlog
    from relay.protocol.frame import decode

    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        raw, _first, _last = await read_backlog(redis, sid, 0, 10_000)
    finally:
        await redis.aclose()
    frames = [decode(x) for x in raw]
    return "".join(f.text for f in frames if f.kind == "token" and f.turn == turn)


@pytest.mark.integration
async def test_active_turn_finds_the_running_turns_start_across_pages(redis: Any) -> None:
    """The resume point of a running turn of 700 frames (three pages of the backwards
    scan) behind a finished turn; none once it is done."""
    from relay.broker.rediscluster.broker import RedisBroker
    from relay.broker.rediscluster.publisher import Draft, Publisher
    from relay.protocol.keys import new_session_id

    active_turn = RedisBroker(redis, "ui-test").active_turn
    sid = new_session_id()
    pub = Publisher(redis)
    assert await active_turn(sid) is None  # no such session
    first = await pub.open_generation(sid)
    await first.publish([Draft(kind="meta"), Draft(kind="token", text="a")])
    await first.done({})
    assert await active_turn(sid) is None  # finished: nothing to resume
    second = await pub.open_generation(sid)
    assert await active_turn(sid) == (2, 3)  # open, no frame yet
    await second.publish([Draft(kind="meta")])
    for i in range(0, 700, 100):
        await second.publish([Draft(kind="token", text=str(j)) for j in range(i, i + 100)])
    assert await active_turn(sid) == (2, 3)  # right after turn 1's done frame
    await second.done({})
    assert await active_turn(sid) is None
