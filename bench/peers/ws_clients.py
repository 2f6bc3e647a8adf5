"""The WebSocket clients of :mod:`bench.peers.socketio`: the same client for both systems,
one aiohttp WebSocket per viewer, one text message per delivered message.

- tokenrelay: ``GET /v1/sessions/{sid}/ws?token=...`` (live, no ``from``); ready once the
  relay's ``{"type":"hello",...}`` message arrived. Each later message is a frame JSON.
  Closed as a slow consumer (4008) or by a restarting relay (1012), the client does what
  the protocol tells it: reconnect with ``from=<its last offset>`` (``Tally.resumes``).
- Socket.IO: ``GET /socket.io/?EIO=4&transport=websocket&room={sid}`` with the Engine.IO
  framing done here: the server's open packet (``0{...}``), our namespace connect
  (``40``), its acknowledgement (``40{...}``); then event packets (``42["m",{...}]``), and
  a server ping (``2``) is answered with a pong (``3``).
- Socket.IO with connection state recovery (``socketio-csr``, the streams adapter's
  server): the same, keeping the session id of the namespace ack (``pid``) and the offset
  the server appends to each event; a resume sends ``40{"pid":...,"offset":...}``, and
  ``recovered`` counts the reconnects whose ack kept the same session.

Both sides carry the send time in the message text as 19 digits and ``;``
(``bench.relay.harness.STAMP``); a message may carry several (a tokenrelay frame that
merged a slow watcher's tokens) and each counts. The clock is the publisher's:
``time.time_ns`` for tokenrelay's Python publisher, CLOCK_MONOTONIC
(``time.monotonic_ns``, node's ``process.hrtime``) for the Socket.IO emitter; both are
read on the same host.

Order of use: ``tally = Tally(clock)``; ``clients = await open_clients(kind, port, sids,
tally, window)``; ... ``tally.received``, ``tally.latencies_ms(warm_s)``;
``await close_clients(clients)``.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from bench.relay.harness import SECRET, STAMP
from relay.protocol.auth import issue_token

__all__ = ["Kind", "Tally", "WsClient", "close_clients", "open_clients"]

Kind = Literal["tokenrelay", "socketio", "socketio-csr"]
_OPEN_TIMEOUT_S = 60.0
_RETRIES = 5
# the relay's close codes after which a client reconnects with its last offset (and
# loses nothing): 1012 relay_shutdown, 4008 slow_consumer (docs/PROTOCOL.md)
_RESUME_CODES = frozenset({1012, 4008})
_OFFSET = re.compile(r'"offset":(\d+)')
_STAMP = re.compile(STAMP.pattern.decode())  # the same pattern, on str
# Socket.IO's connection state recovery: the namespace ack's session id (pid), and the
# offset the server appends to every broadcast event (a Redis stream id with the streams
# adapter) as the event's last argument
_SIO_PID = re.compile(r'"pid":"([^"]+)"')
_SIO_DELAY_S = 1.0  # socket.io-client's reconnectionDelay (randomizationFactor 0.5)
_SIO_OFFSET = re.compile(r',"(\d+-\d+)"\]$')


@dataclass
class Tally:
    """What a group of clients received: every stamp's send time and arrival time."""

    clock: Callable[[], int]
    received: int = 0
    messages: int = 0
    first: float = 0.0  # perf_counter of the first and the last delivery
    last: float = 0.0
    stamps: array[int] = field(default_factory=lambda: array("q"))
    arrivals: array[int] = field(default_factory=lambda: array("q"))
    errors: list[str] = field(default_factory=list)
    retries: int = 0  # handshakes refused with 503 + Retry-After and tried again
    resumes: int = 0  # tokenrelay clients cut (slow, restart) that reconnected from their offset

    def note(self, text: str) -> bool:
        """Count the stamps of one message; False when it has none."""
        stamps = _STAMP.findall(text)
        if not stamps:
            return False
        now = self.clock()
        t = time.perf_counter()
        if self.received == 0:
            self.first = t
        self.last = t
        self.messages += 1
        self.received += len(stamps)
        for s in stamps:
            self.stamps.append(int(s))
            self.arrivals.append(now)
        return True

    def latencies_ms(self, warm_s: float) -> list[float]:
        """Sorted latencies of the messages sent ``warm_s`` or more after the first."""
        if not self.stamps:
            return []
        cut = min(self.stamps) + int(warm_s * 1e9)
        return sorted(
            (a - s) / 1e6 for s, a in zip(self.stamps, self.arrivals, strict=True) if s >= cut
        )


