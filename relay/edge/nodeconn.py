"""One raw pubsub connection to one Redis node, read by one task (hiredis parser).

Used by :class:`relay.edge.subscriber.ShardedSubscriber`: :class:`NodeConn` writes
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
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis

from relay.protocol.slotmap import Addr, group_by_slot
from relay.redisio.errors import RedisCommandError, RedisUnavailable

__all__ = ["MessageHandler", "NodeConn", "Spawn", "pack_command", "raw_command"]

log = logging.getLogger(__name__)

# the smessages of one read chunk, in order, each as hiredis parsed it:
# [b"smessage", channel, data]
MessageHandler = Callable[[list[list[bytes]]], None]
# starts a named task whose failure is logged (Supervisor.spawn)
Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[Any]"]


def _create_task(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
    return asyncio.create_task(coro, name=name)


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


@dataclass(eq=False)
class NodeConn:
    """One pubsub connection to one node, and the task that reads it."""

    addr: Addr
    on_message: MessageHandler
    on_unsolicited: Callable[[NodeConn, str], None]
    on_lost: Callable[[NodeConn, set[str]], None]
    spawn: Spawn = _create_task
    channels: set[str] = field(default_factory=set)  # confirmed on this connection
    alive: bool = False
    _writer: asyncio.StreamWriter | None = None
    _task: asyncio.Task[None] | None = None
    _cmds: deque[_Cmd] = field(default_factory=deque)

    async def connect(
        self, name: str, auth: Sequence[str], timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        reader, writer, parser = await _open(self.addr, timeout_s, auth, name, tls)
        self._writer = writer
        self.alive = True
        self._task = self.spawn(f"sub:{self.addr}", self._read_loop(reader, parser))

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

    async def _read_loop(self, reader: asyncio.StreamReader, parser: hiredis.Reader) -> None:
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                parser.feed(data)
                batch: list[list[bytes]] = []
                while (msg := parser.gets()) is not False:
                    if type(msg) is list and msg[0] == b"smessage":
                        batch.append(msg)
                        continue
                    if batch:  # what came before a control reply is handled before it
                        self._deliver(batch)
                        batch = []
                    try:
                        self._control(msg)
                    except Exception:  # a consumer bug must not kill the node's reader
                        log.exception("subscriber callback failed on %s", self.addr)
                if batch:
                    self._deliver(batch)
        except (OSError, hiredis.ProtocolError) as exc:
            log.warning("subscriber connection to %s failed: %r", self.addr, exc)
        except asyncio.CancelledError:
            self._drop()
            raise
        self._drop()

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._drop()
