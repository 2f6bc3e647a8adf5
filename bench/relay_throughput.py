"""How much of a Redis connection's receive rate one relay process passes on to SSE
clients, what it adds in latency, and what an idle SSE connection costs in memory.

What it measures, all in one run, on one Redis Cluster (started here unless ``--redis``):

1. ``raw_msgs_per_s`` (the ceiling): one plain redis-py connection (``redis.asyncio.
   Redis(...).pubsub()``) SSUBSCRIBEd to the live channels of K sessions that all sit on
   one master. The reader is idle while a publisher process writes F frames per session
   (``relay.redisio.publisher`` generations: XADD backlog + SPUBLISH in one Lua call, 50
   frames per call); the frames wait in the socket and in Redis's output buffer. Then
   the reader drains them: messages / seconds from the first read to the last message.
   Draining a backlog takes the publisher out of the measurement (it shares the 2 cores).
2. ``relay_frames_per_s``: K other sessions on the same master, F frames each, read by K SSE
   clients (1 viewer per session) of one ``tokenrelay relay`` *process*. The relay is
   stopped with SIGSTOP while the publisher writes (its shard connection buffers the
   frames exactly as the raw reader's did), then continued with SIGCONT: token frames
   received by all clients / seconds from SIGCONT to the last one.
   ``ratio`` = ``relay_frames_per_s / raw_msgs_per_s``.
3. ``fanout10_writes_per_s``: as 2, with K/10 sessions and 10 viewers per session
   (frames x viewers = writes, per second).
4. ``latency_p50_ms`` / ``latency_p99_ms``: 1,000 sessions spread over every shard, one
   SSE viewer each, a paced publisher process sending 20 tokens/s per session (20,000
   frames/s through the same Lua script, one frame per call, pipelined per node); from
   the producer's clock in the token text (ns) to the client's read of the chunk
   (same host clock). The first second is warm-up and not counted.
5. ``rss_kb_per_idle_conn``: a fresh relay process; VmRSS from ``/proc/<pid>/status``
   before and after N (10,000) idle SSE connections, each on its own session (so each
   costs a watch, a subscription and its presence entry too), divided by N.

Frames are counted by their token texts (``<19-digit ns>;``), so a conflated frame (a
slow watcher's merged token run) still counts every token: ``*_events`` in the JSON say
how many SSE events carried them. Every client checks it got every token sent (``lost``).

Processes: this one holds the raw reader and the SSE clients (raw asyncio sockets, a
regex per chunk); the relay runs as ``python -m tokenrelay relay`` with its log in a
temporary file; publishers run as ``python -m bench.relay_throughput --_publish ...``.
Each is stopped by its pid (SIGCONT first if stopped, SIGTERM, SIGKILL after 15 s);
a cluster started here is stopped by :func:`devstack.cluster.launcher.local_cluster`. Loopback only.

Phases 1-3 run ``repeats`` (3) rounds side by side (raw, relay1, fanout, raw, ...) and
report each one's median round (``rounds_per_s`` in the JSON has them all): this
machine is shared, and a neighbour's burst moves one round, rarely three.

Call order: :func:`main` (or ``tokenrelay bench relay_throughput``) ->
:func:`add_arguments` -> :func:`run_from_args` -> :func:`run` with a :class:`Config`:
cluster -> relay A (rounds of ``raw`` / ``relay1`` / ``fanout10``, then ``latency``) ->
relay B (``idle``, a session per connection) -> relay C (``idle``, one session) ->
table and JSON. ``python -m bench.relay_throughput [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import hiredis
import redis.asyncio as aredis

from bench import relay_phases
from relay.edge.subscriber import raw_command
from relay.protocol.auth import issue_token
from relay.protocol.frame import Frame, encode
from relay.protocol.keys import live_channel, log_key, meta_key, new_session_id
from relay.protocol.slotmap import Addr, SlotMap, parse_shards, slot_of
from relay.redisio.connect import connect
from relay.redisio.publisher import PUBLISH, Draft, Generation, Publisher

__all__ = ["Config", "add_arguments", "main", "run", "run_from_args"]

SECRET = "relay-throughput-bench-5e8c1a7f3d9b2064"
STAMP = re.compile(rb"(\d{19});")
TARGETS = {
    "ratio_hiredis": ">= 0.7",
    "fanout10_writes_per_s": ">= 5 x raw_msgs_per_s",
    "relay_cpu_us_per_frame": "<= 15",
    "latency_5k_p50_ms": "<= 1",
    "latency_5k_p99_ms": "<= 5",
    "rss_kb_per_idle_conn": "<= 15",
    "rss_kb_per_idle_ws_conn": "<= 20",
    "replay_frames_per_s": ">= 100000",
}


@dataclass
class Config:
    sessions: int = 1_000  # K: sessions (= SSE clients) of the flood phases, on one master
    frames: int = 200  # F: frames per session in the raw and relay1 phases
    fanout: int = 10  # viewers per session in the fanout phase (K / fanout sessions)
    batch: int = 50  # frames per Lua call in the flood publisher
    lat_sessions: int = 1_000
    lat_rate: float = 20.0  # tokens/s per session
    lat_seconds: float = 10.0  # measured, after 1 s of warm-up
    idle: int = 10_000  # idle SSE connections
    connect_window: int = 200  # connections being opened at once
    repeats: int = 3  # rounds of raw / relay1 / fanout; the median is reported
    lat_rate_5k: float = 5.0  # tokens/s per session of the second latency phase (5,000/s)
    replay_frames: int = 10_000  # one session, replayed from 0 by replay_clients at once
    replay_clients: int = 50
    profile: str = ""  # a directory: py-spy samples the relay during the 5,000/s phase

    @classmethod
    def quick(cls) -> Config:
        return cls(sessions=400, frames=250, lat_seconds=4.0, idle=2_000)


# -- helpers ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _machine_busy_s() -> float:
    """CPU seconds all cores spent not idle (``/proc/stat``), since boot."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