class WsClient:
    """One viewer: connect, wait until the server is ready to send, then count."""

    def __init__(self, kind: Kind, tally: Tally, sid: str) -> None:
        self.kind = kind
        self.tally = tally
        self.sid = sid
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.task: asyncio.Task[None] | None = None
        self.http: aiohttp.ClientSession | None = None
        self.port = 0
        self.last = ""  # the last message with a stamp: its offset is the resume point
        self.pid = ""  # Socket.IO's session id, for connection state recovery
        self.recovered = 0  # reconnects the server said it recovered (Socket.IO)

    async def open(self, http: aiohttp.ClientSession, port: int) -> None:
        self.task = asyncio.create_task(self._pump(await self._handshake(http, port, None)))

    async def _handshake(
        self, http: aiohttp.ClientSession, port: int, resume_from: int | str | None
    ) -> aiohttp.ClientWebSocketResponse:
        """Connect; return once the server will send this client its room's messages."""
        if self.kind == "tokenrelay":
            token = issue_token(SECRET, self.sid, 3600, time.time())
            url = f"ws://127.0.0.1:{port}/v1/sessions/{self.sid}/ws?token={token}"
            url += "" if resume_from is None else f"&from={resume_from}"
        else:
            url = f"ws://127.0.0.1:{port}/socket.io/?EIO=4&transport=websocket&room={self.sid}"
        async with asyncio.timeout(_OPEN_TIMEOUT_S):
            ws = self.ws = await self._connect(http, url)
            first = await ws.receive_str()
            if self.kind == "tokenrelay":
                if '"hello"' not in first:
                    raise ConnectionError(f"expected the relay's hello, got {first[:200]!r}")
            else:
                if not first.startswith("0{"):
                    raise ConnectionError(f"expected an Engine.IO open packet, got {first[:200]!r}")
                if isinstance(resume_from, str) and self.pid:  # state recovery asked
                    await ws.send_str(f'40{{"pid":"{self.pid}","offset":"{resume_from}"}}')
                else:
                    await ws.send_str("40")
                ack = await ws.receive_str()
                while self.kind == "socketio-csr" and (ack == "2" or ack.startswith("42")):
                    # a recovered session is back in its rooms before its ack is written:
                    # a broadcast (which counts) or the server's ping may come first
                    if ack == "2":
                        await ws.send_str("3")
                    elif self.tally.note(ack):
                        self.last = ack
                    ack = await ws.receive_str()
                if not ack.startswith("40"):
                    raise ConnectionError(f"expected a namespace connect ack, got {ack[:200]!r}")
                pid = _SIO_PID.search(ack)
                if pid is not None:
                    if pid.group(1) == self.pid and isinstance(resume_from, str):
                        self.recovered += 1  # the same session: the server recovered it
                    self.pid = pid.group(1)
        self.http, self.port = http, port
        return ws

    async def _connect(
        self, http: aiohttp.ClientSession, url: str
    ) -> aiohttp.ClientWebSocketResponse:
        """The handshake; a 503 with ``Retry-After`` (a busy server) is tried again after
        that many seconds, as a browser client would, up to :data:`_RETRIES` times."""
        for attempt in range(_RETRIES + 1):
            try:
                return await http.ws_connect(url, autoclose=False, max_msg_size=0)
            except aiohttp.WSServerHandshakeError as exc:
                after = exc.headers.get("Retry-After", "") if exc.headers else ""
                if exc.status != 503 or not after.isdigit() or attempt == _RETRIES:
                    raise
                self.tally.retries += 1
                await asyncio.sleep(int(after))
        raise AssertionError("unreachable")

    async def _pump(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        tally = self.tally
        pong = self.kind != "tokenrelay"
        try:
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    if pong and msg.data == "2":
                        await ws.send_str("3")
                    elif tally.note(msg.data):
                        self.last = msg.data
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    code = msg.data if msg.type == aiohttp.WSMsgType.CLOSE else ws.close_code
                    if self.kind == "tokenrelay" and code in _RESUME_CODES and self.http:
                        await ws.close()
                        found = _OFFSET.search(self.last)
                        offset = int(found.group(1)) if found else 0
                        ws = await self._handshake(self.http, self.port, offset)
                        tally.resumes += 1
                        continue
                    tally.errors.append(f"{self.kind} closed: {code} {msg.extra}")
                    return
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    tally.errors.append(f"{self.kind} error: {ws.exception()!r}")
                    return
        except (ConnectionError, OSError, TimeoutError) as exc:
            tally.errors.append(f"{type(exc).__name__}: {exc}")

    async def reconnect(self, resume: bool) -> None:
        """Drop the connection from this side and open a new one: with
        ``from=<the last offset received>`` when ``resume`` (tokenrelay, at once), with its
        session id and last offset (Socket.IO with state recovery, after the first delay
        of socket.io-client's reconnection, 0.5-1.5 s: its server keeps the session only
        once it has seen the disconnect), else live at once (what a Socket.IO client
        without state recovery gets). The resume storm of :mod:`bench.peers.pathcost`."""
        if self.http is None:
            raise RuntimeError("reconnect before open")
        await self.close()
        offset: int | str | None = None
        if resume and self.kind == "socketio-csr":
            sio = _SIO_OFFSET.search(self.last)
            offset = sio.group(1) if sio else None
            await asyncio.sleep(_SIO_DELAY_S * random.uniform(0.5, 1.5))
        elif resume:
            found = _OFFSET.search(self.last)
            offset = int(found.group(1)) if found else 0
        ws = await self._handshake(self.http, self.port, offset)
        if self.kind == "tokenrelay" and offset is not None:
            self.recovered += 1  # the relay said hello to a resume from the offset
        self.task = asyncio.create_task(self._pump(ws))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.ws is not None and not self.ws.closed:
            try:
                async with asyncio.timeout(2):
                    await self.ws.close()
            except (TimeoutError, ConnectionError, OSError):
                pass


@dataclass
class Clients:
    """Open clients and the HTTP session that holds their connections."""

    http: aiohttp.ClientSession
    items: list[WsClient]


async def open_clients(
    kind: Kind, port: int, sids: Sequence[str], tally: Tally, window: int
) -> Clients:
    """One client per entry of ``sids`` (repeat a sid for several viewers), ``window``
    handshakes at a time; raises if any fails (after closing the others)."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    clients = Clients(http, [WsClient(kind, tally, sid) for sid in sids])
    sem = asyncio.Semaphore(window)

    async def one(c: WsClient) -> None:
        async with sem:
            await c.open(http, port)

    results = await asyncio.gather(*(one(c) for c in clients.items), return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        await close_clients(clients)
        raise RuntimeError(f"{len(bad)} of {len(sids)} {kind} connections failed: {bad[0]!r}")
    return clients


async def close_clients(clients: Clients) -> None:
    await asyncio.gather(*(c.close() for c in clients.items))
    await clients.http.close()
