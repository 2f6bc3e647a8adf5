"""RabbitMQ load generators and probes for :mod:`bench.pubsub.mq_vs_pubsub` (loopback only).

What it is for: stream "tokens" (the same 32-byte timestamped payloads as
:mod:`bench.pubsub.resp_load`) through a real RabbitMQ broker in the two shapes a team would
build token streaming on a message queue, and measure what the broker pays:

- ``queue_per_conn``: every viewer connection declares its own exclusive, auto-delete
  queue bound to its session's routing key on a direct exchange (declared on connect,
  deleted on leave); a token is one message routed to each viewer's queue;
- ``topic``: one topic exchange and one queue per relay, bound to the routing keys of
  the sessions that relay has viewers for; the relay fans out to its own sockets.

Both use the lightest settings RabbitMQ offers: transient messages (``delivery_mode``
1), no publisher confirms, consumers with ``no_ack``, so the comparison with Pub/Sub
(fire and forget) is not loaded against the queue.

The client side is raw AMQP 0-9-1 on asyncio streams (frames built and parsed with
``pamqp``; deliveries counted by a hand-rolled frame scanner), as
:mod:`bench.pubsub.resp_load` drives Redis with raw RESP: a client library's per-message cost
would otherwise set the ceiling instead of the broker's.

Order of use::

    pid = find_broker_pid()                         # the broker's beam.smp, for CPU
    c = await Amqp.connect(url); ch = await c.open_channel()
    await c.declare_exchange(ch, name, "direct"); q = await c.declare_queue(ch)
    await c.bind(ch, q, name, key); await c.consume(ch, q)
    c.start_counting()                              # deliveries -> received, latencies
    c.write_publishes(name, keys, n)                # pre-encoded, no confirms
    await c.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from pamqp import commands, frame, header
from pamqp.body import ContentBody

from bench.pubsub.resp_load import payload

__all__ = [
    "DIRECT_EXCHANGE",
    "TOPIC_EXCHANGE",
    "Amqp",
    "AmqpError",
    "find_broker_pid",
    "routing_key",
]

DIRECT_EXCHANGE = "tokenrelay.bench.direct"
TOPIC_EXCHANGE = "tokenrelay.bench.topic"
_TS_DIGITS = 19
_FRAME_END = 0xCE
_BODY = 3
_METHOD = 1
_HDR = struct.Struct(">BHI")
_READ_CHUNK = 1 << 18
_PROPS = commands.Basic.Properties(delivery_mode=1)


class AmqpError(RuntimeError):
    """The broker closed the connection or a channel, or answered unexpectedly."""


def find_broker_pid(port: int | None = None) -> int | None:
    """The pid of the local RabbitMQ node (an Erlang VM running the ``rabbit`` app), read
    from /proc; with ``port``, the one whose node name devstack/rabbit.py gave it for that
    AMQP port, if any. None when there is none. Only read: the broker is not ours to stop."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    found: list[tuple[int, list[bytes]]] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"beam.smp") and any(b"rabbit" in a for a in argv):
            found.append((pid, argv))
    mine = f"-{port}@".encode()
    for pid, argv in found:
        if port is not None and any(mine in a for a in argv):
            return pid
    return found[0][0] if found else None


def routing_key(session: str) -> str:
    return f"s.{session}"


def _publish_frames(exchange: str, key: str, body: bytes, channel: int) -> bytes:
    return (
        frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key=key), channel)
        + frame.marshal(header.ContentHeader(0, len(body), _PROPS), channel)
        + frame.marshal(ContentBody(body), channel)
    )


