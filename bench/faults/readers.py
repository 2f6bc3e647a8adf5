"""The nemesis's readers of a session on its two other fronts, checked against Redis as
the SSE and WebSocket screens are.

- :class:`DurableReader`: the session's frames as a Durable Stream (``GET
  /v1/sessions/{sid}/stream``, long-poll from ``Stream-Next-Offset``, on any relay). Each
  frame goes through the same tally as a screen's (:meth:`bench.load.viewer.Viewer.delivered`),
  so the checker (:func:`bench.load.accounting.account`) counts it as one more screen:
  lost, duplicated, out of order, texts against the backlog, stuck.
- :class:`UiReader`: the AI SDK's UI message stream of the running turn (``GET
  /v1/sessions/{sid}/ui-stream``): 204 while no turn runs, else the turn from its first
  frame, ended by ``finish`` and ``[DONE]``; a dropped connection is read again from the
  turn's start (the SDK's resume). :func:`check_ui` compares every turn a reader saw to
  its end with the backlog's: the text of its ``text-delta`` chunks, and its finish
  (``error`` exactly when the backlog's turn ended with an ``error`` frame, or a ``gap``
  frame cut into it on the stream, which says so).

Order of use::

    d = DurableReader(http, relays, sid, token)   # a Viewer: run(stop), in run.viewers
    u = UiReader(http, relays, sid, token); await u.run(stop)
    counts = check_ui(readers, logs)              # after the checker read the backlogs
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import orjson

from bench.load.accounting import SessionLog
from bench.load.viewer import Viewer
from relay.durable.core import format_offset
from relay.protocol.frame import decode

__all__ = ["DurableReader", "UiReader", "UiTurnSeen", "check_ui"]

_raw_list = msgspec.json.Decoder(list[msgspec.Raw])


class DurableReader(Viewer):
    """A Durable Streams reader of one session's frames, counted as a screen."""

    async def _watch(self) -> None:
        """Read from the last offset counted until cancelled (a catch-up read, then
        long-polls); after a failure, again on another relay. A ``400`` (the reader
        holds offsets past the session's tail: a failover lost frames it read, and no
        writer has gone past them yet) is waited out, as the next writer's ``gap`` frame
        will pass them."""
        headers = {"Authorization": f"Bearer {self.token}"}
        connected = False
        while True:
            relays = self.relays()
            if not relays:
                await asyncio.sleep(0.2)
                continue
            base = random.choice(relays)
            params = {"offset": format_offset(self.tally.last)}
            if connected:  # the first read of a watch is a catch-up: it answers at once
                params["live"] = "long-poll"
            try:
                async with self.http.get(
                    f"{base}/v1/sessions/{self.sid}/stream", params=params, headers=headers,
                    timeout=self.TIMEOUT,
                ) as r:  # fmt: skip
                    body = await r.read()
                    status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                if self.disconnected_at is None:
                    self.disconnected_at = time.monotonic()
                connected = False
                await asyncio.sleep(0.05 + random.random() * 0.2)
                continue
            if status in (200, 204) and not connected:
                connected = True
                self.connects += 1
                self.relay_ids.append(base)
            if status == 200:
                now = time.monotonic()
                for raw in _raw_list.decode(body):
                    self.delivered(decode(bytes(raw)), now)
            elif status != 204:
                self.problems[str(status)] = self.problems.get(str(status), 0) + 1
                await asyncio.sleep(0.3)


@dataclass
class UiTurnSeen:
    """One turn a UI reader read to its end (the last reading of it)."""

    text: str
    finish: str  # the finish chunk's finishReason
    gap: bool  # an error chunk said frames were lost (a gap frame cut into the turn)
    readings: int = 1


