"""One round of the whole-path benchmark for a system with a server between Redis and its
readers (tokenrelay's relay, the bare relay, a Socket.IO server): its readers, its
producer, every participant's CPU over one window, and what each reader got.

:func:`measure` is the round: open ``phase.viewers`` readers per session (one
:class:`bench.peers.ws_clients.Tally` each, so duplicates are counted per reader), wait
until every session's channel has a shard subscriber, then over one window, from just
before the producer starts until every expected delivery arrived (or none came for 5 s):
the producer child's own pacing CPU, every Redis node's ``INFO cpu`` (masters and
replicas apart), the server's ``/proc/<pid>/stat``. In a ``resume_storm`` phase every
reader drops at once once half the expected deliveries arrived and reconnects (with its
last offset where the system resumes). Over the same window, every node's ``INFO
commandstats`` (:func:`command_stats`, :func:`top_commands`): the busiest commands per
delivered token, in the round's ``commands``. A system with a ``prepare`` (tokenrelay:
opening each session's turn) runs it before the readers open, its Redis CPU per turn in
the notes (``open_redis_us_per_turn``), outside the window.

Lost and duplicated: where the system keeps a backlog (``held``), against what Redis
holds, read with XRANGE after the round (each token's stamp); otherwise against what the
producer says it sent, times the readers per session.

Readers: WebSocket (:class:`bench.peers.ws_clients.WsClient`) or SSE (:class:`SseReader`,
a raw socket that counts stamps per chunk, for the relay and the bare relay alike).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import aiohttp
import hiredis

from bench._util import cpu_s, percentile
from bench.peers.llmshape import draw, ticks
from bench.peers.pathsystem import Phase, RoundFigures
from bench.peers.socketio import _wait_subscribed
from bench.peers.ws_clients import Kind, Tally, WsClient
from bench.relay.harness import SECRET, STAMP
from relay.protocol.auth import issue_token
from relay.protocol.keys import log_key
from relay.protocol.slotmap import Addr, SlotMap, slot_of

__all__ = [
    "Publish",
    "SseReader",
    "Transport",
    "command_stats",
    "held_stamps",
    "measure",
    "redis_cpu_by_role",
    "top_commands",
]

Transport = Literal["ws", "sse"]
# the producer: (sessions, tokens/s per session, seconds, the LLM phases' tick schedule
# or None for today's even pacing) -> its JSON line (sent, seconds, cpu_s...)
Publish = Callable[
    [list[str], float, float, list[list[int]] | None], Coroutine[Any, Any, dict[str, Any]]
]
Backlog = Callable[[list[str]], Coroutine[Any, Any, dict[str, set[int]]]]


class Reader(Protocol):
    """A screen of a system with its own client (Centrifugo's SDK): ``open`` returns once
    it will receive its session's tokens."""

    async def open(self) -> None: ...

    async def reconnect(self, resume: bool) -> None: ...

    async def close(self) -> None: ...


MakeReader = Callable[[Tally, str, int], Reader]  # (tally, session, port)
_STALL_S = 5.0


class SseReader:
    """One SSE viewer on a raw socket (``GET /v1/sessions/{sid}/events``): past the
    server's ``hello`` event, each chunk's complete events go to :meth:`Tally.note`."""

    def __init__(self, tally: Tally, sid: str, port: int) -> None:
        self.tally = tally
        self.sid = sid
        self.port = port
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer = writer
        token = issue_token(SECRET, self.sid, 3600, time.time())
        writer.write(
            f"GET /v1/sessions/{self.sid}/events?token={token} HTTP/1.1\r\nHost: bench\r\n"
            "\r\n".encode()
        )
        buf = b""
        end = -1
        async with asyncio.timeout(60):
            while end < 0:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    raise ConnectionError(f"closed before hello: {buf[:200]!r}")
                buf += chunk
                hello = buf.find(b"event: hello")
                end = -1 if hello < 0 else buf.find(b"\n\n", hello)
        if not buf.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(buf[:200].decode(errors="replace"))
        self.task = asyncio.create_task(self._pump(reader, buf[end + 2 :]))

    async def _pump(self, reader: asyncio.StreamReader, chunk: bytes) -> None:
        try:
            while True:
                cut = chunk.rfind(b"\n\n")
                if cut >= 0:
                    self.tally.note(chunk[: cut + 2].decode())
                    chunk = chunk[cut + 2 :]
                more = await reader.read(1 << 16)
                if not more:
                    self.tally.errors.append("sse: closed by the server")
                    return
                chunk += more
        except (ConnectionError, OSError) as exc:
            self.tally.errors.append(f"{type(exc).__name__}: {exc}")

    async def reconnect(self, resume: bool) -> None:
        raise NotImplementedError("the SSE readers of this bench run steady phases only")

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.writer is not None:
            self.writer.close()


@dataclass
class _Readers:
    http: aiohttp.ClientSession | None
    items: list[WsClient | SseReader | Reader]
    tallies: list[Tally]
    sids: list[str]  # the session of each reader

    def received(self) -> int:
        return sum(t.received for t in self.tallies)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.items))
        if self.http is not None:
            await self.http.close()