@dataclass
class Amqp:
    """One AMQP connection: a handshake, then RPCs (one at a time) or, after
    :meth:`start_counting`, a reader that only counts deliveries."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    received: int = 0
    last_ns: int = 0
    record: bool = False
    latencies_ns: list[int] = field(default_factory=list)
    _buf: bytes = b""
    _channels: int = 0
    _task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, url: str, timeout_s: float = 5.0) -> Amqp:
        u = urlsplit(url)
        if u.scheme != "amqp":
            raise AmqpError(f"only amqp:// URLs are supported here, not {u.scheme}://")
        r, w = await asyncio.wait_for(
            asyncio.open_connection(u.hostname or "127.0.0.1", u.port or 5672), timeout_s
        )
        c = cls(r, w)
        try:
            await asyncio.wait_for(c._handshake(u), timeout_s)
        except BaseException:
            w.close()
            raise
        return c

    async def _handshake(self, u: Any) -> None:
        self.writer.write(frame.marshal(header.ProtocolHeader(), 0))
        await self._expect(0, commands.Connection.Start)
        user, pw = unquote(u.username or "guest"), unquote(u.password or "guest")
        self._send(0, commands.Connection.StartOk(response=f"\0{user}\0{pw}"))
        tune = await self._expect(0, commands.Connection.Tune)
        self._send(0, commands.Connection.TuneOk(tune.channel_max, 131072, 0))
        vhost = unquote(u.path[1:]) if len(u.path) > 1 else "/"
        self._send(0, commands.Connection.Open(virtual_host=vhost))
        await self._expect(0, commands.Connection.OpenOk)

    def _send(self, channel: int, value: Any) -> None:
        self.writer.write(frame.marshal(value, channel))

    async def _next_frame(self) -> tuple[int, Any]:
        while True:
            if len(self._buf) >= 7:
                try:
                    used, channel, value = frame.unmarshal(self._buf)
                except Exception:  # pamqp: not enough bytes for the frame yet
                    used = 0
                if used:
                    self._buf = self._buf[used:]
                    return channel, value
            data = await self.reader.read(_READ_CHUNK)
            if not data:
                raise AmqpError("the broker closed the connection")
            self._buf += data

    async def _expect(self, channel: int, cls: type[Any]) -> Any:
        while True:
            ch, value = await self._next_frame()
            if isinstance(value, commands.Connection.Close | commands.Channel.Close):
                raise AmqpError(f"{value.reply_code} {value.reply_text}")
            if ch == channel and isinstance(value, cls):
                return value

    async def open_channel(self) -> int:
        self._channels += 1
        self._send(self._channels, commands.Channel.Open())
        await self._expect(self._channels, commands.Channel.OpenOk)
        return self._channels

    async def declare_exchange(self, ch: int, name: str, kind: str) -> None:
        self._send(ch, commands.Exchange.Declare(exchange=name, exchange_type=kind))
        await self._expect(ch, commands.Exchange.DeclareOk)

    async def delete_exchange(self, ch: int, name: str) -> None:
        self._send(ch, commands.Exchange.Delete(exchange=name))
        await self._expect(ch, commands.Exchange.DeleteOk)

    async def declare_queue(self, ch: int) -> str:
        """A server-named, exclusive, auto-delete queue."""
        self._send(ch, commands.Queue.Declare(exclusive=True, auto_delete=True))
        ok = await self._expect(ch, commands.Queue.DeclareOk)
        return str(ok.queue)

    async def bind(self, ch: int, queue: str, exchange: str, key: str) -> None:
        self._send(ch, commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=key))
        await self._expect(ch, commands.Queue.BindOk)

    async def consume(self, ch: int, queue: str) -> str:
        self._send(ch, commands.Basic.Consume(queue=queue, no_ack=True))
        ok = await self._expect(ch, commands.Basic.ConsumeOk)
        return str(ok.consumer_tag)

    async def cancel(self, ch: int, tag: str) -> None:
        self._send(ch, commands.Basic.Cancel(consumer_tag=tag))
        await self._expect(ch, commands.Basic.CancelOk)

    async def delete_queue(self, ch: int, queue: str) -> None:
        self._send(ch, commands.Queue.Delete(queue=queue))
        await self._expect(ch, commands.Queue.DeleteOk)

    # -- publishing ---------------------------------------------------------------------
    def publish(self, ch: int, exchange: str, key: str) -> None:
        """One token now (timestamped payload)."""
        self.writer.write(_publish_frames(exchange, key, payload(time.time_ns()), ch))

    async def drain(self) -> None:
        await self.writer.drain()

    @staticmethod
    def batch(ch: int, exchange: str, keys: list[str], n: int, start: int = 0) -> bytes:
        """``n`` pre-encoded publishes round-robin over ``keys`` (one timestamp)."""
        body = payload(time.time_ns())
        return b"".join(
            _publish_frames(exchange, keys[(start + i) % len(keys)], body, ch) for i in range(n)
        )

    # -- consuming ----------------------------------------------------------------------
    def start_counting(self) -> None:
        """From now on, a reader task counts deliveries (and their latency when
        ``record``); no more RPCs on this connection."""
        self._task = asyncio.create_task(self._count())

    async def _count(self) -> None:
        buf = self._buf
        self._buf = b""
        while True:
            pos, n, end = 0, 0, len(buf)
            record = self.record
            now = time.time_ns()
            while end - pos >= 8:
                kind, _ch, size = _HDR.unpack_from(buf, pos)
                if end - pos < size + 8:
                    break
                if kind == _BODY:
                    n += 1
                    if record:
                        self.latencies_ns.append(now - int(buf[pos + 7 : pos + 7 + _TS_DIGITS]))
                elif kind == _METHOD and buf[pos + 7 : pos + 11] in (b"\x00\x14\x00\x28",):
                    raise AmqpError("the broker closed a channel")  # Channel.Close (20, 40)
                pos += size + 8
            if n:
                self.received += n
                self.last_ns = now
            buf = buf[pos:]
            data = await self.reader.read(_READ_CHUNK)
            if not data:
                return
            buf += data

    def reset(self) -> None:
        self.received = 0
        self.last_ns = 0
        self.latencies_ns = []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
