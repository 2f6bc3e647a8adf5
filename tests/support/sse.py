"""An SSE reader for tests: the relay's events over an aiohttp response, decoded by the
project's one decoder (:class:`relay.protocol.sse_reader.SSEDecoder`).

Why not the Python client (:func:`relay.client.stream.watch`): these tests check the
relay's wire itself (the hello, the ``retry:`` hint, the ``: close <code>`` comments,
event ids, exactly what a refusal or a drain writes), which the client consumes and
hides by design. Tests of what an application sees use the client
(tests/integration/test_client.py), and so do the load test and the fault drills
(:mod:`bench.load.viewer`).

Order of use::

    client = SSEClient(resp)                     # or tests.support.relay.sse(relay, sid)
    events = await client.events(3)              # [(id, event, data as JSON), ...]
    client.hello, client.retry, client.comments, client.last_id
    client.presence                              # the presence frames, kept apart
    await client.until_end()                     # read to the end of the stream
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any

import aiohttp

from relay.protocol.sse_reader import SSEDecoder, SSEEvent

__all__ = ["STEP", "SSEClient"]

STEP = 10.0  # seconds any single expectation may take

Event = tuple[str, str, dict[str, Any]]


class SSEClient:
    """The events of one SSE response: the ``hello`` is kept apart (:attr:`hello`), and so
    are the ``presence`` frames (:attr:`presence`: outside the session's order, they come
    whenever a screen joins or leaves); every other event's data is JSON; comments
    (heartbeats, the goodbye) are collected."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.comments: list[str] = []
        self.hello: dict[str, Any] | None = None
        self.presence: list[dict[str, Any]] = []
        self._decoder = SSEDecoder(on_comment=self.comments.append)
        self._pending: deque[SSEEvent] = deque()
        self._ended = False

    @property
    def retry(self) -> int | None:
        """The last ``retry:`` hint."""
        return self._decoder.retry_ms

    @property
    def last_id(self) -> str:
        return self._decoder.last_id or ""

    def feed(self, data: bytes) -> None:
        """Bytes already read from the response (they come before what is read next);
        the presence frames among them go to :attr:`presence` at once."""
        self._take(self._decoder.feed(data))

    def _take(self, events: list[SSEEvent]) -> None:
        for ev in events:
            if ev.event == "presence":
                self.presence.append(json.loads(ev.data))
            else:
                self._pending.append(ev)

    async def events(self, n: int) -> list[Event]:
        out: list[Event] = []
        async with asyncio.timeout(STEP):
            while len(out) < n:
                ev = await self.next_event()
                assert ev is not None, f"stream ended after {len(out)} events"
                out.append(ev)
        return out

    async def next_event(self) -> Event | None:
        """The next event after the hello as (id, event, data), None at end of stream."""
        while True:
            while self._pending:
                ev = self._pending.popleft()
                if ev.event == "hello":
                    self.hello = json.loads(ev.data)
                    continue
                return ev.id or "", ev.event, json.loads(ev.data)
            if self._ended:
                return None
            chunk = await self.resp.content.readany()
            if not chunk:
                self._take(self._decoder.close())
                self._ended = True
            else:
                self.feed(chunk)

    async def until_end(self) -> None:
        async with asyncio.timeout(STEP):
            while await self.next_event() is not None:
                pass
