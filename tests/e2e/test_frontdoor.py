"""The demo's front door under hostile requests (hostile-suite style).

1. Process control: a cross-site POST (another ``Origin``), one without ``Origin``, one
   without or with a wrong control token all get 403 with a code and kill nothing; the
   same-origin request with this run's token does. Meanwhile a bystander session
   streams through the same front door from the real relay and worker (a
   :class:`devstack.demo.stack.Stack` of processes on the session's cluster) and receives every
   frame of both of its turns.
2. A POST is never sent twice: upstreams that take the request and die mid-request
   see it once in all and the client gets 502 with a code; a refused connection (no
   byte sent) moves on to the next upstream; a GET that fails mid-request is retried.
3. In Chromium: another site's page that posts a form and a fetch at the kill URL gets
   403 and kills nothing; the demo's page without the token asks for it; opened from
   the terminal's ``#control=`` link, its button kills, the token leaves the URL and a
   badge says control is on; a refused click is said beside the buttons, on screen.
4. Headers pass as through a reverse proxy: every end-to-end header reaches the upstream
   (repeated ones repeated), hop-by-hop ones and a client's own ``X-Forwarded-For`` do
   not; so through the door a turn POSTed with ``Accept: text/event-stream`` answers
   with its frames (the closed loop) and the OpenAI gateway's session mode
   (``X-Session-Id`` with the session's write token) streams a completion; and Durable
   Streams reach a relay through it (PUT, POST, GET, a chat session read as a stream).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.frontdoor import CONTROL_HEADER, FrontDoor, make_frontdoor_app
from devstack.demo.stack import Stack, StackSpec
from devstack.procs import free_port
from relay.durable.auth import token_subject
from relay.protocol.auth import issue_token
from tests.integration.test_redis_tls import Viewer
from tests.support import demo as demo_harness
from tests.support.http import serve as serving
from tests.support.sse import SSEClient


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_process_control_needs_same_origin_and_the_run_token(cluster: ClusterInfo) -> None:
    spec = StackSpec(relays=1, workers=1, engines=1, redis_url=cluster.url,
                     worker_args=["--max-sessions-per-address", "0"])  # fmt: skip
    async with Stack(spec) as stack:
        calls: list[tuple[str, str]] = []

        async def control(action: str, name: str) -> Any:
            if name not in stack.procs:
                raise KeyError(name)
            calls.append((action, name))
            return {"pid": stack.kill(name)}

        door = FrontDoor(
            lambda: [p.url for p in stack.of_kind("relay") if p.alive],
            lambda: [p.url for p in stack.of_kind("worker") if p.alive],
            control=control,
        )
        async with (
            serving(make_frontdoor_app(door)) as base,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        ):
            bystander = await Viewer(http, base, base).open()
            try:
                await bystander.post("the bystander's first turn", max_tokens=24)
                host = base.removeprefix("http://")
                token = door.control_token
                hostile: list[tuple[dict[str, str], str]] = [
                    ({"Origin": "http://evil.example", CONTROL_HEADER: token}, "cross_origin"),
                    ({"Origin": f"http://{host}.evil.example", CONTROL_HEADER: token},
                     "cross_origin"),
                    ({"Origin": "null", CONTROL_HEADER: token}, "cross_origin"),
                    ({CONTROL_HEADER: token}, "cross_origin"),  # no Origin at all
                    ({"Origin": base, CONTROL_HEADER: token, "Sec-Fetch-Site": "cross-site"},
                     "cross_origin"),
                    ({"Origin": base}, "bad_control_token"),
                    ({"Origin": base, CONTROL_HEADER: token[:-1]}, "bad_control_token"),
                ]  # fmt: skip
                for headers, code in hostile:
                    async with http.post(base + "/api/kill/relay-1", headers=headers) as r:
                        body = await r.json()
                    assert (r.status, body["error"]) == (403, code), (headers, body)
                    assert set(body) == {"error", "reason"}
                assert calls == []
                assert stack.procs["relay-1"].alive
                await bystander.until_done()
                await bystander.post("the bystander's second turn")
                await bystander.until_done()
                assert len(bystander.texts) == 2
                # the person at the terminal: same origin, this run's token
                same = {"Origin": base, CONTROL_HEADER: token}
                async with http.post(base + "/api/kill/nobody", headers=same) as r:
                    assert (r.status, (await r.json())["error"]) == (404, "no_such_process")
                async with http.post(base + "/api/kill/engine-1", headers=same) as r:
                    assert r.status == 200, await r.text()
                assert calls == [("kill", "engine-1")]
                assert not stack.procs["engine-1"].alive
                async with http.get(base + "/readyz") as r:  # counts, not addresses
                    assert await r.json() == {"ready": True, "relays": 1, "workers": 1}
            finally:
                bystander.close()


class Upstream:
    """A stand-in upstream: counts requests; ``die`` ones close the connection after
    reading the whole request, without an answer (a worker killed mid-request)."""

    def __init__(self, die: bool) -> None:
        self.die = die
        self.hits = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.hits += 1
        if self.die:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)  # the connection is gone; nothing is answered
        return web.json_response({"ok": True, "method": request.method}, status=201)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


async def test_a_post_is_never_sent_twice_a_refused_connection_moves_on() -> None:
    dying = [Upstream(die=True), Upstream(die=True)]
    healthy = Upstream(die=False)
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with (
        serving(dying[0].app()) as d0,
        serving(dying[1].app()) as d1,
        serving(healthy.app()) as ok,
        aiohttp.ClientSession() as http,
    ):
        workers = [d0, d1]
        door = FrontDoor(lambda: [ok], lambda: workers)
        async with serving(make_frontdoor_app(door)) as base:
            for _ in range(3):  # whichever order the door picks, one upstream sees it
                async with http.post(base + "/v1/sessions", json={}) as r:
                    body = await r.json()
                assert (r.status, body["error"]) == (502, "upstream_failed"), body
                assert set(body) == {"error", "reason"}
            assert dying[0].hits + dying[1].hits == 3
            # refused connection first, then a live worker: the POST lands there once
            workers[:] = [refused, ok]
            for _ in range(4):
                async with http.post(base + "/v1/sessions", json={}) as r:
                    assert r.status == 201, await r.text()
            assert healthy.hits == 4
            workers[:] = [refused]
            async with http.post(base + "/v1/sessions", json={}) as r:
                body = await r.json()
            assert (r.status, body["error"]) == (502, "no_upstream"), body
            assert "127.0.0.1" not in str(body)
            # a GET (a stream) that fails mid-request is idempotent: the next relay takes it
            door2 = FrontDoor(lambda: [d0, ok], lambda: [])
            async with serving(make_frontdoor_app(door2)) as base2:
                for _ in range(3):
                    async with http.get(base2 + "/v1/sessions/s1/events") as r:
                        assert r.status == 201, await r.text()


_CSRF_PAGE = """<!doctype html><html><body>
<form id="f" method="POST" action="{target}/api/kill/engine-1"></form>
<script>
  fetch("{target}/api/kill/engine-1", {{method: "POST", mode: "no-cors",
        headers: {{"X-Control-Token": "guessed"}}}}).catch(() => {{}});
  document.getElementById("f").submit();