async def _open_readers(
    kind: Kind, transport: Transport, port: int, sids: Sequence[str], viewers: int,
    clock: Callable[[], int], window: int, make: MakeReader | None = None,
) -> _Readers:  # fmt: skip
    """``viewers`` readers per session, ``window`` handshakes at a time; raises if any fails."""
    per = [s for s in sids for _ in range(viewers)]
    tallies = [Tally(clock) for _ in per]
    http: aiohttp.ClientSession | None = None
    items: list[WsClient | SseReader | Reader]
    if make is not None:
        own = [make(t, s, port) for t, s in zip(tallies, per, strict=True)]
        items = list(own)

        async def open_one(i: int) -> None:
            await own[i].open()
    elif transport == "ws":
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        session = http
        ws = [WsClient(kind, t, s) for t, s in zip(tallies, per, strict=True)]
        items = list(ws)

        async def open_one(i: int) -> None:
            await ws[i].open(session, port)
    else:
        sse = [SseReader(t, s, port) for t, s in zip(tallies, per, strict=True)]
        items = list(sse)

        async def open_one(i: int) -> None:
            await sse[i].open()

    readers = _Readers(http, items, tallies, per)
    sem = asyncio.Semaphore(window)

    async def gated(i: int) -> None:
        async with sem:
            await open_one(i)

    results = await asyncio.gather(*(gated(i) for i in range(len(per))), return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        await readers.close()
        raise RuntimeError(f"{len(bad)} of {len(per)} {kind} readers failed: {bad[0]!r}")
    return readers


async def redis_cpu_by_role(smap: SlotMap) -> dict[str, float]:
    """CPU seconds (``INFO cpu``, sys + user) of the masters and of the replicas."""
    from relay.broker.rediscluster.nodeconn import raw_command

    masters = {sh.master for sh in smap.slots if sh is not None}
    out = {"masters": 0.0, "replicas": 0.0}
    for node in smap.nodes():
        text = (await raw_command(node, "INFO", "cpu")).decode()
        for line in text.splitlines():
            if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                out["masters" if node in masters else "replicas"] += float(line.split(":")[1])
    return out


async def command_stats(smap: SlotMap) -> dict[str, dict[str, tuple[int, int]]]:
    """``INFO commandstats`` of the masters and of the replicas: command -> (calls, usec),
    summed over the nodes of each role. Redis 7 counts a command a script runs under
    its own name as well as inside the script's ``evalsha`` / ``eval`` usec."""
    from relay.broker.rediscluster.nodeconn import raw_command

    masters = {sh.master for sh in smap.slots if sh is not None}
    out: dict[str, dict[str, tuple[int, int]]] = {"masters": {}, "replicas": {}}
    for node in smap.nodes():
        text = (await raw_command(node, "INFO", "commandstats")).decode()
        role = out["masters" if node in masters else "replicas"]
        for line in text.splitlines():
            if not line.startswith("cmdstat_"):
                continue
            name, _, rest = line[len("cmdstat_") :].partition(":")
            fields = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
            calls, usec = role.get(name, (0, 0))
            role[name] = (calls + int(fields.get("calls", 0)), usec + int(fields.get("usec", 0)))
    return out


def top_commands(
    before: dict[str, dict[str, tuple[int, int]]],
    after: dict[str, dict[str, tuple[int, int]]],
    delivered: int,
    n: int = 8,
) -> list[dict[str, Any]]:
    """The commands that took the most Redis time over a window, per role, each with its
    calls and usec per delivered token (``INFO commandstats``' own time: without the
    event loop, the protocol and replication, so they sum below ``INFO cpu``)."""
    rows: list[dict[str, Any]] = []
    per = max(delivered, 1)
    for role, cmds in after.items():
        for name, (calls, usec) in cmds.items():
            c0, u0 = before.get(role, {}).get(name, (0, 0))
            if calls - c0 > 0:
                rows.append({"role": role, "command": name,
                             "calls_per_token": round((calls - c0) / per, 4),
                             "us_per_token": round((usec - u0) / per, 3)})  # fmt: skip
    rows.sort(key=lambda r: -float(r["us_per_token"]))
    return rows[:n]


async def held_stamps(smap: SlotMap, sids: Sequence[str]) -> dict[str, set[int]]:
    """Every session's token stamps as its backlog in Redis holds them (XRANGE, one
    pipelined connection per master)."""
    by_node: dict[Addr, list[str]] = {}
    for sid in sids:
        node = smap.node_for(slot_of(log_key(sid)))
        assert node is not None
        by_node.setdefault(node, []).append(sid)
    out: dict[str, set[int]] = {}
    for node, group in by_node.items():
        reader, writer = await asyncio.open_connection(node.host, node.port)
        try:
            writer.write(b"".join(hiredis.pack_command(cast(Any, ("XRANGE", log_key(s), "-", "+")))
                                  for s in group))  # fmt: skip
            parser = hiredis.Reader()
            replies: list[Any] = []
            async with asyncio.timeout(30):
                while len(replies) < len(group):
                    parser.feed(await reader.read(1 << 20))
                    while (r := parser.gets()) is not False:
                        replies.append(r)
        finally:
            writer.close()
        for sid, entries in zip(group, replies, strict=True):
            if isinstance(entries, hiredis.ReplyError):
                raise RuntimeError(f"XRANGE {log_key(sid)}: {entries}")
            stamps: set[int] = set()
            for _id, fields in cast(list[Any], entries):
                for value in fields[1::2]:
                    stamps.update(int(s) for s in STAMP.findall(value))
            out[sid] = stamps
    return out


async def _wait(readers: _Readers, expected: int) -> None:
    seen, since = readers.received(), time.perf_counter()
    while readers.received() < expected:
        await asyncio.sleep(0.02)
        now = readers.received()
        if now != seen:
            seen, since = now, time.perf_counter()
        elif time.perf_counter() - since > _STALL_S:
            return


async def measure(
    system: str, kind: Kind, transport: Transport, phase: Phase, *, port: int, pid: int,
    smap: SlotMap, sids: list[str], channels: list[str], publish: Publish,
    clock: Callable[[], int], resumes: bool, held: bool, warm_s: float, window: int = 200,
    prepare: Callable[[list[str]], Coroutine[Any, Any, None]] | None = None,
    seed: int = 0, make: MakeReader | None = None, backlog: Backlog | None = None,
) -> RoundFigures:  # fmt: skip
    """One round of ``phase`` (see the module's docstring)."""
    rate = phase.tokens_per_s / phase.sessions  # per session
    plan: list[list[int]] | None = None
    total = phase.tokens_per_s * phase.seconds
    if phase.llm:  # this round's replies and gaps, the same for every system
        rate = phase.session_rate
        plan = ticks(draw(phase.sessions, rate, phase.seconds, seed), rate, phase.seconds)
        total = sum(len(t) for t in plan)
    notes: dict[str, float | int | str] = {}
    if prepare is not None:  # the turns' opening, measured apart from the tokens
        o0, c0 = await redis_cpu_by_role(smap), await command_stats(smap)
        await prepare(sids)
        o1, c1 = await redis_cpu_by_role(smap), await command_stats(smap)
        notes["open_redis_us_per_turn"] = round(
            sum(o1[k] - o0[k] for k in o0) * 1e6 / max(len(sids), 1), 1
        )
        notes["open_top_commands"] = "; ".join(
            f"{r['role'][0]}:{r['command']} {r['us_per_token']:.1f}us x{r['calls_per_token']:.3g}"
            for r in top_commands(c0, c1, len(sids), n=6)
        )  # per turn opened
    readers = await _open_readers(kind, transport, port, sids, phase.viewers, clock, window, make)
    try:
        await _wait_subscribed(smap, channels)
        await asyncio.sleep(0.5)
        cmd0 = await command_stats(smap)
        red0, srv0, t0 = await redis_cpu_by_role(smap), cpu_s(pid), time.perf_counter()
        own0 = time.process_time()  # the readers' process (this one): not a participant
        task = asyncio.create_task(publish(sids, rate, phase.seconds, plan))
        if phase.storm:
            half = int(total * phase.viewers / 2)
            while readers.received() < half and not task.done():
                await asyncio.sleep(0.01)
            s0 = time.perf_counter()
            await asyncio.gather(*(r.reconnect(resumes) for r in readers.items))
            notes["storm_reconnect_s"] = round(time.perf_counter() - s0, 3)
            notes["storm_readers"] = len(readers.items)
            notes["storm_recovered"] = sum(int(getattr(r, "recovered", 0)) for r in readers.items)
        pub = await task
        await _wait(readers, int(pub["sent"]) * phase.viewers)
        red1, srv1, wall = await redis_cpu_by_role(smap), cpu_s(pid), time.perf_counter() - t0
        # how busy the readers were: near 1.0, their one core, not the system, set latency
        notes["readers_cpu_share"] = round((time.process_time() - own0) / max(wall, 1e-9), 3)
        cmd1 = await command_stats(smap)
    finally:
        await readers.close()
    redis_s = {k: red1[k] - red0[k] for k in red0}
    if held:
        backlog_of = await (backlog(sids) if backlog is not None else held_stamps(smap, sids))
    else:
        backlog_of = {}
    lost = dup = extra = 0
    expected = 0
    arrivals: list[tuple[int, int]] = []
    for sid, t in zip(readers.sids, readers.tallies, strict=True):
        uniq = set(t.stamps)
        dup += len(t.stamps) - len(uniq)
        if held:
            lost += len(backlog_of[sid] - uniq)
            extra += len(uniq - backlog_of[sid])
            expected += len(backlog_of[sid])
        arrivals.extend(zip(t.stamps, t.arrivals, strict=True))
    if not held:
        expected = int(pub["sent"]) * phase.viewers
        lost = max(0, expected - sum(len(set(t.stamps)) for t in readers.tallies))
    cut = min((s for s, _ in arrivals), default=0) + int(warm_s * 1e9)
    lat = sorted((a - s) / 1e6 for s, a in arrivals if s >= cut)
    received = [t for t in readers.tallies if t.received]
    first = min((t.first for t in received), default=0.0)
    last = max((t.last for t in received), default=0.0)
    errors = [e for t in readers.tallies for e in t.errors]
    delivered = sum(t.received for t in readers.tallies)
    top = top_commands(cmd0, cmd1, delivered, n=16)
    notes["redis_top_commands"] = "; ".join(
        f"{r['role'][0]}:{r['command']} {r['us_per_token']:.2f}us x{r['calls_per_token']:.3g}"
        for r in top[:8]
    )
    notes.update(
        redis_masters_cpu_s=round(redis_s["masters"], 4),
        redis_replicas_cpu_s=round(redis_s["replicas"], 4),
        not_in_backlog=extra, reader_errors=len(errors), first_error=(errors or [""])[0][:160],
        publish_errors=int(pub.get("errors", 0)) + int(pub.get("failed", 0)),
        producer_seconds=round(float(pub["seconds"]), 3),
        handshake_retries=sum(t.retries for t in readers.tallies),
    )  # fmt: skip
    for k in ("frames", "wait_ms_mean", "wait_ms_max"):  # a coalescing producer's
        if k in pub:
            notes[f"coalesce_{k}"] = pub[k]
    return RoundFigures(
        system=system,
        phase=phase.name,
        published=int(pub["sent"]),
        delivered=delivered,
        expected=expected,
        lost=lost,
        duplicated=dup,
        cpu_s={
            "producer": round(
                float(pub["publish_cpu_s"] if "publish_cpu_s" in pub else pub["cpu_s"]), 4
            ),
            "redis": round(sum(redis_s.values()), 4),
            "server": round(srv1 - srv0, 4),
        },
        p50_ms=round(percentile(lat, 0.50, float("nan")), 2),
        p99_ms=round(percentile(lat, 0.99, float("nan")), 2),
        behind_s=round(max(0.0, last - first - float(pub["seconds"])), 2) if received else 0.0,
        wall_s=round(wall, 2),
        notes=notes,
        commands=top,
    )
