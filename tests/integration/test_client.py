"""The Python client (relay.client.stream): its pure core, and watching a real relay on the real
cluster while the relay is killed (-9) and restarted mid-turn, over SSE and WebSocket.

The relay runs as a ``tokenrelay relay`` subprocess on a fixed port (so a restart comes
back at the same URL), stopped by pid. The producer is a bare generation of
relay.broker.rediscluster.publisher (no worker), so the relay runs with ``--reap-after-s 0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import Proc, free_port, http_ok
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.client.core import Continuity, Problem, backoff_s, check_done
from relay.client.stream import ContinuityError, State, StateInfo, WatchRefused, watch
from relay.protocol.auth import issue_token
from relay.protocol.frame import Frame, encode, reset_frame
from relay.protocol.keys import new_session_id
from tests.support.http import serve
from tests.support.worker import SECRET

# -- pure core -----------------------------------------------------------------------------


def frame(offset: int, kind: str, text: str = "", meta: dict[str, object] | None = None) -> Frame:
    return Frame(session="s", turn=1, offset=offset, kind=kind, text=text, meta=meta)  # type: ignore[arg-type]


def turn_problems(text: str, done_meta: dict[str, object]) -> list[Problem]:
    c = Continuity(0)
    frames = [frame(1, "meta")]
    frames += [frame(2 + i, "token", ch) for i, ch in enumerate(text)]
    frames.append(frame(2 + len(text), "done", meta=done_meta))
    return [p for f in frames for p in c.accept(f)[1]]


def test_done_integrity_correct_and_wrong_values() -> None:
    text = "Hello, 世界 🙂!"
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert turn_problems(text, {"tokens": 3, "chars": len(text), "sha256": digest}) == []
    assert turn_problems(text, {"tokens": 3}) == []  # absent: not checked
    wrong_chars = turn_problems(text, {"chars": len(text) + 1, "sha256": digest})
    assert [p.reason for p in wrong_chars] == ["integrity"]
    assert "chars" in wrong_chars[0].detail
    wrong_hash = turn_problems(text, {"chars": len(text), "sha256": "0" * 64})
    assert [p.reason for p in wrong_hash] == ["integrity"]
    assert "sha256" in wrong_hash[0].detail
    assert check_done(frame(9, "done", meta={"sha256": digest.upper()}), text) is None


def test_continuity_duplicates_holes_merges_gaps() -> None:
    c = Continuity(0)
    assert c.accept(frame(1, "meta")) == (True, [])
    assert c.accept(frame(2, "token", "a")) == (True, [])
    assert c.accept(frame(2, "token", "a")) == (False, [])
    assert c.duplicates == 1
    ok, problems = c.accept(frame(5, "token", "bcd", {"merged": 2, "from": 3}))
    assert ok
    assert [(p.reason, p.from_offset, p.to_offset) for p in problems] == [("merge", 3, 5)]
    ok, problems = c.accept(frame(8, "token", "x"))
    assert [(p.reason, p.from_offset, p.to_offset) for p in problems] == [("missing", 6, 7)]
    gap = Frame(session="s", turn=0, offset=20, kind="gap", text="gone", meta={"from": 9, "to": 20})
    ok, problems = c.accept(gap)
    assert ok
    assert [(p.reason, p.from_offset, p.to_offset) for p in problems] == [("gap", 9, 20)]
    assert c.last == 20
    live = Continuity(None)
    assert live.accept(frame(40, "token", "x")) == (True, [])


def test_a_reset_starts_the_offsets_again() -> None:
    c = Continuity(0)
    for off in (1, 2, 3):
        c.accept(frame(off, "token", "x"))
    assert c.accept(reset_frame("s", "B", "A")) == (True, [])
    assert c.last == 0
    assert c.accept(frame(1, "meta")) == (True, [])  # the new generation's, not a duplicate
    assert (c.duplicates, c.problems) == (0, 0)


def test_backoff_is_capped_and_jittered() -> None:
    rng = random.Random(7)
    delays = [backoff_s(3, base_s=0.1, rand=rng) for _ in range(50)]
    assert all(0.4 <= d <= 0.8 for d in delays)
    assert len(set(delays)) > 10
    assert backoff_s(40, base_s=0.1, max_s=2.0, rand=random.Random(1)) <= 2.0


# -- the observer hooks, on a scripted relay ------------------------------------------------


def sse_event(f: Frame) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (f.offset, encode(f))


@pytest.fixture
async def scripted_relay() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An SSE endpoint on loopback that sends duplicates, ends its first stream, refuses
    the next request with a 503, then resumes; records each Last-Event-ID."""
    resumes: list[str | None] = []

    async def events(request: web.Request) -> web.StreamResponse:
        resumes.append(request.headers.get("Last-Event-ID"))
        if len(resumes) == 2:
            return web.json_response({"error": "draining", "reason": "try another"},
                                     status=503, headers={"Retry-After": "0"})  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        relay = "fake-1" if len(resumes) == 1 else "fake-2"
        await resp.write(b'retry: 10\n\nevent: hello\ndata: {"relay": "%s"}\n\n' % relay.encode())
        if len(resumes) == 1:  # 2 twice, then the stream ends
            script = [frame(1, "meta"), frame(2, "token", "a"), frame(2, "token", "a"),
                      frame(3, "token", "b")]  # fmt: skip
        else:  # a replay of 3, then the rest
            script = [frame(3, "token", "b"), frame(4, "done")]
        for f in script:
            await resp.write(sse_event(f))
        return resp

    app = web.Application()
    app.router.add_get("/v1/sessions/s/events", events)
    async with serve(app) as url:
        yield url, resumes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hooked", [False, True])