</script></body></html>"""


@pytest.mark.browser
@pytest.mark.timeout(120)
async def test_in_a_browser_the_page_kills_with_the_token_and_another_site_cannot() -> None:
    from tests.e2e.test_browser import CHROMIUM, LAUNCH_ARGS

    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    from playwright.async_api import async_playwright

    calls: list[tuple[str, str]] = []
    view = {
        "processes": [{"name": "engine-1", "kind": "engine", "pid": 1, "alive": True, "url": ""}],
        "engines": [],
        "placements": [],
    }

    def control(action: str, name: str) -> Any:
        calls.append((action, name))
        return {"pid": 1}

    door = FrontDoor(lambda: [], lambda: [], stack_view=lambda: view, control=control)
    evil = web.Application()
    async with serving(make_frontdoor_app(door)) as base:
        page_html = _CSRF_PAGE.format(target=base)

        async def attack(request: web.Request) -> web.Response:
            return web.Response(text=page_html, content_type="text/html")

        evil.router.add_get("/", attack)
        async with serving(evil) as evil_base, async_playwright() as pw:
            evil_base = evil_base.replace("127.0.0.1", "localhost")  # another origin
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            try:
                # another site's page posts a form and a fetch at the kill button's URL
                attacker = await browser.new_page()
                async with attacker.expect_response(lambda r: "/api/kill/" in r.url) as got:
                    await attacker.goto(evil_base + "/")
                assert (await got.value).status == 403
                await asyncio.sleep(0.5)
                assert calls == []
                # the demo's page without the token asks for it; dismissed: nothing sent
                page = await browser.new_page()
                await page.goto(base + "/")
                page.once("dialog", lambda d: asyncio.ensure_future(d.dismiss()))
                await page.click("button[data-action=kill][data-name=engine-1]")
                await asyncio.sleep(0.5)
                assert calls == []
                # opened from the terminal's link: the click kills, the token leaves the URL
                await page.goto(f"{base}/#control={door.control_token}")
                await page.wait_for_function("!location.hash.includes('control=')")
                await page.click("button[data-action=kill][data-name=engine-1]")
                async with asyncio.timeout(10):
                    while not calls:
                        await asyncio.sleep(0.05)
                assert calls == [("kill", "engine-1")]
                assert door.control_token not in page.url
                # the tab says control is on; a refusal shows by the buttons, on screen
                assert await page.is_visible("#control-badge")
                await page.evaluate("sessionStorage.setItem('tokenrelay-control', 'wrong')")
                await page.click("button[data-action=kill][data-name=engine-1]")
                await page.wait_for_function(
                    "document.getElementById('control-notice').textContent.includes('refused')"
                )
                box = await page.eval_on_selector(
                    "#control-notice", "e => e.getBoundingClientRect().bottom"
                )
                assert 0 < box <= (page.viewport_size or {"height": 0})["height"], box
                assert not await page.is_visible("#control-badge")  # the token was dropped
                assert calls == [("kill", "engine-1")]
            finally:
                await browser.close()


class Echo:
    """A stand-in upstream that answers with the headers it was sent, and a few of its
    own: a repeated one, a hop-by-hop one and one its ``Connection`` names."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, str]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append(list(request.headers.items()))
        resp = web.json_response({"ok": True})
        resp.headers.add("Set-Cookie", "a=1")
        resp.headers.add("Set-Cookie", "b=2")
        resp.headers["Connection"] = "X-Upstream-Private"
        resp.headers["X-Upstream-Private"] = "1"
        resp.headers["X-Upstream-Public"] = "1"
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


