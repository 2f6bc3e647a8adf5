"""The SSE clients of the relay benchmarks: many raw-socket viewers that count the token
stamps they receive, and a wait until every expected token has arrived.

Order of use::

    tally = Tally(record_latency=True)
    clients = await open_clients(port, sids, tally, window)   # each past the relay's hello
    ...                                                       # the publisher runs
    tally.expected = sent; await wait_all(tally)              # tally.tokens, tally.lat_ns
    close_clients(clients)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.relay.harness import SECRET, STAMP
from relay.protocol.auth import issue_token

__all__ = ["StampCounter", "Tally", "close_clients", "open_clients", "wait_all"]


@dataclass
class Tally:
    """What a group of SSE clients received."""

    expected: int = 0
    tokens: int = 0
    events: int = 0
    first: float = 0.0
    last: float = 0.0
    record_latency: bool = False
    lat_ns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class StampCounter:
    """One SSE viewer on a raw socket: counts token stamps per chunk, keeps nothing else.

    Not :func:`relay.client.watch` nor :class:`relay.protocol.sse_reader.SSEDecoder` on
    purpose: thousands of these share the benchmark's process with the measurement, on
    the same cores as the relay, so each reads raw chunks and counts stamps with one
    regex per chunk (no per-event objects, no JSON): the figures are the relay's, not
    the client's."""

    def __init__(self, tally: Tally, sid: str) -> None:
        self.tally = tally
        self.sid = sid
        self.tokens = 0
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self, port: int, last_id: int = 0) -> None:
        """Connect and read until the relay's ``hello`` event (the watch is open)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer = writer
        token = issue_token(SECRET, self.sid, 3600, time.time())
        writer.write(
            f"GET /v1/sessions/{self.sid}/events?token={token} HTTP/1.1\r\nHost: bench\r\n"
            f"Last-Event-ID: {last_id}\r\n\r\n".encode()
        )
        buf = b""
        end = -1
        async with asyncio.timeout(30):
            while end < 0:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    raise ConnectionError(f"closed before hello: {buf[:200]!r}")
                buf += chunk
                hello = buf.find(b"event: hello")
                end = -1 if hello < 0 else buf.find(b"\n\n", hello)
        if not buf.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(buf[:200].decode(errors="replace"))
        rest = buf[end + 2 :]
        self.task = asyncio.create_task(self._pump(reader, rest))

    async def _pump(self, reader: asyncio.StreamReader, carry: bytes) -> None:
        t = self.tally
        try:
            chunk = carry
            while True:
                cut = chunk.rfind(b"\n\n")
                if cut >= 0:
                    body, carry = chunk[: cut + 2], chunk[cut + 2 :]
                    stamps = STAMP.findall(body)
                    if stamps:
                        now = time.perf_counter()
                        if t.tokens == 0:
                            t.first = now
                        t.last = now
                        if t.record_latency:
                            ns = time.time_ns()
                            t.lat_ns.extend(ns - int(s) for s in stamps)
                        self.tokens += len(stamps)
                        t.tokens += len(stamps)
                        t.events += body.count(b"event: token")
                else:
                    carry = chunk
                more = await reader.read(1 << 16)
                if not more:
                    return
                chunk = carry + more
        except (ConnectionError, OSError) as exc:
            t.errors.append(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.writer is not None:
            self.writer.close()


async def open_clients(
    port: int, sids: Sequence[str], tally: Tally, window: int
) -> list[StampCounter]:
    clients = [StampCounter(tally, sid) for sid in sids]
    sem = asyncio.Semaphore(window)

    async def one(c: StampCounter) -> None:
        async with sem:
            await c.open(port)

    results = await asyncio.gather(*(one(c) for c in clients), return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        for c in clients:
            c.close()
        raise RuntimeError(f"{len(bad)} of {len(clients)} SSE connections failed: {bad[0]!r}")
    return clients


def close_clients(clients: Sequence[StampCounter]) -> None:
    for c in clients:
        c.close()


async def wait_all(tally: Tally, stall_s: float = 5.0) -> float:
    """Wait until every expected token arrived or none arrived for ``stall_s``; return
    how long the wait took (the clients' lag behind the publisher)."""
    t0 = time.perf_counter()
    seen, since = tally.tokens, t0
    while tally.tokens < tally.expected:
        await asyncio.sleep(0.05)
        now = time.perf_counter()
        if tally.tokens != seen:
            seen, since = tally.tokens, now
        elif now - since > stall_s:
            break
    return time.perf_counter() - t0