async def _redis_cpu_s(smap: SlotMap) -> float:
    total = 0.0
    for node in smap.nodes():
        info = await raw_command(node, "INFO", "cpu")
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                total += float(line.split(":", 1)[1])
    return total


class CpuMeter:
    """CPU seconds of each participant between :meth:`start` and :meth:`stop`: the relay
    (``/proc/<pid>/stat``), this process (the clients), the publisher (its own
    getrusage), every Redis node (INFO cpu), and the whole machine (``/proc/stat``);
    ``other_cpu_s`` is what processes outside this benchmark took (a shared machine)."""

    def __init__(self, relay_pid: int, smap: SlotMap) -> None:
        self.pid = relay_pid
        self.smap = smap
        self.t = (0.0, 0.0, 0.0, 0.0, 0.0)

    async def start(self) -> None:
        self.t = (
            time.perf_counter(),
            _cpu_s(self.pid),
            _self_cpu_s(),
            await _redis_cpu_s(self.smap),
            _machine_busy_s(),
        )

    async def stop(self, publisher_cpu_s: float) -> dict[str, float]:
        wall = time.perf_counter() - self.t[0]
        relay = _cpu_s(self.pid) - self.t[1]
        own = _self_cpu_s() - self.t[2]
        red = await _redis_cpu_s(self.smap) - self.t[3]
        machine = _machine_busy_s() - self.t[4]
        other = machine - relay - own - red - publisher_cpu_s
        return {
            "wall_s": round(wall, 2),
            "relay_cpu_s": round(relay, 2),
            "loadgen_cpu_s": round(own, 2),
            "publisher_cpu_s": round(publisher_cpu_s, 2),
            "redis_cpu_s": round(red, 2),
            "machine_busy_cpu_s": round(machine, 2),
            "machine_capacity_cpu_s": round(wall * (os.cpu_count() or 1), 2),
            "other_cpu_s": round(max(0.0, other), 2),
        }


def _pct(sorted_ns: Sequence[int], p: float) -> float:
    if not sorted_ns:
        return float("nan")
    return sorted_ns[min(len(sorted_ns) - 1, int(p * len(sorted_ns)))] / 1e6


async def _slotmap(seed: Addr) -> SlotMap:
    return parse_shards(await raw_command(seed, "CLUSTER", "SHARDS"))


def _sessions(n: int, smap: SlotMap, master: Addr | None) -> list[str]:
    """``n`` new session ids; all on ``master`` when given."""
    out: list[str] = []
    while len(out) < n:
        sid = new_session_id()
        if master is None or smap.node_for(slot_of(live_channel(sid))) == master:
            out.append(sid)
    return out


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Stop a child we started, by its pid."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 15)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# -- publisher (a child process) --------------------------------------------------------


async def _publish_flood(url: str, sids: list[str], frames: int, batch: int) -> dict[str, Any]:
    """``frames`` token frames per session through :class:`Generation.publish`."""
    redis = connect(url)
    await redis.initialize()
    try:
        pub = Publisher(redis)
        sem = asyncio.Semaphore(64)
        sent = 0

        async def one(sid: str) -> None:
            nonlocal sent
            async with sem:
                gen = await pub.open_generation(sid)
                left = frames
                while left:
                    k = min(batch, left)
                    drafts = [Draft(kind="token", text=f"{time.time_ns():019d};") for _ in range(k)]
                    await gen.publish(drafts)
                    left -= k
                    sent += k

        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in sids))
        took = time.perf_counter() - t0
    finally:
        await redis.aclose()
    return {"sent": sent, "seconds": took, "errors": 0, "cpu_s": _self_cpu_s()}


