"""Python client: watch one session's frames from a relay, with reconnect and resume.

::

    async for frame in watch("http://relay:8000", sid, token, from_offset=0):
        if frame.kind == "token":
            print(frame.text, end="")
        elif frame.kind in ("done", "error"):
            break

Every frame once, in order, across relay restarts, drains and dropped connections: the
client reconnects with jittered exponential backoff (the relay's ``retry:`` hint as the
base; ``Retry-After`` on 503) and resumes after the last offset it yielded
(``Last-Event-ID`` over SSE, ``?from=`` over WebSocket), with the generation of that
offset (``?gen=``, once a frame told it): a session that restarted meanwhile answers
with a ``reset`` frame and its new generation from offset 1. The continuity and integrity
rules are :mod:`relay.client.core`'s: duplicates are dropped; a ``gap`` frame is yielded
and reported; holes, bad merges and a ``done`` frame whose ``chars`` / ``sha256`` do not
match the text are reported to ``on_problem``, or raise :class:`ContinuityError` when
no ``on_problem`` is given (nothing is lost silently).

Refusals: 400 / 404 / 410 (a deleted session; WebSocket close 4410) raise
:class:`WatchRefused`; 401 / 403 call ``refresh_token`` (an
async function returning a new token) and retry, or raise :class:`WatchRefused`
without one. A ``reset`` frame (the session's keys expired and restarted) is yielded,
and offsets start again at 1.

Observer hooks, for a tool that measures the relay rather than reads the session (both
None by default, and then cost nothing): ``on_delivered(frame, received)`` sees every
decoded frame as the relay sent it, before the continuity rules (duplicates and late
fills of a hole included; ``received`` is the ``time.monotonic()`` of the chunk that
carried it); ``on_state(state, info)`` sees ``connecting`` (``info.url``), ``live`` (the
relay's hello: ``info.relay``), ``reconnecting`` (``info.reason`` why the connection
ended, ``info.failed``, ``info.delay_s``, ``info.attempt``) and ``closed`` (the watch
ended). Neither changes what is yielded or raised.

Order of use: ``w = watch(...)``; ``async for frame in w``; ``w.last`` and ``w.gen``
(resume point and its generation), ``w.relay``, ``w.stats``; ``await w.aclose()`` (or
leave the loop and let the ``async with``/generator close it).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp

from relay.client.core import Continuity, Problem, backoff_s
from relay.protocol.frame import Frame, FrameError, decode
from relay.protocol.sse_reader import SSEDecoder

__all__ = [
    "ContinuityError",
    "State",
    "StateInfo",
    "Watch",
    "WatchRefused",
    "WatchStats",
    "watch",
]

Transport = Literal["sse", "ws"]
State = Literal["connecting", "live", "reconnecting", "closed"]
Relays = str | Sequence[str] | Callable[[], Sequence[str]]
_FATAL_STATUS = frozenset((400, 404, 410))  # 410: the session was deleted
_AUTH_STATUS = frozenset((401, 403))
_FATAL_WS_CLOSE = frozenset((1003, 1009, 4400, 4410))  # 4410: deleted
_CLEAN_WS_CLOSE = frozenset((None, 1000, 1001, 1012))  # normal, going away, restarting


class WatchRefused(Exception):
    """The relay refused the watch in a way a retry cannot fix (status + reason)."""


class ContinuityError(Exception):
    """Frames are missing or wrong and nobody handles it (no ``on_problem``)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.reason}: {problem.detail} "
                         f"(offsets {problem.from_offset}..{problem.to_offset})")  # fmt: skip
        self.problem = problem


@dataclass(slots=True)
class WatchStats:
    frames: int = 0
    duplicates: int = 0
    gaps: int = 0
    problems: int = 0
    reconnects: int = 0


@dataclass(frozen=True, slots=True)
class StateInfo:
    """What ``on_state`` gets with each state (see the module docstring)."""

    url: str  # the relay URL of the connection
    at: float  # time.monotonic() of the change
    relay: str | None = None  # the relay's id, once it said hello
    reason: str = ""  # reconnecting / closed: why the connection or the watch ended
    failed: bool = False  # an error, a refusal or an abnormal close, not an orderly end
    delay_s: float = 0.0  # reconnecting: the wait before the next attempt
    attempt: int = 0  # reconnecting: consecutive failed attempts so far


class _Retry(Exception):
    def __init__(self, why: str, delay_s: float | None = None, *, failed: bool = True) -> None:
        super().__init__(why)
        self.delay_s = delay_s
        self.failed = failed


