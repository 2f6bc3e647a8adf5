"""Raw-RESP load generators and probes for :mod:`bench.pubsub.cluster` (loopback only).

What it is for: drive Redis Cluster nodes as fast as a Python client can, without a
client library in the way: commands are pre-encoded RESP written to asyncio streams,
replies are parsed by ``hiredis.Reader`` (subscribers) or merely counted (publishers:
every reply to PUBLISH / SPUBLISH is one ``:<n>\\r\\n`` line).

Order of use::

    await command(host, port, "CLUSTER", "SHARDS")      # one-shot probe
    await read_counters(addrs)                           # bus + CPU counters per node
    subs = SubscriberSet(); await subs.start(plan, verb) # one connection per node
    run_publisher(spec)                                  # in a worker process, or
    await publish(spec)                                  # in this one; returns counts
    await subs.close()
    await redis_benchmark(host, port, verb, n)          # optional cross-check (C client)

A payload is 32 bytes: the send time (``time.time_ns()``, 19 digits) then padding, so a
subscriber in another process computes the end-to-end latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hiredis

from devstack.procs import Proc

__all__ = [
    "PAYLOAD_LEN",
    "Counters",
    "PublishSpec",
    "SubscriberSet",
    "command",
    "encode",
    "links_created_since",
    "payload",
    "publish",
    "read_counters",
    "redis_benchmark",
    "run_publisher",
    "warm_worker",
]

PAYLOAD_LEN = 32
_TS_DIGITS = 19
_PAD = b"." * (PAYLOAD_LEN - _TS_DIGITS)
_READ_CHUNK = 1 << 18


def encode(*parts: str | bytes) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def payload(ts_ns: int) -> bytes:
    return b"%019d" % ts_ns + _PAD


async def command(host: str, port: int, *args: str, timeout_s: float = 10.0) -> Any:
    """Send one command on a fresh connection and return the hiredis-parsed reply."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(encode(*args))
        parser = hiredis.Reader()
        while True:
            reply = parser.gets()
            if reply is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise RuntimeError(f"{host}:{port} {' '.join(args)}: {reply}")
                return reply
            data = await asyncio.wait_for(reader.read(_READ_CHUNK), timeout_s)
            if not data:
                raise ConnectionError(f"{host}:{port} closed the connection")
            parser.feed(data)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@dataclass(frozen=True)
class Counters:
    """One node's counters: cluster-bus Pub/Sub sends and CPU seconds (user + sys)."""

    publish_sent: int
    publishshard_sent: int
    cpu_s: float
    publish_received: int = 0
    publishshard_received: int = 0


def _fields(text: bytes | str) -> dict[str, str]:
    s = text.decode() if isinstance(text, bytes) else text
    return dict(ln.split(":", 1) for ln in s.splitlines() if ":" in ln and not ln.startswith("#"))


async def _node_counters(host: str, port: int) -> Counters:
    ci = _fields(await command(host, port, "CLUSTER", "INFO"))
    cpu = _fields(await command(host, port, "INFO", "cpu"))
    return Counters(
        publish_sent=int(ci.get("cluster_stats_messages_publish_sent", 0)),
        publishshard_sent=int(ci.get("cluster_stats_messages_publishshard_sent", 0)),
        cpu_s=float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        publish_received=int(ci.get("cluster_stats_messages_publish_received", 0)),
        publishshard_received=int(ci.get("cluster_stats_messages_publishshard_received", 0)),
    )


async def read_counters(addrs: list[tuple[str, int]]) -> list[Counters]:
    return list(await asyncio.gather(*(_node_counters(h, p) for h, p in addrs)))


async def links_created_since(addrs: list[tuple[str, int]], since_ms: int) -> int | None:
    """Cluster-bus links (CLUSTER LINKS, Redis >= 7.0) created after ``since_ms``: a
    link dropped and reconnected during a run loses the bus messages it held."""
    total = 0
    for host, port in addrs:
        try:
            links = await command(host, port, "CLUSTER", "LINKS")
        except (RuntimeError, OSError):
            return None
        for raw in links:
            fields = dict(zip(raw[::2], raw[1::2], strict=True))
            total += int(fields.get(b"create-time", 0)) > since_ms
    return total


