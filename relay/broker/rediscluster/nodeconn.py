"""One raw pubsub connection to one Redis node, read in its transport's callbacks (hiredis).

Used by :class:`relay.broker.rediscluster.subscriber.ShardedSubscriber`: :class:`NodeConn` writes
``SSUBSCRIBE`` / ``SUNSUBSCRIBE`` and hands the ``smessage`` replies of each read chunk
to a synchronous callback, in one list (so that the consumer does per chunk what need
not be done per message: clocks, counters, one write per socket); confirmations resolve
futures, an unsolicited ``sunsubscribe`` (slot moved) and a lost connection are
reported to the subscriber. :func:`raw_command` runs one command on a
short-lived connection (``CLUSTER SHARDS`` for the slot map).

Order of use::

    conn = NodeConn(addr, on_message, on_unsolicited, on_lost)
    await conn.connect(name, auth, timeout_s, tls)
    futs = conn.ssubscribe({slot: [channel, ...]})   # one future per slot
    ...                                   # on_message([[b"smessage", channel, data], ...])
    conn.sunsubscribe([channel])
    await conn.close()
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis

from relay.broker.errors import RedisCommandError, RedisUnavailable
from relay.protocol.slotmap import Addr, group_by_slot

__all__ = ["MessageHandler", "NodeConn", "pack_command", "raw_command"]

log = logging.getLogger(__name__)

# the smessages of one read chunk, in order, each as hiredis parsed it:
# [b"smessage", channel, data]
MessageHandler = Callable[[list[list[bytes]]], None]


def pack_command(*args: str | bytes | int) -> bytes:
    """RESP-encode one command."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


async def _open(
    addr: Addr,
    timeout_s: float,
    auth: Sequence[str],
    name: str | None,
    tls: ssl.SSLContext | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, hiredis.Reader]:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(addr.host, addr.port, ssl=tls)
            parser = hiredis.Reader()
            hello: list[bytes] = []
            if auth:
                hello.append(pack_command("AUTH", *auth))
            if name:
                hello.append(pack_command("CLIENT", "SETNAME", name))
            if hello:
                writer.write(b"".join(hello))
                for _ in hello:
                    reply = await _read_one(reader, parser)
                    if isinstance(reply, hiredis.ReplyError):
                        writer.close()
                        raise RedisCommandError(f"{addr}: {reply}")
            return reader, writer, parser
    except (OSError, TimeoutError) as exc:
        raise RedisUnavailable(f"{addr}: {exc!r}") from exc


async def _read_one(reader: asyncio.StreamReader, parser: hiredis.Reader) -> Any:
    while True:
        reply = parser.gets()
        if reply is not False:
            return reply
        data = await reader.read(1 << 16)
        if not data:
            raise RedisUnavailable("connection closed")
        parser.feed(data)


async def raw_command(
    addr: Addr,
    *args: str | int,
    timeout_s: float = 2.0,
    auth: Sequence[str] = (),
    tls: ssl.SSLContext | None = None,
) -> Any:
    """One command on a short-lived connection (CLUSTER SHARDS for the slot map)."""
    reader, writer, parser = await _open(addr, timeout_s, auth, None, tls)
    try:
        writer.write(pack_command(*args))
        async with asyncio.timeout(timeout_s):
            reply = await _read_one(reader, parser)
    except (OSError, TimeoutError) as exc:
        raise RedisUnavailable(f"{addr}: {exc!r}") from exc
    finally:
        writer.close()
    if isinstance(reply, hiredis.ReplyError):
        raise RedisCommandError(str(reply))
    return reply


@dataclass(slots=True)
class _Cmd:
    kind: bytes  # b"ssubscribe" | b"sunsubscribe"
    remaining: dict[bytes, str]  # channels not confirmed yet: as sent, and their name
    future: asyncio.Future[None] | None


class _Feed(asyncio.Protocol):
    """A node connection's protocol once its handshake is done: each chunk the socket
    delivers is parsed and handled in the I/O callback itself (no StreamReader buffer
    copy, no future, no task wake-up per chunk)."""

    def __init__(self, conn: NodeConn, parser: hiredis.Reader) -> None:
        self._conn, self._parser = conn, parser

    def data_received(self, data: bytes) -> None:
        self._conn._received(self._parser, data)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.warning("subscriber connection to %s failed: %r", self._conn.addr, exc)
        self._conn._drop()


