"""The least any relay must do, as a floor beside the relay's figures (the ``bare`` phase
of :mod:`bench.relay.throughput`).

``python -m bench.relay.bare URL PORT`` serves ``GET /v1/sessions/{sid}/events`` on
127.0.0.1:PORT and does only what cannot be left out: it SSUBSCRIBEs the session's
channel with the relay's own per-node hiredis reader
(:class:`relay.broker.rediscluster.subscriber.ShardedSubscriber`), and writes each message it
reads to every socket watching that channel as one SSE event (``event: token``, ``data:`` the
payload as published), one ``transport.write`` per socket per read chunk (as the relay
writes), on uvloop like the relay.

What it leaves out, and the relay does: tokens and their checks, the frame's decode and
its order (duplicates, holes, backlog reads), resume from an offset, presence, reaping,
flow control and the slow-consumer cutoff, metrics, heartbeats, HTTP parsing beyond the
request line. It answers nothing but the request above; it is a measuring stick, not a
server. Prints ``ready`` on stdout once listening; stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import cast

from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.keys import live_channel
from relay.service.runtime import run, stop_on_signals

__all__ = ["main", "serve"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Connection: keep-alive\r\n\r\nevent: hello\ndata: {}\n\n"
)


class _Viewer(asyncio.Protocol):
    """One SSE client: reads its request line, then is written to by :func:`serve`."""

    def __init__(self, attach: _Attach) -> None:
        self._attach = attach
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self.channel = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.channel or self._transport is None:
            return  # nothing more is read from a watching client
        self._buf += data
        if b"\r\n\r\n" not in self._buf:
            return
        line = self._buf.split(b"\r\n", 1)[0].split()
        path = line[1].split(b"?", 1)[0].split(b"/") if len(line) == 3 else []
        if len(path) != 5 or path[1:3] != [b"v1", b"sessions"] or path[4] != b"events":
            self._transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            self._transport.close()
            return
        self.channel = live_channel(path[3].decode()).encode()
        self._attach(self, self._transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._attach(self, None)


class _Attach:
    """The channel -> sockets map and the subscriber that fills it."""

    def __init__(self, sub: ShardedSubscriber) -> None:
        self.sub = sub
        self.socks: dict[bytes, list[asyncio.Transport]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def __call__(self, viewer: _Viewer, transport: asyncio.Transport | None) -> None:
        if transport is None:  # gone
            lst = self.socks.get(viewer.channel)
            if lst is not None and viewer._transport in lst:
                lst.remove(viewer._transport)
            return
        task = asyncio.ensure_future(self._subscribe(viewer.channel, transport))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _subscribe(self, channel: bytes, transport: asyncio.Transport) -> None:
        if channel not in self.socks:
            self.socks[channel] = []
            await self.sub.subscribe([channel.decode()])
        self.socks[channel].append(transport)
        transport.write(_HEAD)

    def on_message(self, msgs: list[list[bytes]]) -> None:
        """One read chunk: each socket's events of the chunk in one write (as the relay)."""
        socks = self.socks
        if len(msgs) == 1:
            lst = socks.get(msgs[0][1])
            if lst:
                data = b"event: token\ndata: %b\n\n" % msgs[0][2]
                for t in lst:
                    t.write(data)
            return
        out: dict[asyncio.Transport, list[bytes]] = {}
        for msg in msgs:
            lst = socks.get(msg[1])
            if lst:
                data = b"event: token\ndata: %b\n\n" % msg[2]
                for t in lst:
                    if t in out:
                        out[t].append(data)
                    else:
                        out[t] = [data]
        for t, parts in out.items():
            t.write(b"".join(parts))


async def serve(url: str, port: int) -> None:
    redis = connect(url)
    await redis.initialize()
    attach: _Attach | None = None
    sub = ShardedSubscriber(
        redis,
        on_message=lambda msgs: attach.on_message(msgs) if attach else None,
        on_resubscribed=lambda _: None,
        relay_id="bench-bare",
    )
    attach = _Attach(sub)
    await sub.start()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Viewer(attach), "127.0.0.1", port)
    try:
        async with stop_on_signals() as stop:
            print("ready", flush=True)
            await stop.wait()
    finally:
        server.close()
        for task in list(attach.tasks):
            task.cancel()
        await sub.close()
        with contextlib.suppress(Exception):
            await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        raise SystemExit("usage: python -m bench.relay.bare REDIS_URL PORT")
    run(serve(args[0], int(args[1])))


if __name__ == "__main__":
    main()
