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
(``Last-Event-ID`` over SSE, ``?from=`` over WebSocket). The continuity and integrity
rules are :mod:`relay.client.core`'s: duplicates are dropped; a ``gap`` frame is yielded
and reported; holes, bad merges and a ``done`` frame whose ``chars`` / ``sha256`` do not
match the text are reported to ``on_problem``, or raise :class:`ContinuityError` when
no ``on_problem`` is given (nothing is lost silently).

Refusals: 400 / 404 raise :class:`WatchRefused`; 401 / 403 call ``refresh_token`` (an
async function returning a new token) and retry, or raise :class:`WatchRefused`
without one. Order of use: ``w = watch(...)``; ``async for frame in w``; ``w.last``
(resume point), ``w.relay``, ``w.stats``; ``await w.aclose()`` (or leave the loop and
let the ``async with``/generator close it).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp

from relay.client.core import Continuity, Problem, backoff_s
from relay.protocol.frame import Frame, FrameError, decode
from relay.protocol.sse_reader import SSEDecoder

__all__ = ["ContinuityError", "Watch", "WatchRefused", "WatchStats", "watch"]

Transport = Literal["sse", "ws"]
_FATAL_STATUS = frozenset((400, 404))
_AUTH_STATUS = frozenset((401, 403))
_FATAL_WS_CLOSE = frozenset((1003, 1009, 4400))


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


class _Retry(Exception):
    def __init__(self, why: str, delay_s: float | None = None) -> None:
        super().__init__(why)
        self.delay_s = delay_s


class Watch:
    """The async iterator :func:`watch` returns."""

    def __init__(
        self,
        url: str | Sequence[str],
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
    ) -> None:
        if transport not in ("sse", "ws"):
            raise ValueError("transport must be 'sse' or 'ws'")
        self._urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        if not self._urls:
            raise ValueError("no relay URL")
        self.url = self._urls[0]  # the relay of the current connection
        self.session = session
        self.token = token
        self.transport = transport
        self.check = Continuity(from_offset)
        self.stats = WatchStats()
        self.relay: str | None = None
        self._http = http
        self._on_problem = on_problem
        self._refresh = refresh_token
        self._base_s, self._max_s = base_s, max_s
        self._max_reconnects = max_reconnects
        self._gen: AsyncGenerator[Frame, None] | None = None
        self._greeted = False  # the current connection got its hello

    @property
    def last(self) -> int | None:
        """The resume point: the last offset yielded (or given)."""
        return self.check.last

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
        try:
            while True:
                self.url = random.choice(self._urls)  # like an ingress: any relay will do
                self._greeted = False
                try:
                    reader = self._sse(http) if self.transport == "sse" else self._ws(http)
                    async for frame in reader:
                        attempt = 0
                        yield frame
                    why, delay = "stream ended", None
                except _Retry as r:
                    why, delay = str(r), r.delay_s
                except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                    why, delay = f"{type(exc).__name__}: {exc}", None
                if self._greeted:  # the relay took us: a new run of failures starts
                    attempt = 0
                if self._max_reconnects is not None and attempt >= self._max_reconnects:
                    raise ConnectionError(f"gave up after {attempt} reconnects: {why}")
                if delay is None:
                    delay = backoff_s(attempt, base_s=self._base_s, max_s=self._max_s)
                attempt += 1
                self.stats.reconnects += 1
                await asyncio.sleep(delay)
        finally:
            if own:
                await http.close()

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
        async with http.get(self._path("events"), headers=headers) as resp:
            if resp.status != 200:
                await self._refused(resp.status, await resp.text(), resp.headers.get("Retry-After"))
            goodbye = ["stream ended"]

            def on_comment(text: str) -> None:
                if text.startswith("close "):
                    goodbye[0] = text[6:]

            decoder = SSEDecoder(on_comment=on_comment)
            async for chunk in resp.content.iter_any():
                events = decoder.feed(chunk)
                if decoder.retry_ms is not None:  # the hint comes before hello and goodbye
                    self._base_s = max(0.05, decoder.retry_ms / 1000)
                for ev in events:
                    if ev.event == "hello":
                        self.relay = json.loads(ev.data).get("relay")
                        self._greeted = True
                        continue
                    frame = _decode(ev.data)
                    if frame is not None and self._deliver(frame):
                        yield frame
            raise _Retry(goodbye[0])

    async def _ws(self, http: aiohttp.ClientSession) -> AsyncIterator[Frame]:
        params: dict[str, str] = {}
        if self.token:
            params["token"] = self.token
        if self.check.last is not None:
            params["from"] = str(self.check.last)
        url = self._path("ws").replace("http", "ws", 1)
        try:
            ws = await http.ws_connect(url, params=params, heartbeat=30.0)
        except aiohttp.WSServerHandshakeError as exc:
            await self._refused(exc.status, exc.message, None)
            raise  # unreachable: _refused always raises
        async with ws:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                if msg.data.startswith('{"type"'):  # the hello (frames start with "v")
                    self.relay = json.loads(msg.data).get("relay")
                    self._greeted = True
                    continue
                frame = _decode(msg.data)
                if frame is not None and self._deliver(frame):
                    yield frame
            code = ws.close_code
        if code in _FATAL_WS_CLOSE:
            raise WatchRefused(f"ws close {code}")
        raise _Retry(f"ws close {code}")


def _decode(data: str) -> Frame | None:
    try:
        return decode(data)
    except FrameError:
        return None  # not a frame this client understands: skipped, like the relay does


def watch(
    url: str | Sequence[str],
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
) -> Watch:
    """Watch ``session`` on the relay at ``url`` (see the module docstring); a list of
    relay URLs: each (re)connect picks one at random.

    ``from_offset``: the last offset you already have (0 = the whole backlog, None =
    live from now; a live watch that reconnects before its first frame is live again,
    so pass an offset when nothing may be missed). ``http``: a session to reuse (not
    closed). ``max_reconnects``: consecutive failed reconnects before
    :class:`ConnectionError` (None = forever).
    """
    return Watch(url, session, token, from_offset, transport=transport, http=http,
                 on_problem=on_problem, refresh_token=refresh_token, base_s=base_s,
                 max_s=max_s, max_reconnects=max_reconnects)  # fmt: skip