# -- publishers ------------------------------------------------------------------------
@dataclass
class PublishSpec:
    """What one publisher (process or task) does.

    ``targets``: (host, port, channels) — the node each channel's messages go to.
    ``rate``: messages/s over all targets, or 0 for as fast as possible (pipelined,
    ``pipeline`` commands per batch, two batches in flight, ``conns_per_node``
    connections per target). ``start_at``: wall-clock time (``time.time()``) to begin.
    """

    verb: str
    targets: list[tuple[str, int, list[str]]]
    duration_s: float
    rate: float = 0.0
    pipeline: int = 64
    conns_per_node: int = 2
    start_at: float = 0.0


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    channels: list[bytes]
    acked: int = 0
    sent: int = 0


def _check(data: bytes, where: str) -> None:
    if b"-" in data:  # integer replies never contain '-': this is an error reply
        raise RuntimeError(f"publisher {where}: {data[:200]!r}")


async def _open(spec: PublishSpec, per_node: int) -> list[_Conn]:
    conns = []
    for host, port, channels in spec.targets:
        for _ in range(per_node):
            r, w = await asyncio.open_connection(host, port)
            conns.append(_Conn(r, w, [c.encode() for c in channels]))
    return conns


async def _wait_start(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _max_conn(c: _Conn, verb: bytes, pipeline: int, deadline: float) -> None:
    """Pipelined: keep two pre-encoded batches in flight until the deadline."""
    ts = payload(time.time_ns())
    batch = b"".join(encode(verb, c.channels[i % len(c.channels)], ts) for i in range(pipeline))
    c.writer.write(batch)
    c.writer.write(batch)
    c.sent = 2 * pipeline
    while c.acked < c.sent:
        data = await c.reader.read(_READ_CHUNK)
        if not data:
            raise ConnectionError("publisher connection closed")
        _check(data, "max")
        c.acked += data.count(b"\n")
        if c.sent - c.acked <= pipeline and time.monotonic() < deadline:
            c.writer.write(batch)
            c.sent += pipeline
            await c.writer.drain()


async def _fixed(conns: list[_Conn], verb: bytes, rate: float, duration_s: float) -> None:
    """Paced: every millisecond, send what is due, round-robin over all channels."""
    order = [(c, ch) for c in conns for ch in c.channels]
    order.sort(key=lambda t: t[1])  # interleave nodes

    async def drain_replies(c: _Conn) -> None:
        while True:
            data = await c.reader.read(_READ_CHUNK)
            if not data:
                return
            _check(data, "fixed")
            c.acked += data.count(b"\n")

    readers = [asyncio.create_task(drain_replies(c)) for c in conns]
    t0 = time.monotonic()
    total = int(rate * duration_s)
    sent = 0
    i = 0
    while sent < total:
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        while sent < due:
            c, ch = order[i % len(order)]
            i += 1
            c.writer.write(encode(verb, ch, payload(time.time_ns())))
            c.sent += 1
            sent += 1
        await asyncio.sleep(0.001)
    deadline = time.monotonic() + 10
    while sum(c.acked for c in conns) < sent and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    for t in readers:
        t.cancel()
    await asyncio.gather(*readers, return_exceptions=True)


async def publish(spec: PublishSpec) -> dict[str, float]:
    """Run one publisher; returns ``{"published", "t_start", "t_end"}`` (acked, wall)."""
    per_node = spec.conns_per_node if spec.rate <= 0 else 1
    conns = await _open(spec, per_node)
    verb = spec.verb.encode()
    try:
        await _wait_start(spec.start_at)
        t_start = time.time()
        if spec.rate > 0:
            await _fixed(conns, verb, spec.rate, spec.duration_s)
        else:
            deadline = time.monotonic() + spec.duration_s
            await asyncio.gather(*(_max_conn(c, verb, spec.pipeline, deadline) for c in conns))
        t_end = time.time()
    finally:
        for c in conns:
            c.writer.close()
    return {"published": float(sum(c.acked for c in conns)), "t_start": t_start, "t_end": t_end}


def run_publisher(spec: PublishSpec) -> dict[str, float]:
    """Process-pool entry point: one event loop per worker process, bounded in time
    (a node that stops answering cannot hold the worker, or the pool's shutdown)."""
    limit = max(0.0, spec.start_at - time.time()) + spec.duration_s + 30.0

    async def bounded() -> dict[str, float]:
        return await asyncio.wait_for(publish(spec), limit)

    try:
        import uvloop

        return uvloop.run(bounded())
    except ImportError:
        return asyncio.run(bounded())


def warm_worker(hold_s: float) -> int:
    """Process-pool warm-up: import what a publisher needs and hold the worker busy,
    so that N concurrent calls start N worker processes before any measurement."""
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401
    time.sleep(hold_s)
    return 0


# -- subscribers -----------------------------------------------------------------------
@dataclass
class SubscriberSet:
    """One subscriber connection per node, each subscribed to its planned channels.

    ``received`` counts messages since the last :meth:`reset`; while ``record`` is true
    every message's latency (ns, chunk arrival minus payload time) is kept, in
    ``local_ns`` when the subscriber sits on the node the message was published to
    (``local`` in :meth:`start`), else in ``bus_ns`` (it crossed the cluster bus).
    """

    received: int = 0
    last_ns: int = 0
    record: bool = False
    local_ns: list[int] = field(default_factory=list)
    bus_ns: list[int] = field(default_factory=list)
    disconnects: int = 0
    unsolicited: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def reset(self) -> None:
        self.received = 0
        self.last_ns = 0
        self.local_ns = []
        self.bus_ns = []

    async def start(
        self,
        plan: dict[tuple[str, int], list[str]],
        verb: str,
        local: dict[tuple[str, int], set[str]] | None = None,
    ) -> None:
        """Subscribe (one command per channel: SSUBSCRIBE channels must share a slot).
        ``local``: per node, the channels whose publisher writes to that very node."""
        local = local or {}
        ready = [
            self._subscribe(h, p, chans, verb, {c.encode() for c in local.get((h, p), ())})
            for (h, p), chans in plan.items()
            if chans
        ]
        await asyncio.gather(*ready)

    async def _subscribe(
        self, host: str, port: int, channels: list[str], verb: str, local: set[bytes]
    ) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        self._writers.append(writer)
        writer.write(b"".join(encode(verb, ch) for ch in channels))
        parser = hiredis.Reader()
        confirmed = 0
        while confirmed < len(channels):
            data = await asyncio.wait_for(reader.read(_READ_CHUNK), 10)
            if not data:
                raise ConnectionError(f"{host}:{port} closed during {verb}")
            parser.feed(data)
            while (m := parser.gets()) is not False:
                if isinstance(m, hiredis.ReplyError):
                    raise RuntimeError(f"{verb} on {host}:{port}: {m}")
                confirmed += 1
        self._tasks.append(asyncio.create_task(self._read(reader, parser, local)))

    async def _read(self, reader: asyncio.StreamReader, parser: Any, local: set[bytes]) -> None:
        while True:
            data = await reader.read(_READ_CHUNK)
            if not data:
                self.disconnects += 1
                return
            now = time.time_ns()
            parser.feed(data)
            n = 0
            record = self.record
            while (m := parser.gets()) is not False:
                if m[0] == b"message" or m[0] == b"smessage":
                    n += 1
                    if record:
                        lat = self.local_ns if m[1] in local else self.bus_ns
                        lat.append(now - int(m[2][:_TS_DIGITS]))
                else:
                    self.unsolicited += 1  # e.g. a server-pushed sunsubscribe
            self.received += n
            self.last_ns = now

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            w.close()
        self._tasks.clear()
        self._writers.clear()


# -- cross-check with redis-benchmark (C client, no subscribers) --------------------------
_RPS_RE = re.compile(rb"([0-9.]+) requests per second")


async def redis_benchmark(
    host: str, port: int, verb: str, requests: int, *, clients: int = 16, pipeline: int = 32
) -> float | None:
    """Run ``redis-benchmark --cluster`` for ``verb`` on ``tr:{tag}:live`` (the tool
    rewrites ``{tag}`` so that every master gets its share); return requests/s, or
    None when the tool is not on PATH. The process is stopped by pid on timeout."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    argv = [
        exe, "--cluster", "-h", host, "-p", str(port), "-n", str(requests),
        "-c", str(clients), "-P", str(pipeline), "-q",
        verb, "tr:{tag}:live", "x" * PAYLOAD_LEN,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="redis-benchmark-") as tmp:
        proc = Proc.start(argv, log=Path(tmp) / "out.log", name="redis-benchmark")
        try:
            if await proc.wait(60) is None:
                return None
        finally:
            await proc.stop()
        out = (Path(tmp) / "out.log").read_bytes()
    found = _RPS_RE.findall(out)
    return float(found[-1]) if found else None