async def _publish_paced(url: str, sids: list[str], rate: float, seconds: float) -> dict[str, Any]:
    """``rate`` token frames/s per session for ``seconds``, one frame per call of the
    publish script (:data:`relay.redisio.publisher.PUBLISH`, its argument layout of
    ``Generation._write``), pipelined per master on raw connections: redis-py costs more
    CPU per call than this machine can give to 20,000 calls/s."""
    redis = connect(url)
    await redis.initialize()
    pub = Publisher(redis)
    try:
        gens: list[Generation] = list(await asyncio.gather(*(pub.open_generation(s) for s in sids)))
    finally:
        await redis.aclose()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    smap = await _slotmap(Addr(host, int(port)))
    conns: dict[Addr, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    node_of: list[Addr] = []
    for g in gens:
        node = smap.node_for(slot_of(live_channel(g.session)))
        assert node is not None
        node_of.append(node)
        if node not in conns:
            conns[node] = await asyncio.open_connection(node.host, node.port)
            await raw_command(node, "SCRIPT", "LOAD", PUBLISH.source)
    pending = dict.fromkeys(conns, 0)
    errors: list[str] = []
    replies = 0

    async def read_replies(node: Addr) -> None:
        nonlocal replies
        reader = conns[node][0]
        parser = hiredis.Reader()
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return
            parser.feed(chunk)
            while (r := parser.gets()) is not False:
                pending[node] -= 1
                replies += 1
                if isinstance(r, hiredis.ReplyError):
                    errors.append(str(r)[:80])

    readers = [asyncio.create_task(read_replies(n)) for n in conns]
    tick = 0.01
    per_tick = rate * tick  # calls per session per tick (0.2 at 20/s)
    groups = max(1, round(1 / per_tick)) if per_tick < 1 else 1
    sent = 0
    t0 = time.perf_counter()
    n_ticks = int(seconds / tick)
    for t in range(n_ticks):
        bufs: dict[Addr, list[bytes]] = {n: [] for n in conns}
        for i in range(t % groups, len(gens), groups):
            g = gens[i]
            off = g.offset + 1
            frame = encode(
                Frame(
                    session=g.session,
                    turn=g.turn,
                    offset=off,
                    kind="token",
                    text=f"{time.time_ns():019d};",
                    epoch=g.epoch,
                    ts=time.time_ns() // 1_000_000,
                    meta={"gen": g.gen},
                )
            )
            keys = (meta_key(g.session), log_key(g.session), live_channel(g.session))
            args = (g.epoch, g.offset, pub.maxlen, pub.ttl_s, 0, g.turn, g.gen, frame)
            bufs[node_of[i]].append(
                hiredis.pack_command(cast(Any, ("EVALSHA", PUBLISH.sha, 3, *keys, *args)))
            )
            g.offset = off
            pending[node_of[i]] += 1
            sent += 1
        for node, cmds in bufs.items():
            if cmds:
                conns[node][1].write(b"".join(cmds))
        delay = t0 + (t + 1) * tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    took = time.perf_counter() - t0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            while any(pending.values()):
                await asyncio.sleep(0.01)
    for task in readers:
        task.cancel()
    for _, w in conns.values():
        w.close()
    return {
        "sent": sent,
        "seconds": took,
        "cpu_s": _self_cpu_s(),
        "replies": replies,
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:5],
    }


