"""A measuring viewer: one screen watching one session over SSE or WebSocket.

It behaves like a real client (resumes from the last offset it received after any
disconnect, on whichever relay it lands) and counts what the delivery guarantee
promises: frames lost, duplicated and out of order, gaps the server reported, and per
turn the time of the first token and the gaps between tokens.

Order of use::

    tally = OffsetTally()                      # pure: feed offsets, read the counts
    v = Viewer(http, relays, sid, token, transport="sse")
    task = asyncio.create_task(v.run(stop_event))
    ...; v.tally.lost, v.turn_first_token[turn], v.itl_ms
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from worker.sse import SSEDecoder

__all__ = ["OffsetTally", "Viewer", "settle_sessions"]


@dataclass
class OffsetTally:
    """Counts a stream of offsets against the promise: each once, in order, no hole."""

    last: int = 0
    frames: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    holes: set[int] = field(default_factory=set)
    gaps_reported: int = 0

    def feed(self, offset: int) -> bool:
        """Record one frame; True when it is new (not a duplicate)."""
        self.frames += 1
        if offset == self.last + 1:
            self.last = offset
            return True
        if offset <= self.last:
            if offset in self.holes:
                self.holes.discard(offset)
                self.out_of_order += 1
                return True
            self.duplicated += 1
            return False
        self.holes.update(range(self.last + 1, offset))
        self.last = offset
        return True

    def gap(self, first: int, last: int, resume_at: int) -> None:
        """The server said frames first..last are gone: reported, so not lost silently."""
        self.gaps_reported += 1
        self.holes.difference_update(range(first, last + 1))
        self.last = max(self.last, resume_at)

    def settle(self, end: int) -> int:
        """At the end of a run: frames up to ``end`` (the last offset the session is known
        to have) that never arrived are lost too, not only holes between arrivals.
        Returns how many were missing at the tail."""
        missing = max(0, end - self.last)
        self.holes.update(range(self.last + 1, end + 1))
        self.last = max(self.last, end)
        return missing

    @property
    def lost(self) -> int:
        return len(self.holes)


def settle_sessions(viewers: Sequence[Viewer]) -> int:
    """Settle every viewer against the furthest offset any viewer of its session
    received (call once the streams are idle); returns how many viewers were behind."""
    end: dict[str, int] = {}
    for v in viewers:
        end[v.sid] = max(end.get(v.sid, 0), v.tally.last)
    return sum(1 for v in viewers if v.tally.settle(end[v.sid]) > 0)


class Viewer:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        relays: Callable[[], Sequence[str]],
        sid: str,
        token: str,
        *,
        transport: str = "sse",
        start_offset: int = 0,
        on_frame: Callable[[Viewer, dict[str, Any]], None] | None = None,
    ) -> None:
        self.http = http
        self.relays = relays
        self.sid = sid
        self.token = token
        self.transport = transport
        self.tally = OffsetTally(last=start_offset)
        self.on_frame = on_frame
        self.connects = 0
        self.errors: list[str] = []
        self.relay_ids: list[str] = []
        self.turn_first_token: dict[int, float] = {}
        self.turn_done: dict[int, float] = {}
        self.turn_text: dict[int, list[str]] = {}
        self.itl_ms: list[float] = []
        self._last_token_at: dict[int, float] = {}
        self.error_frames = 0
        self.tokens = 0  # engine tokens received (a coalesced frame's meta ``n``)
        self.disconnected_at: float | None = None
        self.recoveries_ms: list[float] = []

    # -- frames -------------------------------------------------------------------
    def _frame(self, raw: bytes | str) -> None:
        frame = orjson.loads(raw)
        now = time.monotonic()
        if self.disconnected_at is not None:
            self.recoveries_ms.append((now - self.disconnected_at) * 1000)
            self.disconnected_at = None
        kind, offset = frame["kind"], int(frame["offset"])
        if kind == "gap":
            meta = frame.get("meta") or {}
            self.tally.gap(int(meta.get("from", offset)), int(meta.get("to", offset)), offset)
            return
        if not self.tally.feed(offset):
            return
        turn = int(frame.get("turn", 0))
        if kind == "token":
            self.turn_first_token.setdefault(turn, now)
            prev = self._last_token_at.get(turn)
            if prev is not None:
                self.itl_ms.append((now - prev) * 1000)
            self._last_token_at[turn] = now
            self.turn_text.setdefault(turn, []).append(frame.get("text", ""))
            self.tokens += int((frame.get("meta") or {}).get("n", 1))
        elif kind in ("done", "error"):
            self.turn_done[turn] = now
            if kind == "error":
                self.error_frames += 1
        if self.on_frame is not None:
            self.on_frame(self, frame)

    # -- transports ---------------------------------------------------------------
    def _pick(self) -> str:
        relays = list(self.relays())
        if not relays:
            raise ConnectionError("no relay available")
        return random.choice(relays)

    async def _sse(self, base: str) -> None:
        url = f"{base}/v1/sessions/{self.sid}/events"
        headers = {"Authorization": f"Bearer {self.token}", "Last-Event-ID": str(self.tally.last)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=60)
        async with self.http.get(url, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                body = await resp.text()
                raise ConnectionError(f"SSE {resp.status}: {body[:200]}")
            self.connects += 1
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                for ev in decoder.feed(chunk):
                    if ev.event == "hello":
                        self.relay_ids.append(orjson.loads(ev.data).get("relay", "?"))
                    elif ev.data:
                        self._frame(ev.data)

    async def _ws(self, base: str) -> None:
        url = f"{base.replace('http', 'ws', 1)}/v1/sessions/{self.sid}/ws"
        params = {"from": str(self.tally.last), "token": self.token}
        async with self.http.ws_connect(url, params=params, heartbeat=30) as ws:
            self.connects += 1
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                data = orjson.loads(msg.data)
                if data.get("type") == "hello":
                    self.relay_ids.append(data.get("relay", "?"))
                elif "kind" in data:
                    self._frame(msg.data)
            if ws.close_code not in (None, 1000, 1001, 1012):
                self.errors.append(f"ws close {ws.close_code}")

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set; reconnect (with resume) after any disconnect."""
        while not stop.is_set():
            try:
                base = self._pick()
                conn = self._ws(base) if self.transport == "ws" else self._sse(base)
                task = asyncio.ensure_future(conn)
                stopper = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopper.cancel()
                    if not task.done():
                        task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task  # re-raises a connection error into the except below
            except (aiohttp.ClientError, ConnectionError, OSError, TimeoutError) as exc:
                if not stop.is_set():
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            if stop.is_set():
                return
            if self.disconnected_at is None:
                self.disconnected_at = time.monotonic()
            await asyncio.sleep(0.05 + random.random() * 0.2)