class Watch:
    """The async iterator :func:`watch` returns."""

    def __init__(
        self,
        url: Relays,
        session: str,
        token: str | None,
        from_offset: int | None,
        *,
        transport: Transport,
        http: aiohttp.ClientSession | None,
        on_problem: Callable[[Problem], None] | None,
        refresh_token: Callable[[str], Awaitable[str]] | None,
        base_s: float,
        max_s: float,
        max_reconnects: int | None,
        timeout: aiohttp.ClientTimeout | None = None,
        on_delivered: Callable[[Frame, float], None] | None = None,
        on_state: Callable[[State, StateInfo], None] | None = None,
        gen: str | None = None,
        compact: bool = False,
    ) -> None:
        if transport not in ("sse", "ws"):
            raise ValueError("transport must be 'sse' or 'ws'")
        self._relays = url if callable(url) else None
        self._urls = [] if callable(url) else [url] if isinstance(url, str) else list(url)
        if self._relays is None and not self._urls:
            raise ValueError("no relay URL")
        self.url = self._urls[0].rstrip("/") if self._urls else ""  # the current relay
        self.session = session
        self.token = token
        self.transport = transport
        self.check = Continuity(from_offset, gen)
        self.stats = WatchStats()
        self.relay: str | None = None
        self._http = http
        self._on_problem = on_problem
        self._refresh = refresh_token
        self._base_s, self._max_s = base_s, max_s
        self._max_reconnects = max_reconnects
        self._timeout = timeout
        self._on_delivered = on_delivered
        self._on_state = on_state
        self._gen: AsyncGenerator[Frame, None] | None = None
        self._greeted = False  # the current connection got its hello
        self._compact = compact  # ask for a compacted join (the replay's finished turns merged)

    @property
    def last(self) -> int | None:
        """The resume point: the last offset yielded (or given)."""
        return self.check.last

    @property
    def gen(self) -> str | None:
        """The generation of the resume point (sent with it), once known."""
        return self.check.gen

    def __aiter__(self) -> AsyncGenerator[Frame, None]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()

    # -- the loop ------------------------------------------------------------------------

    async def _run(self) -> AsyncGenerator[Frame, None]:
        own = self._http is None
        http = self._http or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        attempt = 0
        ended = "closed by the caller"
        try:
            while True:
                self._greeted = False
                try:
                    self.url = self._pick()  # like an ingress: any relay will do
                    self._state("connecting")
                    reader = self._sse(http) if self.transport == "sse" else self._ws(http)
                    async for frame in reader:
                        attempt = 0
                        yield frame
                    why, delay, failed = "stream ended", None, False
                except _Retry as r:
                    why, delay, failed = str(r), r.delay_s, r.failed
                except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                    why, delay, failed = f"{type(exc).__name__}: {exc}", None, True
                if self._greeted:  # the relay took us: a new run of failures starts
                    attempt = 0
                if self._max_reconnects is not None and attempt >= self._max_reconnects:
                    raise ConnectionError(f"gave up after {attempt} reconnects: {why}")
                if delay is None:
                    delay = backoff_s(attempt, base_s=self._base_s, max_s=self._max_s)
                attempt += 1
                self.stats.reconnects += 1
                self._state("reconnecting", reason=why, failed=failed, delay_s=delay,
                            attempt=attempt)  # fmt: skip
                await asyncio.sleep(delay)
        except (Exception, asyncio.CancelledError) as exc:
            ended = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._state("closed", reason=ended)
            if own:
                await http.close()

    def _pick(self) -> str:
        urls = self._urls if self._relays is None else self._relays()
        if not urls:
            raise ConnectionError("no relay available")
        return random.choice(urls).rstrip("/")

    def _state(self, state: State, reason: str = "", *, failed: bool = False,
               delay_s: float = 0.0, attempt: int = 0) -> None:  # fmt: skip
        if self._on_state is not None:
            relay = self.relay if self._greeted else None
            info = StateInfo(self.url, time.monotonic(), relay, reason, failed, delay_s, attempt)
            self._on_state(state, info)

    def _deliver(self, frame: Frame) -> bool:
        deliver, problems = self.check.accept(frame)
        self.stats.duplicates = self.check.duplicates
        self.stats.problems = self.check.problems
        if frame.kind == "gap":
            self.stats.gaps += 1
        for p in problems:
            if self._on_problem is not None:
                self._on_problem(p)
            elif p.reason != "gap":  # a gap frame is yielded: the caller sees it
                raise ContinuityError(p)
        if deliver:
            self.stats.frames += 1
        return deliver

    def _path(self, leaf: str) -> str:
        return f"{self.url}/v1/sessions/{self.session}/{leaf}"

    async def _refused(self, status: int, body: str, retry_after: str | None) -> None:
        try:
            info = json.loads(body)
            why = f"{status} {info.get('error', '')}: {info.get('reason', '')}"
        except (ValueError, AttributeError):
            why = f"{status} {body[:200]}"
        if status in _FATAL_STATUS:
            raise WatchRefused(why)
        if status in _AUTH_STATUS:
            if self._refresh is None:
                raise WatchRefused(why)
            self.token = await self._refresh(why)
            raise _Retry(why)  # backoff as usual: a hook that keeps failing must not spin
        delay = None
        if retry_after is not None and retry_after.isdigit():
            delay = float(retry_after)
        raise _Retry(why, delay)

    async def _sse(self, http: aiohttp.ClientSession) -> AsyncIterator[Frame]:
        headers = {"Accept": "text/event-stream"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.check.last is not None:
            headers["Last-Event-ID"] = str(self.check.last)
        params = {"gen": self.check.gen} if self.check.gen else {}
        if self._compact:
            params["compact"] = "1"
        timeout = self._timeout or http.timeout
        url = self._path("events")
        async with http.get(url, headers=headers, params=params, timeout=timeout) as resp:
            if resp.status != 200:
                await self._refused(resp.status, await resp.text(), resp.headers.get("Retry-After"))
            goodbye = ["stream ended"]

            def on_comment(text: str) -> None:
                if text.startswith("close "):
                    goodbye[0] = text[6:]

            decoder = SSEDecoder(on_comment=on_comment)
            seen = self._on_delivered
            received = 0.0
            async for chunk in resp.content.iter_any():
                if seen is not None:
                    received = time.monotonic()
                events = decoder.feed(chunk)
                if decoder.retry_ms is not None:  # the hint comes before hello and goodbye
                    self._base_s = max(0.05, decoder.retry_ms / 1000)
                for ev in events:
                    if ev.event == "hello":
                        self._hello(ev.data)
                        continue
                    frame = _decode(ev.data)
                    if frame is None:
                        continue
                    if seen is not None:
                        seen(frame, received)
                    if self._deliver(frame):
                        yield frame
            raise _Retry(goodbye[0], failed=False)

    async def _ws(self, http: aiohttp.ClientSession) -> AsyncIterator[Frame]:
        params: dict[str, str] = {}
        # the token in a header, never in the URL (a URL ends up in logs)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if self.check.last is not None:
            params["from"] = str(self.check.last)
        if self.check.gen:
            params["gen"] = self.check.gen
        if self._compact:
            params["compact"] = "1"
        url = self._path("ws").replace("http", "ws", 1)
        try:
            ws = await http.ws_connect(url, params=params, headers=headers, heartbeat=30.0)
        except aiohttp.WSServerHandshakeError as exc:
            await self._refused(exc.status, exc.message, None)
            raise  # unreachable: _refused always raises
        seen = self._on_delivered
        async with ws:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                if msg.data.startswith('{"type"'):  # the hello (frames start with "v")
                    self._hello(msg.data)
                    continue
                frame = _decode(msg.data)
                if frame is None:
                    continue
                if seen is not None:
                    seen(frame, time.monotonic())
                if self._deliver(frame):
                    yield frame
            code = ws.close_code
        if code in _FATAL_WS_CLOSE:
            raise WatchRefused(f"ws close {code}")
        raise _Retry(f"ws close {code}", failed=code not in _CLEAN_WS_CLOSE)

    def _hello(self, data: str) -> None:
        self.relay = json.loads(data).get("relay")
        self._greeted = True
        self._state("live")


def _decode(data: str) -> Frame | None:
    try:
        return decode(data)
    except FrameError:
        return None  # not a frame this client understands: skipped, like the relay does


def watch(
    url: Relays,
    session: str,
    token: str | None,
    from_offset: int | None = None,
    *,
    transport: Transport = "sse",
    http: aiohttp.ClientSession | None = None,
    on_problem: Callable[[Problem], None] | None = None,
    refresh_token: Callable[[str], Awaitable[str]] | None = None,
    base_s: float = 0.25,
    max_s: float = 10.0,
    max_reconnects: int | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
    on_delivered: Callable[[Frame, float], None] | None = None,
    on_state: Callable[[State, StateInfo], None] | None = None,
    gen: str | None = None,
    compact: bool = False,
) -> Watch:
    """Watch ``session`` on the relay at ``url`` (see the module docstring); a list of
    relay URLs, or a function returning the relays up now: each (re)connect picks one at
    random.

    ``from_offset``: the last offset you already have (0 = the whole backlog, None =
    live from now; a live watch that reconnects before its first frame is live again,
    so pass an offset when nothing may be missed); ``gen``: the generation it belongs
    to (any frame's ``meta.gen``, ``w.gen`` of an earlier watch), when you know it.
    ``http``: a session to reuse (not closed). ``max_reconnects``: consecutive failed
    reconnects before :class:`ConnectionError` (None = forever). ``timeout``: for each
    SSE request (default: the session's). ``on_delivered`` / ``on_state``: observer
    hooks (module docstring). ``compact``: a compacted join (docs/PROTOCOL.md): each
    finished turn of the replay as its meta, one merged token frame and its terminal
    frame; the running turn and what is live, frame by frame.
    """
    return Watch(url, session, token, from_offset, transport=transport, http=http,
                 on_problem=on_problem, refresh_token=refresh_token, base_s=base_s,
                 max_s=max_s, max_reconnects=max_reconnects, timeout=timeout,
                 on_delivered=on_delivered, on_state=on_state, gen=gen,
                 compact=compact)  # fmt: skip