@dataclass
class UiReader:
    """A client of the AI SDK's UI message stream of one session."""

    http: aiohttp.ClientSession
    relays: Callable[[], Sequence[str]]
    sid: str
    token: str
    turns: dict[int, UiTurnSeen] = field(default_factory=dict)
    connects: int = 0  # streams of a turn opened (200)
    cut: int = 0  # streams that ended without their turn's finish (read again)
    reread_differs: list[int] = field(default_factory=list)  # turns read twice, two ways
    errors: list[str] = field(default_factory=list)

    TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=60)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            relays = self.relays()
            if not relays:
                await asyncio.sleep(0.2)
                continue
            base = random.choice(relays)
            try:
                await self._one(base, stop)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05 + random.random() * 0.2)

    async def _one(self, base: str, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        url = f"{base}/v1/sessions/{self.sid}/ui-stream"
        async with self.http.get(url, headers=headers, timeout=self.TIMEOUT) as r:
            if r.status != 200:
                await r.read()
                await asyncio.sleep(0.1 + random.random() * 0.1)  # 204: no turn runs yet
                return
            self.connects += 1
            turn, texts, finish, gap, done = 0, [], "", False, False
            async for raw in r.content:
                if stop.is_set():
                    return
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue  # a heartbeat comment, the blank line between events
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk: dict[str, Any] = orjson.loads(data)
                kind = chunk.get("type")
                if kind == "start":
                    turn = int((chunk.get("messageMetadata") or {}).get("turn", 0))
                elif kind == "text-delta":
                    texts.append(str(chunk.get("delta", "")))
                elif kind == "error":
                    gap = gap or str(chunk.get("errorText", "")).startswith("frames ")
                elif kind == "finish":
                    finish = str(chunk.get("finishReason", ""))
            if not (done and finish and turn):
                self.cut += 1
                return
            seen = UiTurnSeen("".join(texts), finish, gap)
            before = self.turns.get(turn)
            if before is not None:
                seen.readings = before.readings + 1
                if (before.text, before.finish) != (seen.text, seen.finish):
                    self.reread_differs.append(turn)
            self.turns[turn] = seen


def check_ui(readers: Sequence[UiReader], logs: Mapping[str, SessionLog]) -> dict[str, Any]:
    """Every turn the UI readers read to its end against the backlog: ``ui_mismatches``
    (a text or a finish that is not the backlog's, or one turn read twice two ways) must be
    0; ``ui_lost_writes``: the same in a turn a writer took over after a failover with a
    skip (a ``gap`` frame inside the turn in the backlog): the stream had ended on frames
    the failover lost, so the skip's gap could not reach it (RELIABILITY.md: open);
    ``ui_turns_checked``, ``ui_gaps`` (turns a gap cut into on the stream: told, not
    compared), ``ui_cut`` (streams read again) and a few samples."""
    checked = gaps = 0
    bad: list[str] = []
    lost: list[str] = []

    def differs(log: SessionLog | None, turn: int, what: str) -> None:
        tl = log.turns.get(turn) if log is not None else None
        skipped = (
            log is not None and tl is not None and bool(tl.offsets)
            and any(min(tl.offsets) < g < max(tl.offsets) for g in log.failover_gaps)
        )  # fmt: skip
        (lost if skipped else bad).append(what)

    for u in readers:
        log = logs.get(u.sid)
        for turn in u.reread_differs:
            differs(log, turn, f"{u.sid}/{turn}: read twice, two ways")
        if log is None:
            continue
        for turn, seen in sorted(u.turns.items()):
            tl = log.turns.get(turn)
            if tl is None or not tl.complete or tl.end is None:
                continue  # not in the backlog whole: the SSE screens' checks count it
            if seen.gap:
                gaps += 1
                continue
            checked += 1
            errored = seen.finish == "error"
            if errored != (tl.end == "error") or seen.text != tl.text:
                differs(log, turn, f"{u.sid}/{turn}: UI {seen.finish} {len(seen.text)} chars, "
                                   f"backlog {tl.end} {len(tl.text)} chars")  # fmt: skip
    return {
        "ui_mismatches": len(bad),
        "ui_mismatch_samples": bad[:5],
        "ui_lost_writes": len(lost),
        "ui_lost_write_samples": lost[:5],
        "ui_turns_checked": checked,
        "ui_gaps": gaps,
        "ui_cut": sum(u.cut for u in readers),
        "ui_readers": len(readers),
    }