async def test_hooks_see_every_delivery_and_each_reconnect(
    scripted_relay: tuple[str, list[str | None]], hooked: bool
) -> None:
    url, resumes = scripted_relay
    delivered: list[tuple[int, float]] = []
    states: list[tuple[State, StateInfo]] = []
    hooks = {"on_delivered": lambda f, at: delivered.append((f.offset, at)),
             "on_state": lambda s, i: states.append((s, i))} if hooked else {}  # fmt: skip
    t0 = time.monotonic()
    w = watch(url, "s", "t", 0, base_s=0.01, max_s=0.05, **hooks)  # type: ignore[arg-type]
    async with asyncio.timeout(10):
        text, offsets = await read_turn(w)
    await w.aclose()
    # what the client yields and enforces is the same with hooks and without
    assert (text, offsets) == ("ab", [1, 2, 3, 4])
    assert (w.stats.duplicates, w.stats.reconnects, w.stats.problems) == (2, 2, 0)
    assert resumes == ["0", "3", "3"]
    if not hooked:
        return
    assert [off for off, _ in delivered] == [1, 2, 2, 3, 3, 4]  # the duplicates too
    assert all(t0 <= at <= time.monotonic() for _, at in delivered)
    assert [s for s, _ in states] == ["connecting", "live", "reconnecting", "connecting",
                                      "reconnecting", "connecting", "live", "closed"]  # fmt: skip
    assert [i.relay for s, i in states if s == "live"] == ["fake-1", "fake-2"]
    ended, refused = (i for s, i in states if s == "reconnecting")
    assert (ended.reason, ended.failed, ended.relay) == ("stream ended", False, "fake-1")
    assert refused.reason.startswith("503 draining")
    assert refused.failed
    assert (refused.delay_s, refused.attempt, refused.relay) == (0.0, 2, None)
    assert all(i.url == url for _, i in states)


# -- a real relay, killed and restarted mid-turn ---------------------------------------------


class Relay:
    """A ``tokenrelay relay`` subprocess on a fixed port: kill -9 and start again."""

    def __init__(self, cluster: ClusterInfo, log_dir: Path) -> None:
        self.cluster, self.log_dir = cluster, log_dir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        argv = [
            sys.executable, "-m", "tokenrelay", "relay", "--port", str(self.port),
            "--redis", self.cluster.url, "--secret", SECRET,
            "--relay-id", f"client-edge-{self.starts}", "--reap-after-s", "0",
        ]  # fmt: skip
        self.proc = Proc.start(argv, log=self.log_dir / f"relay-{self.starts}.log")
        await self.proc.ready(http_ok(self.base + "/readyz"), timeout_s=30)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.stop(15)


@pytest.fixture
async def relay(cluster: ClusterInfo, tmp_path: Path) -> AsyncIterator[Relay]:
    r = Relay(cluster, tmp_path)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def produce_turn(gen: Generation, pieces: list[str], *, pause_s: float,
                       halfway: asyncio.Event, wrong_hash: bool = False) -> str:  # fmt: skip
    """A turn (meta, tokens, done with chars/sha256) published at a pace; sets
    ``halfway`` after half the tokens."""
    await gen.meta({"message": "hi"})
    for i, piece in enumerate(pieces):
        await gen.token(piece)
        if i == len(pieces) // 2:
            halfway.set()
        await asyncio.sleep(pause_s)
    text = "".join(pieces)
    digest = hashlib.sha256((text + ("x" if wrong_hash else "")).encode()).hexdigest()
    await gen.done({"tokens": len(pieces), "chars": len(text), "sha256": digest})
    return text


async def read_turn(w: AsyncIterable[Frame]) -> tuple[str, list[int]]:
    text, offsets = [], []
    async for f in w:
        if f.kind == "presence":  # a screen count, outside the offsets
            continue
        offsets.append(f.offset)
        if f.kind == "token":
            text.append(f.text)
        if f.kind in ("done", "error"):
            break
    return "".join(text), offsets


