"""A measuring viewer: one screen watching one session over SSE or WebSocket.

It behaves like a real client (resumes from the last offset it received after any
disconnect, on whichever relay it lands) and counts what the delivery guarantee
promises: frames lost, duplicated and out of order (a merged token frame covers the
offsets ``meta.from`` .. ``offset``), gaps the server reported, per turn the time of
the first token and the gaps between tokens, and every ``done`` frame checked against
the text the viewer assembled (``meta.tokens``, ``meta.chars``, ``meta.sha256``).
:mod:`bench.accounting` then compares each viewer with the session's backlog in Redis.

Why not :func:`relay.client.watch`: the viewer measures the delivery guarantee that the
client enforces, so it must see every frame as the relay delivered it, duplicates and
late fills of a hole included (the client drops those by design, and raises or reports
where the viewer must count), and it must time each disconnect to the next frame.
It decodes SSE with the project's one decoder (:mod:`relay.protocol.sse_reader`).

Order of use::

    tally = OffsetTally()                      # pure: feed offsets, read the counts
    v = Viewer(http, relays, sid, token, transport="sse")
    task = asyncio.create_task(v.run(stop_event))
    ...; v.tally.lost, v.turn_first_token[turn], v.itl_ms
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from relay.protocol.sse_reader import SSEDecoder

__all__ = ["OffsetTally", "Viewer", "check_done", "settle_sessions"]


@dataclass
class OffsetTally:
    """Counts a stream of offsets against the promise: each once, in order, no hole."""

    last: int = 0
    frames: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    holes: set[int] = field(default_factory=set)
    gaps_reported: int = 0

    def feed(self, offset: int, first: int | None = None) -> bool:
        """Record one frame covering ``first`` .. ``offset`` (a merged token frame covers
        several; default just ``offset``); True when it brings anything new."""
        self.frames += 1
        if first is not None and first < offset:
            return self._feed_range(first, offset)
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

    def _feed_range(self, first: int, offset: int) -> bool:
        if first == self.last + 1:
            self.last = offset
            return True
        if offset <= self.last:
            filled = self.holes.intersection(range(first, offset + 1))
            if not filled:
                self.duplicated += 1
                return False
            self.holes.difference_update(filled)
            self.out_of_order += 1
            return True
        if first > self.last + 1:
            self.holes.update(range(self.last + 1, first))
        else:  # overlaps what we had: its head is a duplicate delivery
            self.duplicated += 1
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


def check_done(meta: dict[str, Any], pieces: Sequence[str], tokens: int | None) -> list[str]:
    """What disagrees between a ``done`` frame's meta and the reply a client assembled
    (``pieces``: the turn's token texts in order; ``tokens``: the token count when known,
    ``None`` when a merged frame hid it). Empty when everything matches."""
    text = "".join(pieces)
    bad = []
    if "sha256" in meta and hashlib.sha256(text.encode()).hexdigest() != meta["sha256"]:
        bad.append("sha256")
    if "chars" in meta and len(text) != meta["chars"]:
        bad.append("chars")
    if tokens is not None and "tokens" in meta and tokens != meta["tokens"]:
        bad.append("tokens")
    return bad


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
        self.turn_tokens: dict[int, int | None] = {}  # None once a merged frame hid n
        self.gap_turns: set[int] = set()  # turns a reported gap cut into: not checkable
        self.done_checked = 0  # done frames whose tokens / chars / sha256 were checked
        self.done_mismatches: list[str] = []  # "turn N: sha256,chars"
        self._after_gap = False
        self.resets = 0  # reset frames: the session's keys expired and restarted
        self.gens: list[str] = []  # the generations a reset announced
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
        meta = frame.get("meta") or {}
        if kind == "reset":  # the session restarted: a new stream from offset 1
            self._reset(str(meta.get("gen", "")))
            if self.on_frame is not None:
                self.on_frame(self, frame)
            return
        if kind == "gap":
            self.tally.gap(int(meta.get("from", offset)), int(meta.get("to", offset)), offset)
            # which turns it cut is not known here: the ones seen so far and the next one
            self.gap_turns.update(self.turn_text)
            self._after_gap = True
            return
        merged = kind == "token" and "merged" in meta
        first = int(meta.get("from", offset)) if merged else None
        if not self.tally.feed(offset, first):
            return
        turn = int(frame.get("turn", 0))
        if self._after_gap:
            self.gap_turns.add(turn)
            self._after_gap = False
        if kind == "token":
            self.turn_first_token.setdefault(turn, now)
            prev = self._last_token_at.get(turn)
            if prev is not None:
                self.itl_ms.append((now - prev) * 1000)
            self._last_token_at[turn] = now
            self.turn_text.setdefault(turn, []).append(frame.get("text", ""))
            n = None if merged else int(meta.get("n", 1))
            self.tokens += 1 if n is None else n
            had = self.turn_tokens.get(turn, 0)
            self.turn_tokens[turn] = None if had is None or n is None else had + n
        elif kind in ("done", "error"):
            self.turn_done[turn] = now
            if kind == "error":
                self.error_frames += 1
            elif turn not in self.gap_turns:
                self.done_checked += 1
                pieces = self.turn_text.get(turn, [])
                bad = check_done(meta, pieces, self.turn_tokens.get(turn, 0))
                if bad:
                    self.done_mismatches.append(f"turn {turn}: {','.join(bad)}")
        if self.on_frame is not None:
            self.on_frame(self, frame)

    def _reset(self, gen: str) -> None:
        """Forget the old generation's offsets and texts (its keys are gone from Redis,
        so only the new one can be accounted); keep the counts."""
        self.resets += 1
        self.gens.append(gen)
        dup, ooo, frames, gaps = (
            self.tally.duplicated, self.tally.out_of_order, self.tally.frames,
            self.tally.gaps_reported,
        )  # fmt: skip
        self.tally = OffsetTally(
            frames=frames, duplicated=dup, out_of_order=ooo, gaps_reported=gaps
        )
        self.turn_text.clear()
        self.turn_tokens.clear()
        self.gap_turns.clear()
        self._after_gap = False

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