@dataclass(eq=False)
class NodeConn:
    """One pubsub connection to one node, read in its transport's callbacks."""

    addr: Addr
    on_message: MessageHandler
    on_unsolicited: Callable[[NodeConn, str], None]
    on_lost: Callable[[NodeConn, set[str]], None]
    channels: set[str] = field(default_factory=set)  # confirmed on this connection
    alive: bool = False
    _writer: asyncio.StreamWriter | None = None
    _cmds: deque[_Cmd] = field(default_factory=deque)

    async def connect(
        self, name: str, auth: Sequence[str], timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        _reader, writer, parser = await _open(self.addr, timeout_s, auth, name, tls)
        self._writer = writer
        self.alive = True
        # From here on the transport calls _Feed: nothing is left in the stream reader,
        # whose last read (the handshake's replies, in this same step) took all it had;
        # bytes past those replies are in the parser, which _Feed keeps using.
        writer.transport.set_protocol(_Feed(self, parser))

    def ssubscribe(self, groups: dict[int, list[str]]) -> dict[int, asyncio.Future[None]]:
        """Write one SSUBSCRIBE per slot (one write in all); a future per slot."""
        loop = asyncio.get_running_loop()
        futs: dict[int, asyncio.Future[None]] = {}
        out = []
        for slot, chans in groups.items():
            fut: asyncio.Future[None] = loop.create_future()
            futs[slot] = fut
            self._cmds.append(_Cmd(b"ssubscribe", {c.encode(): c for c in chans}, fut))
            out.append(pack_command("SSUBSCRIBE", *chans))
        self._write(b"".join(out))
        return futs

    def sunsubscribe(self, channels: Iterable[str]) -> None:
        out = []
        for chans in group_by_slot(channels).values():
            for c in chans:
                self.channels.discard(c)
            self._cmds.append(_Cmd(b"sunsubscribe", {c.encode(): c for c in chans}, None))
            out.append(pack_command("SUNSUBSCRIBE", *chans))
        if out:
            self._write(b"".join(out))

    def _write(self, data: bytes) -> None:
        if not self.alive or self._writer is None:
            raise RedisUnavailable(f"{self.addr}: connection lost")
        self._writer.write(data)

    def _received(self, parser: hiredis.Reader, data: bytes) -> None:
        """One chunk from the socket: its smessages go to ``on_message`` in one list;
        a control reply is handled in order (what came before it is delivered first)."""
        parser.feed(data)
        batch: list[list[bytes]] = []
        try:
            while (msg := parser.gets()) is not False:
                if type(msg) is list and msg[0] == b"smessage":
                    batch.append(msg)
                    continue
                if batch:
                    self._deliver(batch)
                    batch = []
                try:
                    self._control(msg)
                except Exception:  # a consumer bug must not kill the node's reader
                    log.exception("subscriber callback failed on %s", self.addr)
        except hiredis.ProtocolError as exc:
            log.warning("subscriber connection to %s failed: %r", self.addr, exc)
            if self._writer is not None:
                self._writer.transport.abort()
            self._drop()
            return
        if batch:
            self._deliver(batch)

    def _deliver(self, batch: list[list[bytes]]) -> None:
        try:
            self.on_message(batch)
        except Exception:  # a consumer bug must not kill the node's reader
            log.exception("subscriber callback failed on %s", self.addr)

    def _control(self, msg: Any) -> None:
        if isinstance(msg, hiredis.ReplyError):
            cmd = self._cmds.popleft() if self._cmds else None
            if cmd is not None and cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(RedisCommandError(str(msg)))
            return
        if not isinstance(msg, list) or len(msg) < 2:
            return
        kind, chan = msg[0], msg[1]
        head = self._cmds[0] if self._cmds else None
        solicited = head is not None and head.kind == kind and chan in head.remaining
        if kind == b"ssubscribe":  # the subscriber's own name when it asked (one str less)
            self.channels.add(head.remaining[chan] if head and solicited else chan.decode())
        if head is not None and solicited:
            del head.remaining[chan]
            if not head.remaining:
                self._cmds.popleft()
                if head.future is not None and not head.future.done():
                    head.future.set_result(None)
        elif kind == b"sunsubscribe":
            name = chan.decode()
            if name in self.channels:
                self.channels.discard(name)
                self.on_unsolicited(self, name)

    def _drop(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if self._writer is not None:
            self._writer.close()
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(RedisUnavailable(f"{self.addr}: connection lost"))
        lost, self.channels = self.channels, set()
        self.on_lost(self, lost)

    async def close(self) -> None:
        self._drop()