PIECES = [("tok", " é中🙂", "a\nb", ": x", "\r\n", "id: 9")[i % 6] + f"#{i}" for i in range(120)]


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_watch_survives_a_relay_restart_mid_turn(
    relay: Relay, redis: object, transport: str
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    gen = await Publisher(redis).open_generation(sid)  # type: ignore[arg-type]
    problems: list[Problem] = []
    delivered: list[int] = []
    states: list[tuple[State, StateInfo]] = []

    def seen(f: Frame, _: float) -> None:
        if f.kind != "presence":  # a screen count, outside the offsets
            delivered.append(f.offset)

    w = watch(relay.base, sid, token, 0, transport=transport,  # type: ignore[arg-type]
              on_problem=problems.append, base_s=0.1, max_s=0.5, on_delivered=seen,
              on_state=lambda s, i: states.append((s, i)))  # fmt: skip
    halfway = asyncio.Event()
    reader = asyncio.create_task(read_turn(w))
    producer = asyncio.create_task(produce_turn(gen, PIECES, pause_s=0.01, halfway=halfway))
    async with asyncio.timeout(60):
        await halfway.wait()
        await relay.kill()
        await asyncio.sleep(0.3)  # frames published while no relay runs
        await relay.start()
        sent = await producer
        got, offsets = await reader
    await w.aclose()
    assert got == sent
    assert offsets == list(range(1, len(PIECES) + 3))  # meta, tokens, done: once, in order
    assert problems == []
    assert w.stats.reconnects >= 1
    assert w.relay == "client-edge-2"
    # the hooks saw every delivery (a replay after the restart would show here) and the
    # restart: live on the first relay, the connection lost, live on the restarted one
    assert sorted(set(delivered)) == offsets
    assert len(delivered) - len(offsets) == w.stats.duplicates
    lives = [i.relay for s, i in states if s == "live"]
    assert (lives[0], lives[-1]) == ("client-edge-1", "client-edge-2")
    lost = next(i for s, i in states if s == "reconnecting")
    assert lost.relay == "client-edge-1"
    assert lost.reason
    assert states[-1][0] == "closed"


@pytest.mark.integration
async def test_a_wrong_done_hash_raises_without_a_handler(relay: Relay, redis: object) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    gen = await Publisher(redis).open_generation(sid)  # type: ignore[arg-type]
    await produce_turn(gen, PIECES[:5], pause_s=0, halfway=asyncio.Event(), wrong_hash=True)
    w = watch(relay.base, sid, token, 0)
    with pytest.raises(ContinuityError, match="integrity: sha256 differs"):
        async with asyncio.timeout(20):
            await read_turn(w)
    await w.aclose()


@pytest.mark.integration
async def test_refusals_and_token_refresh(relay: Relay) -> None:
    sid = new_session_id()
    with pytest.raises(WatchRefused, match="403 token_invalid"):
        await read_turn(watch(relay.base, sid, "forged.token"))
    with pytest.raises(WatchRefused, match="400 invalid_session"):
        await read_turn(watch(relay.base, "bad!id", "x"))
    asked: list[str] = []

    async def refresh(why: str) -> str:
        asked.append(why)
        return issue_token(SECRET, sid, 300, time.time())

    expired = issue_token(SECRET, sid, 1, time.time() - 10)
    w = watch(relay.base, sid, expired, None, refresh_token=refresh)
    it = w.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    async with asyncio.timeout(10):
        while w.relay is None:  # the refreshed token got a hello
            await asyncio.sleep(0.05)
    nxt.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await nxt
    await w.aclose()
    assert len(asked) == 1
    assert "token_expired" in asked[0]


@pytest.mark.integration
async def test_a_list_of_relays_skips_a_dead_one(relay: Relay, redis: object) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    gen = await Publisher(redis).open_generation(sid)  # type: ignore[arg-type]
    sent = await produce_turn(gen, PIECES[:20], pause_s=0, halfway=asyncio.Event())
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    w = watch([dead, relay.base], sid, token, 0, base_s=0.05, max_s=0.2)
    async with asyncio.timeout(30):
        got, offsets = await read_turn(w)
    await w.aclose()
    assert got == sent
    assert offsets == list(range(1, 23))
    assert w.url == relay.base


async def test_a_websocket_watch_sends_its_token_in_a_header_not_the_url() -> None:
    """A URL ends up in access logs: the client's WebSocket handshake carries the token
    as ``Authorization: Bearer``, as its SSE requests do."""
    seen: list[tuple[str, str]] = []

    async def ws(request: web.Request) -> web.Response:
        seen.append((request.rel_url.query_string, request.headers.get("Authorization", "")))
        return web.json_response({"error": "token_invalid", "reason": "seen"}, status=403)

    app = web.Application()
    app.router.add_get("/v1/sessions/{sid}/ws", ws)
    async with serve(app) as base:
        with pytest.raises(WatchRefused, match="403"):
            await read_turn(watch(base, "s1", "the.secret.token", 0, transport="ws"))
    assert seen, "the client never reached the relay"
    query, auth = seen[0]
    assert "secret" not in query, query
    assert auth == "Bearer the.secret.token"