async def test_end_to_end_headers_pass_hop_by_hop_ones_do_not() -> None:
    echo = Echo()
    async with serving(echo.app()) as upstream, aiohttp.ClientSession() as http:
        door = FrontDoor(lambda: [upstream], lambda: [upstream])
        async with serving(make_frontdoor_app(door)) as base:
            sent = [
                ("Accept", "text/event-stream"),
                ("X-Session-Id", "s1"),
                ("Authorization", "Bearer t"),
                ("Idempotency-Key", "k1"),
                ("Last-Event-ID", "7"),
                ("User-Agent", "newcomer/1"),
                ("X-Custom", "one"),
                ("X-Custom", "two"),
                ("Connection", "keep-alive, X-Hop-Private"),
                ("X-Hop-Private", "secret of this hop"),
                ("Keep-Alive", "timeout=5"),
                ("TE", "trailers"),
                ("X-Forwarded-For", "10.9.9.9"),  # a client's claim about its address
                ("Forwarded", "for=10.9.9.9"),
            ]
            for method, path in (
                ("POST", "/v1/sessions/s1/turns"),
                ("GET", "/v1/sessions/s1/events"),
            ):
                async with http.request(
                    method,
                    base + path,
                    headers=CIMultiDict(sent),
                    json={} if method == "POST" else None,
                ) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers.getall("Set-Cookie") == ["a=1", "b=2"]
                    assert "X-Upstream-Private" not in r.headers
                    assert r.headers["X-Upstream-Public"] == "1"
                got = echo.seen[-1]
                names = {k.lower() for k, _ in got}
                for name, value in sent[:8]:
                    assert (name, value) in got, (name, got)
                assert [v for k, v in got if k == "X-Custom"] == ["one", "two"]
                for dropped in ("x-hop-private", "keep-alive", "te", "forwarded"):
                    assert dropped not in names, got
                assert [v for k, v in got if k.lower() == "x-forwarded-for"] == ["127.0.0.1"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_through_the_door_the_closed_loop_and_the_gateway_session_mode(
    cluster: ClusterInfo,
) -> None:
    import openai

    async with (
        demo_harness.front_door(cluster, relays=1, decode_tok_per_s=400) as (base, stack),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        async with http.post(base + "/v1/sessions") as r:
            s = await r.json()
        sid, token = s["session"], s["token"]
        auth = {"Authorization": f"Bearer {token}"}
        # the closed loop: the turn's frames on the POST's own response
        async with http.post(
            f"{base}/v1/sessions/{sid}/turns",
            json={"message": "hello door", "max_tokens": 16},
            headers={**auth, "Accept": "text/event-stream"},
        ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            sse = SSEClient(r)
            kinds: list[str] = []
            async with asyncio.timeout(30):
                while not kinds or kinds[-1] not in ("done", "error"):
                    ev = await sse.next_event()
                    assert ev is not None, kinds
                    kinds.append(ev[1])
        assert kinds[-1] == "done", kinds
        assert "token" in kinds, kinds
        # the gateway's session mode: the session's write token and X-Session-Id, no
        # gateway key (this stack's workers have none)
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key=token, default_headers={"X-Session-Id": sid},
            max_retries=0,
        )  # fmt: skip
        try:
            stream = await client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": "hello gateway"}],
                stream=True, max_tokens=16,
            )  # fmt: skip
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()
        assert len(text) > 5, text
        # Durable Streams through the door to a relay: PUT, POST, GET, a session's stream
        path = f"door/{uuid.uuid4().hex}"
        now = time.time()
        write = issue_token(stack.spec.secret, token_subject(path), 300, now, scope="write")
        bearer = {"Authorization": f"Bearer {write}", "Content-Type": "text/plain"}
        url = f"{base}/v1/stream/{path}"
        async with http.put(url, headers=bearer) as r:
            assert r.status == 201, await r.text()
        async with http.post(url, headers=bearer, data=b"through the door") as r:
            assert r.status == 204, await r.text()
        async with http.get(url, params={"offset": "-1"}, headers=bearer) as r:
            assert r.status == 200, await r.text()
            assert await r.read() == b"through the door"
        watch = {"Authorization": f"Bearer {issue_token(stack.spec.secret, sid, 300, now)}"}
        async with http.get(f"{base}/v1/sessions/{sid}/stream", headers=watch) as r:
            assert r.status == 200, await r.text()
            frames = await r.json()
        assert [f["kind"] for f in frames][-1] == "done", frames