async def _run_publisher(spec: dict[str, Any]) -> dict[str, Any]:
    """Run a publisher child process (``--_publish``) and return its JSON line."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        path = f.name
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.relay_throughput", "--_publish", path,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        await _stop(proc)
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"publisher exited with {proc.returncode}")
    res: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return res


# -- SSE clients (raw sockets, this process) ---------------------------------------------


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


class SSEClient:
    """One SSE viewer on a raw socket: counts token stamps per chunk, keeps nothing else."""

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


async def _open_clients(
    port: int, sids: Sequence[str], tally: Tally, window: int
) -> list[SSEClient]:
    clients = [SSEClient(tally, sid) for sid in sids]
    sem = asyncio.Semaphore(window)

    async def one(c: SSEClient) -> None:
        async with sem:
            await c.open(port)

    results = await asyncio.gather(*(one(c) for c in clients), return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        for c in clients:
            c.close()
        raise RuntimeError(f"{len(bad)} of {len(clients)} SSE connections failed: {bad[0]!r}")
    return clients


def _close_clients(clients: Sequence[SSEClient]) -> None:
    for c in clients:
        c.close()


# -- the relay under test -----------------------------------------------------------------


@dataclass
class RelayProc:
    proc: asyncio.subprocess.Process
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def relay_process(
    url: str, log_dir: Path, name: str, max_conn: int
) -> AsyncIterator[RelayProc]:
    """``tokenrelay relay`` as its own process, ready to serve; stopped by pid."""
    port = _free_port()
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:  # noqa: ASYNC230 (a local file, opened once)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenrelay", "relay", "--port", str(port),
            "--redis", url, "--secret", SECRET, "--relay-id", name,
            "--max-connections", str(max_conn), "--reap-after-s", "0",
            "--max-streams-per-address", "0",  # every client of the bench is 127.0.0.1
            "--max-streams-per-token", "0",  # a capacity bench, not an abuse test
            "--log-level", "WARNING",
            stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
        )  # fmt: skip
    relay = RelayProc(proc, port, log_path)
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(relay.base + "/readyz") as r:
                        if r.status == 200:
                            break
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"relay not ready; log: {log_path.read_text()[-2000:]}")
                await asyncio.sleep(0.1)
        yield relay
    finally:
        await _stop(proc)


# -- phases ------------------------------------------------------------------------------


async def _raw_phase(url: str, master: Addr, sids: list[str], cfg: Config) -> dict[str, Any]:
    r = aredis.Redis(host=master.host, port=master.port)
    ps = r.pubsub()
    try:
        for sid in sids:  # one call each: SSUBSCRIBE's channels must share a slot
            await ps.ssubscribe(live_channel(sid))
        confirmed = 0
        async with asyncio.timeout(30):
            while confirmed < len(sids):
                msg = await ps.get_message(timeout=1.0)
                if msg is not None and msg["type"] in ("ssubscribe", b"ssubscribe"):
                    confirmed += 1
        pub = await _run_publisher(
            {"mode": "flood", "url": url, "sids": sids, "frames": cfg.frames, "batch": cfg.batch}
        )
        expected = pub["sent"]
        got = 0
        t0 = time.perf_counter()
        last = t0
        while got < expected:
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=5.0)
            if msg is None:
                break
            if msg["type"] in ("smessage", b"smessage"):
                got += 1
                last = time.perf_counter()
        took = last - t0
    finally:
        await ps.aclose()
        await r.aclose()
    return {
        "sessions": len(sids),
        "sent": expected,
        "received": got,
        "seconds": round(took, 3),
        "msgs_per_s": round(got / took) if took > 0 else 0,
        "publisher_frames_per_s": round(pub["sent"] / pub["seconds"]),
    }


async def _wait_all(tally: Tally, stall_s: float = 5.0) -> float:
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


async def _drain_phase(
    relay: RelayProc, url: str, smap: SlotMap, sids: list[str], viewers: int, cfg: Config
) -> dict[str, Any]:
    """SIGSTOP the relay, publish, SIGCONT, time until every client has every token."""
    tally = Tally()
    clients = await _open_clients(
        relay.port, [s for s in sids for _ in range(viewers)], tally, cfg.connect_window
    )
    try:
        await asyncio.sleep(0.5)
        meter = CpuMeter(relay.pid, smap)
        spec = {"mode": "flood", "url": url, "sids": sids, "frames": cfg.frames, "batch": cfg.batch}
        os.kill(relay.pid, signal.SIGSTOP)
        try:
            pub = await _run_publisher(spec)
        finally:
            await meter.start()
            os.kill(relay.pid, signal.SIGCONT)
        t0 = time.perf_counter()
        tally.expected = pub["sent"] * viewers
        await _wait_all(tally)
        took = tally.last - t0
        cpu = await meter.stop(0.0)
        lost = sum(max(0, cfg.frames - c.tokens) for c in clients)
    finally:
        _close_clients(clients)
    return {
        "sessions": len(sids),
        "viewers_per_session": viewers,
        "clients": len(clients),
        "sent": pub["sent"],
        "expected_writes": tally.expected,
        "received": tally.tokens,
        "events": tally.events,
        "lost": lost,
        "client_errors": len(tally.errors),
        "seconds": round(took, 3),
        "per_s": round(tally.tokens / took) if took > 0 else 0,
        "publisher_frames_per_s": round(pub["sent"] / pub["seconds"]),
        "cpu_while_draining": cpu,
    }


async def _metrics_text(relay: RelayProc) -> str:
    async with aiohttp.ClientSession() as http, http.get(relay.base + "/metrics") as r:
        return await r.text()


async def _latency_phase(
    relay: RelayProc,
    url: str,
    smap: SlotMap,
    sids: list[str],
    cfg: Config,
    profile: Path | None = None,
) -> dict[str, Any]:
    """Paced publisher, one SSE client per session; ``profile``: py-spy samples the relay
    while the publisher runs (not while the clients connect)."""
    tally = Tally(record_latency=True)
    clients = await _open_clients(relay.port, sids, tally, cfg.connect_window)
    try:
        await asyncio.sleep(0.5)
        metrics_before = await _metrics_text(relay)
        meter = CpuMeter(relay.pid, smap)
        await meter.start()
        warm = 1.0
        spec = {
            "mode": "paced",
            "url": url,
            "sids": sids,
            "rate": cfg.lat_rate,
            "seconds": warm + cfg.lat_seconds,
        }
        async with relay_phases.profiled(relay.pid, profile, warm + cfg.lat_seconds):
            pub = await _run_publisher(spec)
        tally.expected = pub["sent"]
        backlog_s = await _wait_all(tally)
        cpu = await meter.stop(pub["cpu_s"])
        lost = tally.expected - tally.tokens
        lag = relay_phases.loop_lag(metrics_before, await _metrics_text(relay))
    finally:
        _close_clients(clients)
    # warm-up: the first second's worth of samples, in arrival order
    skip = int(len(sids) * cfg.lat_rate * warm)
    lat = sorted(tally.lat_ns[skip:])
    return {
        "sessions": len(sids),
        "rate_per_session": cfg.lat_rate,
        "offered_frames_per_s": round(len(sids) * cfg.lat_rate),
        "publisher_frames_per_s": round(pub["sent"] / pub["seconds"]),
        "sent": pub["sent"],
        "publish_errors": pub["errors"],
        "publish_error_kinds": pub["first_errors"],
        "lag_after_publisher_s": round(backlog_s, 2),
        "received": tally.tokens,
        "lost": lost,
        "client_errors": len(tally.errors),
        "samples": len(lat),
        "p50_ms": round(_pct(lat, 0.50), 3),
        "p90_ms": round(_pct(lat, 0.90), 3),
        "p99_ms": round(_pct(lat, 0.99), 3),
        "max_ms": round(lat[-1] / 1e6, 3) if lat else float("nan"),
        "seconds": cfg.lat_seconds,
        "cpu": cpu,
        "relay_cpu_us_per_frame": round(cpu["relay_cpu_s"] / tally.tokens * 1e6, 1)
        if tally.tokens
        else 0.0,
        "relay_loop_lag": lag,
    }


async def _idle_phase(
    relay: RelayProc, smap: SlotMap, cfg: Config, *, shared: bool
) -> dict[str, Any]:
    """VmRSS of the relay before and after ``cfg.idle`` idle SSE connections, each on
    its own session, or (``shared``) all on one session."""
    warm_tally = Tally()
    warm = await _open_clients(relay.port, _sessions(1, smap, None), warm_tally, 1)
    await asyncio.sleep(1.5)
    before = _rss_kb(relay.pid)
    tally = Tally()
    sids = _sessions(1, smap, None) * cfg.idle if shared else _sessions(cfg.idle, smap, None)
    t0, cpu0 = time.perf_counter(), _cpu_s(relay.pid)
    clients = await _open_clients(relay.port, sids, tally, cfg.connect_window)
    took, cpu_open = time.perf_counter() - t0, _cpu_s(relay.pid) - cpu0
    try:
        cpu1 = _cpu_s(relay.pid)
        await asyncio.sleep(2.0)
        idle_cpu = (_cpu_s(relay.pid) - cpu1) / 2.0
        after = _rss_kb(relay.pid)
        async with aiohttp.ClientSession() as http, http.get(relay.base + "/metrics") as r:
            text = await r.text()
        conns = sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln.startswith("tokenrelay_relay_connections{")
        )
    finally:
        _close_clients(clients)
        _close_clients(warm)
    return {
        "sessions": len(set(sids)),
        "connections": cfg.idle,
        "connections_seen_by_relay": int(conns),
        "open_seconds": round(took, 2),
        "relay_cpu_s_while_opening": round(cpu_open, 2),
        "relay_cpu_share_when_idle": round(idle_cpu, 3),
        "rss_before_kb": before,
        "rss_after_kb": after,
        "kb_per_conn": round((after - before) / cfg.idle, 2),
    }


# -- the run -------------------------------------------------------------------------------


def _median(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round with the median ``key``, plus every round's rate and the losses of all."""
    med = dict(sorted(rounds, key=lambda r: float(r[key]))[len(rounds) // 2])
    med["rounds_per_s"] = [r[key] for r in rounds]
    med["lost_all_rounds"] = sum(int(r.get("lost", r["sent"] - r["received"])) for r in rounds)
    return med


def _raise_nofile(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def run(cfg: Config, url: str | None = None) -> dict[str, Any]:
    """Every phase on the cluster at ``url`` (or on a 3+3 cluster started here)."""
    nofile = _raise_nofile(cfg.idle + 1_000)
    if nofile < cfg.idle + 200:
        raise SystemExit(f"RLIMIT_NOFILE {nofile} is too low for {cfg.idle} connections")
    started = time.monotonic()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    async with contextlib.AsyncExitStack() as stack:
        own = url is None
        if url is None:
            from devstack.cluster.launcher import local_cluster

            info = await stack.enter_async_context(local_cluster(masters=3, replicas=1))
            url = info.url
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        smap = await _slotmap(Addr(host, int(port)))
        master = sorted({sh.master for sh in smap.slots if sh is not None})[0]
        if own:  # the drained backlog exceeds the default 32 MB pubsub output buffer
            for node in smap.nodes():
                await raw_command(
                    node, "CONFIG", "SET", "client-output-buffer-limit", "pubsub 0 0 0"
                )
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="relay-bench-")))

        def progress(msg: str) -> None:
            print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

        max_conn = max(cfg.sessions, cfg.lat_sessions) + 100
        async with relay_process(url, log_dir, "bench-relay-a", max_conn) as relay:
            raws: list[dict[str, Any]] = []
            his: list[dict[str, Any]] = []
            r1s: list[dict[str, Any]] = []
            fans: list[dict[str, Any]] = []
            k = max(1, cfg.sessions // cfg.fanout)
            for i in range(cfg.repeats):
                n = f"round {i + 1}/{cfg.repeats}"
                progress(f"{n} raw: {cfg.sessions} sessions x {cfg.frames} frames, redis-py")
                raws.append(
                    await _raw_phase(url, master, _sessions(cfg.sessions, smap, master), cfg)
                )
                progress(f"{n} raw hiredis: the relay's own per-node reader alone")
                his.append(
                    await relay_phases.raw_hiredis_phase(
                        url, _sessions(cfg.sessions, smap, master), cfg.frames, _run_publisher
                    )
                )
                progress(f"{n} relay1: {cfg.sessions} SSE clients, 1 per session")
                sids = _sessions(cfg.sessions, smap, master)
                r1s.append(await _drain_phase(relay, url, smap, sids, 1, cfg))
                progress(f"{n} fanout: {k} sessions x {cfg.fanout} viewers")
                sids = _sessions(k, smap, master)
                fans.append(await _drain_phase(relay, url, smap, sids, cfg.fanout, cfg))
            raw = _median(raws, "msgs_per_s")
            hi = _median(his, "msgs_per_s")
            relay1 = _median(r1s, "per_s")
            fan = _median(fans, "per_s")
            progress(f"latency: {cfg.lat_sessions} sessions x {cfg.lat_rate:g} tokens/s")
            lat = await _latency_phase(
                relay, url, smap, _sessions(cfg.lat_sessions, smap, None), cfg
            )
            cfg5k = Config(**{**asdict(cfg), "lat_rate": cfg.lat_rate_5k})
            progress(f"latency: {cfg.lat_sessions} sessions x {cfg.lat_rate_5k:g} tokens/s")
            prof = Path(cfg.profile) / "relay-5k.txt" if cfg.profile else None
            lat5k = await _latency_phase(
                relay, url, smap, _sessions(cfg.lat_sessions, smap, None), cfg5k, prof
            )
            if prof is not None:
                lat5k["profile"] = relay_phases.summarize_profile(prof)
            log_a = relay.log_path.read_text(errors="replace")
        async with relay_process(url, log_dir, "bench-relay-b", cfg.idle + 100) as relay:
            progress(f"idle: {cfg.idle} idle SSE connections")
            idle = await _idle_phase(relay, smap, cfg, shared=False)
            log_b = relay.log_path.read_text(errors="replace")
        async with relay_process(url, log_dir, "bench-relay-c", cfg.idle + 100) as relay:
            progress(f"idle, one session: {cfg.idle} idle SSE connections on one session")
            idle1 = await _idle_phase(relay, smap, cfg, shared=True)
            log_b += relay.log_path.read_text(errors="replace")
        async with relay_process(url, log_dir, "bench-relay-d", cfg.idle + 100) as relay:
            progress(f"idle: {cfg.idle} idle WebSocket connections")
            idle_ws = await relay_phases.idle_ws_phase(
                relay.pid, relay.port, _sessions(cfg.idle + 1, smap, None), SECRET,
                cfg.connect_window,
            )  # fmt: skip
            log_b += relay.log_path.read_text(errors="replace")
        async with relay_process(url, log_dir, "bench-relay-e", 1_000) as relay:
            progress(f"replay: {cfg.replay_frames} frames from 0 x {cfg.replay_clients} SSE")
            replay = await relay_phases.replay_phase(
                url, relay.pid, relay.port, _sessions(1, smap, None)[0], SECRET,
                cfg.replay_frames, cfg.replay_clients,
            )  # fmt: skip
            log_b += relay.log_path.read_text(errors="replace")
    raw_rate = raw["msgs_per_s"]
    res: dict[str, Any] = {
        "raw_msgs_per_s": raw_rate,
        "raw_hiredis_msgs_per_s": hi["msgs_per_s"],
        "relay_frames_per_s": relay1["per_s"],
        "ratio": round(relay1["per_s"] / raw_rate, 3) if raw_rate else 0.0,
        "ratio_hiredis": round(relay1["per_s"] / hi["msgs_per_s"], 3) if hi["msgs_per_s"] else 0.0,
        "relay_cpu_us_per_frame": lat5k["relay_cpu_us_per_frame"],
        "fanout10_writes_per_s": fan["per_s"],
        "latency_p50_ms": lat["p50_ms"],
        "latency_p99_ms": lat["p99_ms"],
        "latency_5k_p50_ms": lat5k["p50_ms"],
        "latency_5k_p99_ms": lat5k["p99_ms"],
        "loop_max_turn_ms_5k": lat5k["relay_loop_lag"]["max_ms_at_most"],
        "loop_max_turn_ms_20k": lat["relay_loop_lag"]["max_ms_at_most"],
        "rss_kb_per_idle_conn": idle["kb_per_conn"],
        "rss_kb_per_idle_ws_conn": idle_ws["kb_per_conn"],
        "replay_frames_per_s": replay["frames_per_s"],
        "replay_rss_peak_mb": round(replay["rss_peak_kb"] / 1024, 1),
        "rss_kb_per_idle_conn_one_session": idle1["kb_per_conn"],
        "ratio_per_round": [
            round(a / b, 3) if b else 0.0
            for a, b in zip(relay1["rounds_per_s"], raw["rounds_per_s"], strict=True)
        ],
        "fanout_vs_raw": round(fan["per_s"] / raw_rate, 2) if raw_rate else 0.0,
        "config": asdict(cfg),
        "cluster": "started here (3 masters + 3 replicas)" if own else url,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "phases": {
            "raw": raw,
            "raw_hiredis": hi,
            "relay1": relay1,
            "fanout": fan,
            "latency": lat,
            "latency_5k": lat5k,
            "idle": idle,
            "idle_ws": idle_ws,
            "replay": replay,
            "idle_one_session": idle1,
        },
        "relay_log_tracebacks": log_a.count("Traceback") + log_b.count("Traceback"),
        "targets": TARGETS,
        "seconds": round(time.monotonic() - started, 1),
    }
    res["targets_met"] = {
        "ratio_hiredis": res["ratio_hiredis"] >= 0.7,
        "fanout10_writes_per_s": fan["per_s"] >= 5 * raw_rate,
        "relay_cpu_us_per_frame": 0 < res["relay_cpu_us_per_frame"] <= 15.0,
        "latency_5k_p50_ms": lat5k["p50_ms"] <= 1.0,
        "latency_5k_p99_ms": lat5k["p99_ms"] <= 5.0,
        "rss_kb_per_idle_conn": idle["kb_per_conn"] <= 15.0,
        "rss_kb_per_idle_ws_conn": idle_ws["kb_per_conn"] <= 20.0,
        "replay_frames_per_s": replay["frames_per_s"] >= 100_000,
    }
    return res


def _table(res: dict[str, Any]) -> str:
    ph = res["phases"]
    met = res["targets_met"]
    r1, fo, la, l5 = ph["relay1"], ph["fanout"], ph["latency"], ph["latency_5k"]
    idle, ws, rp = ph["idle"], ph["idle_ws"], ph["replay"]

    def cpu(p: dict[str, Any]) -> str:
        c = p["cpu"]
        return (
            f"CPU s relay {c['relay_cpu_s']}, redis {c['redis_cpu_s']}, publisher"
            f" {c['publisher_cpu_s']}, clients {c['loadgen_cpu_s']}, others {c['other_cpu_s']}"
            f" of {c['machine_capacity_cpu_s']}"
        )

    details = {
        "raw_msgs_per_s": f"redis-py PubSub, {ph['raw']['received']:,} msgs",
        "raw_hiredis_msgs_per_s": f"the relay's per-node hiredis reader alone, lost {ph['raw_hiredis']['lost']}",  # noqa: E501
        "relay_frames_per_s": f"{r1['clients']:,} SSE clients, lost {r1['lost']}",
        "ratio": "relay / redis-py",
        "ratio_hiredis": "relay / hiredis reader",
        "relay_cpu_us_per_frame": f"at {l5['offered_frames_per_s']:,} frames/s, 1 viewer per session",  # noqa: E501
        "fanout10_writes_per_s": f"{res['fanout_vs_raw']}x raw, {fo['sessions']} x {fo['viewers_per_session']}, lost {fo['lost']}",  # noqa: E501
        "latency_p50_ms": f"{la['offered_frames_per_s']:,} frames/s offered",
        "latency_p99_ms": f"max {la['max_ms']} ms, behind {la['lag_after_publisher_s']} s, lost {la['lost']}; {cpu(la)}",  # noqa: E501
        "latency_5k_p50_ms": f"{l5['offered_frames_per_s']:,} frames/s offered",
        "latency_5k_p99_ms": f"max {l5['max_ms']} ms, behind {l5['lag_after_publisher_s']} s, lost {l5['lost']}; {cpu(l5)}",  # noqa: E501
        "loop_max_turn_ms_5k": f"{l5['relay_loop_lag']['over_1ms']} of {l5['relay_loop_lag']['samples']} 10 ms timer samples > 1 ms late",  # noqa: E501
        "loop_max_turn_ms_20k": f"{la['relay_loop_lag']['over_1ms']} of {la['relay_loop_lag']['samples']} samples > 1 ms late",  # noqa: E501
        "rss_kb_per_idle_conn": f"{idle['connections']:,} SSE conns, 1 session each",
        "rss_kb_per_idle_ws_conn": f"{ws['connections']:,} WebSocket conns, 1 session each",
        "replay_frames_per_s": f"{rp['clients']} SSE clients x {rp['frames']:,} frames from 0: {rp['endings']}",  # noqa: E501
        "replay_rss_peak_mb": f"relay VmHWM; {rp['rss_before_kb'] // 1024} MB before the replay",
    }
    rows = []
    for key, detail in details.items():
        target = TARGETS.get(key, "")
        if target:
            target += ": met" if met[key] else ": NOT met"
        value = res[key]
        rows.append((key, f"{value:,}" if isinstance(value, int) else str(value), target, detail))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{'figure':{w[0]}}  {'value':>{w[1]}}  {'target':{w[2]}}  detail"]
    lines += [f"{a:{w[0]}}  {b:>{w[1]}}  {c:{w[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Config()
    ap.add_argument("--quick", action="store_true", help="400 sessions, 4 s latency, 2,000 idle")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--redis", help="redis://host:port of a running cluster (default: start one)")
    ap.add_argument("--sessions", type=int, help=f"K, flood sessions = clients ({d.sessions})")
    ap.add_argument("--frames", type=int, help=f"F, frames per session in the flood ({d.frames})")
    ap.add_argument(
        "--lat-sessions", type=int, help=f"sessions in the latency phase ({d.lat_sessions})"
    )
    ap.add_argument(
        "--lat-seconds", type=float, help=f"measured seconds of the latency phase ({d.lat_seconds})"
    )
    ap.add_argument(
        "--lat-rate", type=float, help=f"tokens/s per session in the latency phase ({d.lat_rate:g})"
    )
    ap.add_argument("--idle", type=int, help=f"idle SSE connections ({d.idle})")
    ap.add_argument(
        "--profile", metavar="DIR", help="sample the relay with py-spy in the 5,000/s phase"
    )


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config.quick() if args.quick else Config()
    for name in (
        "sessions",
        "frames",
        "lat_sessions",
        "lat_rate",
        "lat_seconds",
        "idle",
        "profile",
    ):
        v = getattr(args, name, None)
        if v is not None:
            setattr(cfg, name, v)
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    res = asyncio.run(run(config_from_args(args), args.redis))
    print(_table(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    ph = res["phases"]
    lost = sum(ph[k]["lost_all_rounds"] for k in ("raw", "relay1", "fanout"))
    lost += ph["latency"]["lost"] + ph["latency_5k"]["lost"] + ph["raw_hiredis"]["lost_all_rounds"]
    return 1 if lost or res["relay_log_tracebacks"] else 0


def _publisher_main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    if spec["mode"] == "flood":
        out = asyncio.run(_publish_flood(spec["url"], spec["sids"], spec["frames"], spec["batch"]))
    else:
        out = asyncio.run(_publish_paced(spec["url"], spec["sids"], spec["rate"], spec["seconds"]))
    print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.relay_throughput", description=__doc__)
    add_arguments(ap)
    ap.add_argument("--_publish", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    if args._publish:
        _publisher_main(args._publish)
        return
    sys.exit(run_from_args(args))


if __name__ == "__main__":
    main()
