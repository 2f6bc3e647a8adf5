"""Real browser: two screens on one session see the same complete reply, even when the
relay one of them streams from is killed mid-reply; a screen opened from the share link
watches and says why it cannot send; the page says what to do before a session exists,
keeps its counters across a switch of transport and keeps tokens out of the address bar,
out of every WebSocket URL and out of the console; the page's marks work without an
emoji font, disabled buttons look disabled, a screen without a token says so in words,
and a regenerate with the mock engines is another reply.

Headless Debian Chromium driven by Playwright (no browser download). Skips with a reason
where Chromium or Playwright is missing. Screenshots land in artifacts/browser/.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import jwt
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.stack import Stack
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode
from tests.support import demo as demo_harness

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
CHROMIUM = os.environ.get("TOKENRELAY_CHROMIUM") or shutil.which("chromium") or ""
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="module")
async def demo(cluster: ClusterInfo) -> AsyncIterator[tuple[str, Stack]]:
    """Relays, workers and slow mock engines on the session cluster, behind a front door."""
    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    async with demo_harness.front_door(
        cluster, decode_tok_per_s=20,  # a reply streams for a couple of seconds
        engine_args=["--reply-mean-tokens", "40", "--reply-max-tokens", "60"],
    ) as (url, stack):  # fmt: skip
        yield url, stack


def _watch_sockets(page: Any, urls: list[str], console: list[str]) -> None:
    """Every WebSocket URL ``page`` opens goes to ``urls``, every console line to
    ``console``: neither may carry a token (a URL is logged and repeated in Chromium's
    console when its socket fails; the page sends its token as a subprotocol)."""
    page.on("websocket", lambda ws: urls.append(ws.url))
    page.on("console", lambda msg: console.append(msg.text))


def _no_token_in(urls: list[str], console: list[str], *tokens: str) -> None:
    for u in urls:
        assert "token=" not in u, u
        assert not any(t in u for t in tokens), u
    for line in console:
        assert not any(t in line for t in tokens), line


async def _texts(page: Any) -> list[str]:
    texts: list[str] = await page.eval_on_selector_all(
        ".assistant", "els => els.map(e => e.textContent)"
    )
    return texts


async def _counter(page: Any, name: str) -> int:
    return int(await page.text_content(f"#{name}") or "0")


async def _wait_done(page: Any, turns: int, timeout_ms: int = 30_000) -> None:
    await page.wait_for_function(
        f"document.querySelectorAll('.assistant:not(.streaming)').length >= {turns}",
        timeout=timeout_ms,
    )


async def test_two_screens_see_the_same_reply_and_survive_a_relay_kill(
    demo: tuple[str, Stack], cluster: ClusterInfo
) -> None:
    from playwright.async_api import async_playwright

    url, stack = demo
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            one = await browser.new_page(viewport={"width": 1200, "height": 800})
            await one.goto(url)
            await one.click("#new-session")
            await one.wait_for_function("location.hash.includes('session=')")
            session_url = one.url
            assert "token=" not in session_url  # a copied address bar shares no token
            sid = session_url.split("session=")[1].split("&")[0]
            write = await one.evaluate(f"sessionStorage.getItem('tokenrelay-token:{sid}')")
            assert jwt.decode(write, options={"verify_signature": False})["scope"] == "write"
            # "open on another screen" carries a watch token minted for it, not ours
            await one.wait_for_function("document.getElementById('share').href !== location.href")
            share = await one.get_attribute("#share", "href") or ""
            shared = share.split("token=")[1].split("&")[0]
            claims = jwt.decode(unquote(shared), options={"verify_signature": False})
            assert claims["scope"] == "watch", claims
            assert claims["sub"] == session_url.split("session=")[1].split("&")[0]
            two = await browser.new_page(viewport={"width": 1200, "height": 800})
            sockets: list[str] = []
            console: list[str] = []
            for page in (one, two):
                _watch_sockets(page, sockets, console)
            # a link with a write token (what a collaborate link carries) may send too
            await two.goto(session_url.replace("#", f"#transport=ws&token={quote(write)}&"))
            for page in (one, two):
                await page.wait_for_function(
                    "document.getElementById('state').textContent === 'live'", timeout=15_000
                )

            # Turn 1: typed on screen one, streamed to both.
            await one.fill("#message", "Tell me about sharded pub/sub")
            await one.click("#send")
            await _wait_done(one, 1)
            await _wait_done(two, 1)
            first_one, first_two = await _texts(one), await _texts(two)
            assert first_one == first_two
            assert len(first_one[0]) > 20

            # Turn 2: kill -9 the relay screen one is on while the reply streams.
            relay_id = await one.text_content("#relay")
            await two.fill("#message", "And what happens when a relay dies?")
            await two.click("#send")
            await one.wait_for_function(
                "document.querySelectorAll('.assistant').length >= 2 && "
                "document.querySelectorAll('.assistant')[1].textContent.length > 0",
                timeout=15_000,
            )
            assert relay_id in stack.procs
            stack.kill(relay_id)
            await _wait_done(one, 2, timeout_ms=40_000)
            await _wait_done(two, 2, timeout_ms=40_000)
            await one.screenshot(path=str(ARTIFACTS / "screen-one.png"), full_page=True)
            await two.screenshot(path=str(ARTIFACTS / "screen-two.png"), full_page=True)
            texts_one, texts_two = await _texts(one), await _texts(two)
            assert texts_one == texts_two
            assert await one.text_content("#relay") != relay_id
            assert await _counter(one, "reconnects") >= 1
            for page in (one, two):
                for name in ("dups", "problems", "gaps"):
                    assert await _counter(page, name) == 0, name
            assert sockets  # screen two watched over WebSockets, and no URL held its token
            _no_token_in(sockets, console, write, unquote(shared))
        finally:
            await browser.close()
            if relay_id_alive := [p for p in stack.of_kind("relay") if not p.alive]:
                await asyncio.gather(*(stack.restart(p.name) for p in relay_id_alive))

    # What the screens show is exactly what the backlog holds.
    sid = session_url.split("session=")[1].split("&")[0]
    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        raw, _first, _last = await read_backlog(redis, sid, 0, 10_000)
    finally:
        await redis.aclose()
    replies: dict[int, str] = {}
    for data in raw:
        frame = decode(data)
        if frame.kind == "token":
            replies[frame.turn] = replies.get(frame.turn, "") + frame.text
    assert [replies[t] for t in sorted(replies)] == texts_one


async def test_a_shared_link_watches_and_the_page_says_what_it_can_do(
    demo: tuple[str, Stack],
) -> None:
    from playwright.async_api import async_playwright

    url, _stack = demo
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            one = await browser.new_page()
            missing: list[str] = []
            one.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
            await one.goto(url)
            # before a session: nothing to send to, and the page says so where one types
            assert await one.is_disabled("#send")
            assert "New session first" in (await one.get_attribute("#message", "placeholder") or "")
            await one.click("#new-session")
            await one.wait_for_function("document.getElementById('state').textContent === 'live'")
            assert await one.is_enabled("#send")
            await one.fill("#message", "count my frames")
            await one.click("#send")
            await _wait_done(one, 1)
            before = await _counter(one, "frames")
            assert before > 2
            # a switch of transport resumes where the screen was: the counters go on
            await one.select_option("#transport", "ws")
            await one.wait_for_function("document.getElementById('state').textContent === 'live'")
            assert await _counter(one, "frames") >= before
            await one.fill("#message", "and more frames")
            await one.click("#send")
            await _wait_done(one, 2)
            assert await _counter(one, "frames") > before
            assert await _counter(one, "dups") == 0
            # the share link: a watch token; that screen watches and says why it cannot send
            await one.wait_for_function("document.getElementById('share').href.includes('token=')")
            share = await one.get_attribute("#share", "href") or ""
            three = await browser.new_page()
            await three.goto(share if share.startswith("http") else url + share)
            await three.wait_for_function("document.getElementById('state').textContent === 'live'")
            assert "token=" not in three.url
            assert await three.is_disabled("#message")
            assert await three.is_disabled("#send")
            # and a disabled button looks it: not the enabled one's colour, no hand cursor
            style = "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).cursor]"
            assert await three.eval_on_selector("#send", style) != await one.eval_on_selector(
                "#send", style
            )
            assert (await three.eval_on_selector("#send", style))[1] == "not-allowed"
            why = await three.get_attribute("#message", "placeholder") or ""
            assert "only watches" in why, why
            assert "watch token" in why, why
            await _wait_done(three, 2)  # it still sees every reply
            # a screen with no token for the session says so in words, not the API's text
            sid = one.url.split("session=")[1].split("&")[0]
            four = await browser.new_page()
            await four.goto(f"{url}/#session={sid}")
            await four.wait_for_function(
                "document.getElementById('state').textContent.includes('no token')"
            )
            said = await four.text_content("#state") or ""
            assert "open the watch or collaborate link" in said, said
            for api in ("401", "token_missing", "Authorization", "?token="):
                assert api not in said, said
            assert missing == []  # no 404 on a load (no favicon request)
        finally:
            await browser.close()


@pytest.fixture(scope="module")
async def slow_demo(cluster: ClusterInfo) -> AsyncIterator[tuple[str, Stack]]:
    """The same stack with replies of 10 s or more: a screen can stop one mid-reply."""
    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    async with demo_harness.front_door(
        cluster, decode_tok_per_s=6,
        engine_args=["--reply-mean-tokens", "80", "--reply-min-tokens", "60",
                     "--reply-max-tokens", "100"],
    ) as (url, stack):  # fmt: skip
        yield url, stack


_DONE_ALL = (
    "n => document.querySelectorAll('.assistant').length === n && "
    "document.querySelectorAll('.assistant.streaming').length === 0"
)


async def _transcript(page: Any) -> list[tuple[str, str]]:
    rows: list[list[str]] = await page.eval_on_selector_all(
        ".turn .user, .turn .assistant",
        "els => els.map(e => [e.className.split(' ')[0], e.textContent])",
    )
    return [(r[0], r[1]) for r in rows]


async def test_screens_collaborate_stop_regenerate_reload_and_count_each_other(
    slow_demo: tuple[str, Stack], cluster: ClusterInfo
) -> None:
    """The article's multi-screen collaboration: screen B (a collaborate link) stops the
    reply screen A started; A regenerates it; B reloads and has the conversation at once;
    C (a watch link) cannot type and says why; every screen counts the screens; and
    every transcript is the stored history."""
    from playwright.async_api import async_playwright

    url, _stack = slow_demo
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            a = await browser.new_page(viewport={"width": 1200, "height": 800})
            await a.goto(url)
            await a.click("#new-session")
            await a.wait_for_function(
                "document.getElementById('collaborate').href.includes('token=') && "
                "document.getElementById('share').href.includes('token=')"
            )
            collaborate = await a.eval_on_selector("#collaborate", "e => e.href")
            watch_link = await a.eval_on_selector("#share", "e => e.href")
            sid = collaborate.split("session=")[1].split("&")[0]
            scopes = [
                jwt.decode(unquote(link.split("token=")[1].split("&")[0]),
                           options={"verify_signature": False})["scope"]
                for link in (collaborate, watch_link)
            ]  # fmt: skip
            assert scopes == ["write", "watch"]
            b = await browser.new_page(viewport={"width": 1200, "height": 800})
            await b.goto(collaborate)
            c = await browser.new_page(viewport={"width": 1200, "height": 800})
            sockets: list[str] = []
            console: list[str] = []
            _watch_sockets(c, sockets, console)
            await c.goto(watch_link.replace("#", "#transport=ws&"))
            pages = (a, b, c)
            for page in pages:
                await page.wait_for_function(
                    "document.getElementById('state').textContent === 'live'", timeout=15_000
                )
            for page in pages:  # every screen counts the three
                await page.wait_for_function(
                    "document.getElementById('screens').textContent === '3'", timeout=15_000
                )
            assert await c.is_disabled("#message")
            assert "only watches" in (await c.get_attribute("#message", "placeholder") or "")
            assert not await b.is_disabled("#message")

            await a.fill("#message", "Tell me a long story about shards")
            await a.click("#send")
            await b.wait_for_function(
                "(document.querySelector('.assistant')?.textContent || '').length > 3",
                timeout=20_000,
            )
            await b.wait_for_selector("#stop", state="visible")
            await b.click("#stop")  # B stops what A started
            for page in pages:
                await page.wait_for_function(
                    "document.querySelector('.assistant.stopped') !== null", timeout=10_000
                )
            stopped = await _turn_frames(cluster, sid, 1)
            assert stopped[-1].meta is not None
            assert stopped[-1].meta["finish_reason"] == "cancelled"
            # the stopped mark is text (an emoji is a box on a machine without its font)
            mark = await a.eval_on_selector(
                ".assistant.stopped", "e => getComputedStyle(e, '::after').content"
            )
            assert mark == '"stopped"', mark
            cut = await a.text_content(".assistant.stopped") or ""
            assert cut

            await a.wait_for_selector("#regenerate", state="visible")
            await a.click("#regenerate")
            for page in pages:  # turn 2 replaces turn 1 on every screen
                await page.wait_for_function(
                    _DONE_ALL + " && !document.querySelector('.assistant.stopped') && "
                    "document.querySelector('.turn').dataset.turn === '2'",
                    arg=1, timeout=40_000,
                )  # fmt: skip
            shown = [await _transcript(p) for p in pages]
            # the regenerated reply is another one (the mock engines take the turn as a
            # seed), not the stopped one's words again
            again = shown[0][1][1]
            assert not again.startswith(cut), (cut, again)
            await b.reload()
            await b.wait_for_function(_DONE_ALL, arg=1, timeout=5_000)  # at once, from the store
            reloaded = await _transcript(b)
            await c.close()  # one screen leaves: the others count two within seconds
            for page in (a, b):
                await page.wait_for_function(
                    "document.getElementById('screens').textContent === '2'", timeout=15_000
                )
            await a.screenshot(path=str(ARTIFACTS / "collaborate-a.png"), full_page=True)
            assert sockets
            watch_token = unquote(watch_link.split("token=")[1].split("&")[0])
            _no_token_in(sockets, console, watch_token)
        finally:
            await browser.close()
    stored = await _history(cluster, sid)
    want = [("user" if m["role"] == "user" else "assistant", m["content"]) for m in stored]
    assert [m["turn"] for m in stored] == [2, 2]
    assert shown == [want, want, want]
    assert reloaded == want


async def _turn_frames(cluster: ClusterInfo, sid: str, turn: int) -> list[Any]:
    from tests.support.worker import wait_turn

    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        return await wait_turn(redis, sid, turn, timeout_s=20)
    finally:
        await redis.aclose()


async def _history(cluster: ClusterInfo, sid: str) -> list[dict[str, Any]]:
    import json

    from relay.protocol.keys import hist_key

    host, port = cluster.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    try:
        return [json.loads(x) for x in await redis.lrange(hist_key(sid), 0, -1)]
    finally:
        await redis.aclose()


async def test_the_page_shows_reasoning_collapsed_and_tool_calls_with_their_results(
    demo: tuple[str, Stack], cluster: ClusterInfo
) -> None:
    """A producer of one's own writes a turn with reasoning, tool calls (arguments
    streamed in pieces), their results and a source into the page's session: the page
    shows the reasoning collapsed, each call with its arguments and its result."""
    from playwright.async_api import async_playwright

    from relay.broker.rediscluster.connect import GatedRedisCluster
    from relay.broker.rediscluster.store import RedisStore
    from relay.producer import Producer

    url, _stack = demo
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        host, port = cluster.startup_nodes[0]
        redis = GatedRedisCluster(host=host, port=port)
        await redis.initialize()
        try:
            page = await browser.new_page()
            await page.goto(url)
            await page.click("#new-session")
            await page.wait_for_function("document.getElementById('state').textContent === 'live'")
            sid = (await page.text_content("#sid") or "").strip()
            turn = (
                await Producer(RedisStore(redis)).session(sid).start_turn("weather?", watch=False)
            )
            turn.reasoning("The user wants the weather in two cities.")
            turn.write("Checking both.")
            for i, city in enumerate(["Oslo", "Rome"]):
                args = f'{{"city": "{city}"}}'
                turn.tool_call_start(f"call_{i}", "weather")
                for piece in (args[:5], args[5:]):
                    turn.tool_call_delta(f"call_{i}", piece)
                turn.tool_call_end(f"call_{i}")
                turn.tool_result(f"call_{i}", {"temp": 4 + i})
            turn.source("https://example.org/weather", title="Weather")
            await turn.done(finish_reason="tool_calls")
            await _wait_done(page, 1)
            await page.wait_for_function(
                "document.querySelectorAll('.parts .tool.called').length === 2"
            )
            reasoning = page.locator(".parts details.reasoning")
            assert await reasoning.count() == 1
            assert await reasoning.get_attribute("open") is None  # collapsed
            assert "two cities" in (await reasoning.text_content() or "")
            tools = await page.eval_on_selector_all(
                ".parts .tool", "els => els.map(e => e.textContent)"
            )
            assert tools == ['🔧 weather({"city": "Oslo"}) → {"temp":4}',
                             '🔧 weather({"city": "Rome"}) → {"temp":5}']  # fmt: skip
            assert await page.text_content(".parts a.source") == "Weather"
            assert await _counter(page, "problems") == 0
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "parts.png"), full_page=True)
        finally:
            await redis.aclose()
            await browser.close()


async def test_the_pages_tools_box_makes_its_own_turns_tool_calls(
    demo: tuple[str, Stack], cluster: ClusterInfo
) -> None:
    """With "Tools" checked, the page's own turn offers the engine two tools (the turns
    API forwards them): the mock engine answers with calls, which the page shows with
    their arguments, and the stored reply keeps them."""
    from playwright.async_api import async_playwright

    url, _stack = demo
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(url)
            await page.click("#new-session")
            await page.wait_for_function("document.getElementById('state').textContent === 'live'")
            sid = (await page.text_content("#sid") or "").strip()
            await page.check("#tools")
            await page.fill("#message", "Weather in Oslo?")
            await page.click("#send")
            await _wait_done(page, 1)
            await page.wait_for_function(
                "document.querySelectorAll('.parts .tool.called').length === 2"
            )
            tools = await page.eval_on_selector_all(
                ".parts .tool", "els => els.map(e => e.textContent.trim())"
            )
            assert tools == ['🔧 weather({"query": "Weather in Oslo?"})',
                             '🔧 clock({"query": "Weather in Oslo?"})']  # fmt: skip
            assert await _counter(page, "problems") == 0
        finally:
            await browser.close()
    stored = await _history(cluster, sid)
    calls = [p["name"] for p in stored[-1].get("parts", []) if p["type"] == "tool-call"]
    assert (stored[-1]["finish"], calls) == ("tool_calls", ["weather", "clock"])
