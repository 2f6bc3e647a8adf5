"""A measuring viewer: one screen watching one session over SSE or WebSocket, built on
the Python client (:func:`relay.client.stream.watch`).

It behaves like a real client because it is one: the client reconnects and resumes
after the last offset received, on whichever relay it lands. Through the client's
observer hooks the viewer sees every frame as the relay delivered it (``on_delivered``,
before the continuity rules, so duplicates and late fills of a hole are counted, not
dropped) and every disconnect (``on_state``), and counts what the delivery guarantee
promises: frames lost, duplicated and out of order (a merged token frame covers the
offsets ``meta.from`` .. ``offset``), gaps the server reported, per turn the time of the
first token and the gaps between tokens, the time from each disconnect to the next
frame, and every ``done`` frame checked against the text the viewer assembled
(``meta.tokens``, ``meta.chars``, ``meta.sha256``). The client's own verdicts
(``on_problem``: a hole it cannot fill, a wrong ``done`` hash) are counted in
``problems`` and never end the watch; a refusal that would end it is recorded in
``errors`` and the viewer watches again from where it was, as a screen would.
:mod:`bench.load.accounting` then compares each viewer with the session's backlog in Redis.

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
import msgspec

from relay.client.core import Problem
from relay.client.stream import State, StateInfo, Transport, WatchRefused, watch
from relay.protocol.frame import Frame

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
    # each SSE request: a quick connect, and a stream quiet for a minute is dead
    TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=60)

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
        self.transport: Transport = "ws" if transport == "ws" else "sse"
        self.tally = OffsetTally(last=start_offset)
        self.on_frame = on_frame
        self.connects = 0
        self.errors: list[str] = []
        self.relay_ids: list[str] = []
        self.problems: dict[str, int] = {}  # the client's verdicts by reason (on_problem)
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

    # -- the client's hooks -------------------------------------------------------
    def delivered(self, frame: Frame, now: float) -> None:
        """Count one frame as the relay delivered it (``on_delivered``)."""
        if self.disconnected_at is not None:
            self.recoveries_ms.append((now - self.disconnected_at) * 1000)
            self.disconnected_at = None
        kind, offset = frame.kind, frame.offset
        if kind == "presence":  # a screen count: outside the offsets, nothing to tally
            return
        meta = frame.meta or {}
        if kind == "reset":  # the session restarted: a new stream from offset 1
            self._reset(str(meta.get("gen", "")))
            self._tell(frame)
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
        turn = frame.turn
        if self._after_gap:
            self.gap_turns.add(turn)
            self._after_gap = False
        if kind == "token":
            self.turn_first_token.setdefault(turn, now)
            prev = self._last_token_at.get(turn)
            if prev is not None:
                self.itl_ms.append((now - prev) * 1000)
            self._last_token_at[turn] = now
            self.turn_text.setdefault(turn, []).append(frame.text)
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
        self._tell(frame)

    def _tell(self, frame: Frame) -> None:
        if self.on_frame is not None:
            self.on_frame(self, msgspec.structs.asdict(frame))

    def _state(self, state: State, info: StateInfo) -> None:
        if state == "live":
            self.connects += 1
            self.relay_ids.append(info.relay or "?")
        elif state == "reconnecting":
            if info.failed:
                self.errors.append(info.reason)
            if self.disconnected_at is None:
                self.disconnected_at = info.at

    def _problem(self, p: Problem) -> None:
        self.problems[p.reason] = self.problems.get(p.reason, 0) + 1

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

    # -- the watch ----------------------------------------------------------------
    async def _watch(self) -> None:
        """One watch from the last offset counted, until it ends (it reconnects by
        itself; only a refusal ends it)."""
        w = watch(
            self.relays, self.sid, self.token, self.tally.last, transport=self.transport,
            http=self.http, on_problem=self._problem, base_s=0.05, max_s=0.25,
            timeout=self.TIMEOUT, on_delivered=self.delivered, on_state=self._state,
        )  # fmt: skip
        try:
            async for _ in w:
                pass  # counted as delivered, before the client's filtering
        finally:
            await w.aclose()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set; after a refusal, watch again from where it was."""
        while not stop.is_set():
            task = asyncio.ensure_future(self._watch())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
                if not task.done():
                    task.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            except (WatchRefused, aiohttp.ClientError, OSError, TimeoutError) as exc:
                if not stop.is_set():
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            if stop.is_set():
                return
            if self.disconnected_at is None:
                self.disconnected_at = time.monotonic()
            await asyncio.sleep(0.05 + random.random() * 0.2)
