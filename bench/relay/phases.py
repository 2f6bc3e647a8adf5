"""The phases of :mod:`bench.relay.throughput` that measure one relay process (the
ceilings it is measured against are in :mod:`bench.relay.ceilings`, what reads the relay
during a phase in :mod:`bench.relay.instruments`):

- :func:`drain_phase`: the relay SIGSTOPped while the publisher writes, then continued:
  token frames received by all clients per second (``viewers`` per session);
- :func:`latency_phase`: a paced publisher, one viewer per session, producer clock to
  client read;
- :func:`idle_phase`: VmRSS per idle SSE connection;
- :func:`idle_ws_phase`: VmRSS of a fresh relay before and after N idle WebSocket
  connections (:func:`ws_open`: a raw-socket handshake each, one session each), per
  connection;
- :func:`replay_phase`: one session of 10,000 frames, replayed from offset 0 by 50 SSE
  clients at once: frames delivered / wall seconds, and the relay's peak VmRSS
  (``VmHWM`` of a relay process started for this phase);
- :func:`median_round`: the median of several rounds of one phase.

The SSE clients are the raw-socket ones of :mod:`bench.relay.sse_clients`; the relay
process and the publisher child come from :mod:`bench.relay.harness`. :class:`Config`
(the sizes of every phase) is re-exported by :mod:`bench.relay.throughput`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import cpu_s, ns_ms, percentile, rss_kb
from bench.relay.harness import CpuMeter, RelayProc, run_publisher, sessions
from bench.relay.instruments import loop_lag, metrics_text, profiled, relay_view
from bench.relay.sse_clients import Tally, close_clients, open_clients, wait_all
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.protocol.auth import issue_token
from relay.protocol.slotmap import SlotMap

__all__ = [
    "Config",
    "drain_phase",
    "idle_phase",
    "idle_ws_phase",
    "latency_phase",
    "median_round",
    "replay_phase",
    "ws_open",
]

NAN = float("nan")


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
    lat_tick_ms: float = 1.0  # the paced publisher's tick: each tick sends its share at once
    lat_stamp: str = "send"  # paced frames stamped at their tick's write ("send") or as made
    replay_frames: int = 10_000  # one session, replayed from 0 by replay_clients at once
    replay_clients: int = 50
    profile: str = ""  # a directory: py-spy samples the relay during the 5,000/s phase
    profile_native: bool = False  # ... with C frames and system calls (py-spy --native)
    phases: tuple[str, ...] = ()  # which phases of bench.relay.throughput run; () = all

    @classmethod
    def quick(cls) -> Config:
        return cls(sessions=400, frames=250, lat_seconds=4.0, idle=2_000)


# -- drain and latency: SSE clients of a relay under load ----------------------------------


async def drain_phase(
    relay: RelayProc, url: str, smap: SlotMap, sids: list[str], viewers: int, cfg: Config
) -> dict[str, Any]:
    """SIGSTOP the relay, publish, SIGCONT, time until every client has every token."""
    tally = Tally()
    clients = await open_clients(
        relay.port, [s for s in sids for _ in range(viewers)], tally, cfg.connect_window
    )
    try:
        await asyncio.sleep(0.5)
        meter = CpuMeter(relay.pid, smap)
        spec = {"mode": "flood", "url": url, "sids": sids, "frames": cfg.frames, "batch": cfg.batch}
        os.kill(relay.pid, signal.SIGSTOP)
        try:
            pub = await run_publisher(spec)
        finally:
            await meter.start()
            os.kill(relay.pid, signal.SIGCONT)
        t0 = time.perf_counter()
        tally.expected = pub["sent"] * viewers
        await wait_all(tally)
        took = tally.last - t0
        cpu = await meter.stop(0.0)
        lost = sum(max(0, cfg.frames - c.tokens) for c in clients)
    finally:
        close_clients(clients)
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


async def latency_phase(
    relay: RelayProc,
    url: str,
    smap: SlotMap,
    sids: list[str],
    cfg: Config,
    profile: Path | None = None,
    *,
    metrics: bool = True,
) -> dict[str, Any]:
    """Paced publisher, one SSE client per session; ``profile``: py-spy samples the relay
    while the publisher runs (not while the clients connect); ``metrics``: read the
    relay's ``/metrics`` before and after (the bare relay has none)."""
    tally = Tally(record_latency=True)
    clients = await open_clients(relay.port, sids, tally, cfg.connect_window)
    try:
        await asyncio.sleep(0.5)
        metrics_before = await metrics_text(relay) if metrics else ""
        meter = CpuMeter(relay.pid, smap)
        await meter.start()
        warm = 1.0
        spec = {
            "mode": "paced",
            "url": url,
            "sids": sids,
            "rate": cfg.lat_rate,
            "seconds": warm + cfg.lat_seconds,
            "tick_s": cfg.lat_tick_ms / 1000,
            "stamp": cfg.lat_stamp,
        }
        async with profiled(relay.pid, profile, warm + cfg.lat_seconds, native=cfg.profile_native):
            pub = await run_publisher(spec)
        tally.expected = pub["sent"]
        backlog_s = await wait_all(tally)
        cpu = await meter.stop(pub["cpu_s"])
        lost = tally.expected - tally.tokens
        lag: dict[str, Any] = {}
        view: dict[str, Any] = {}
        if metrics:
            metrics_after = await metrics_text(relay)
            lag = loop_lag(metrics_before, metrics_after)
            view = relay_view(metrics_before, metrics_after)
    finally:
        close_clients(clients)
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
        "p50_ms": ns_ms(percentile(lat, 0.50, NAN)),
        "p90_ms": ns_ms(percentile(lat, 0.90, NAN)),
        "p99_ms": ns_ms(percentile(lat, 0.99, NAN)),
        "max_ms": round(lat[-1] / 1e6, 3) if lat else float("nan"),
        "seconds": cfg.lat_seconds,
        "cpu": cpu,
        "relay_cpu_us_per_frame": round(cpu["relay_cpu_s"] / tally.tokens * 1e6, 1)
        if tally.tokens
        else 0.0,
        "relay_loop_lag": lag,
        "relay_view": view,
    }


# -- idle connections: the relay's memory per connection -----------------------------------


async def idle_phase(
    relay: RelayProc, smap: SlotMap, cfg: Config, *, shared: bool
) -> dict[str, Any]:
    """VmRSS of the relay before and after ``cfg.idle`` idle SSE connections, each on
    its own session, or (``shared``) all on one session."""
    warm_tally = Tally()
    warm = await open_clients(relay.port, sessions(1, smap, None), warm_tally, 1)
    await asyncio.sleep(1.5)
    before = rss_kb(relay.pid)
    tally = Tally()
    sids = sessions(1, smap, None) * cfg.idle if shared else sessions(cfg.idle, smap, None)
    t0, cpu0 = time.perf_counter(), cpu_s(relay.pid)
    clients = await open_clients(relay.port, sids, tally, cfg.connect_window)
    took, cpu_open = time.perf_counter() - t0, cpu_s(relay.pid) - cpu0
    try:
        cpu1 = cpu_s(relay.pid)
        await asyncio.sleep(2.0)
        idle_cpu = (cpu_s(relay.pid) - cpu1) / 2.0
        after = rss_kb(relay.pid)
        text = await metrics_text(relay)
        conns = sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln.startswith("tokenrelay_relay_connections{")
        )
    finally:
        close_clients(clients)
        close_clients(warm)
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


async def _answer_pings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the server's frames; answer each ping with a pong (masked, as a client's)."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            b0, b1 = await reader.readexactly(2)
            n = b1 & 0x7F
            if n >= 126:
                n = int.from_bytes(await reader.readexactly(2 if n == 126 else 8), "big")
            payload = await reader.readexactly(n)
            if b0 & 0x0F == 0x9 and n < 126:
                mask = os.urandom(4)
                body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                writer.write(bytes((0x8A, 0x80 | n)) + mask + body)


async def ws_open(
    port: int, sid: str, secret: str, pongs: set[asyncio.Task[None]] | None = None
) -> asyncio.StreamWriter:
    """A WebSocket stream past the relay's hello; with ``pongs``, a task (added to the
    set) keeps answering the relay's pings, as a browser does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    token = issue_token(secret, sid, 3600, time.time())
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /v1/sessions/{sid}/ws?token={token} HTTP/1.1\r\nHost: bench\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {key}\r\n\r\n".encode()
    )
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(head[:200].decode(errors="replace"))
        b0, b1 = await reader.readexactly(2)  # the hello: one unmasked text frame
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(await reader.readexactly(2), "big")
        hello = await reader.readexactly(n)
    if b0 != 0x81 or b'"hello"' not in hello:
        raise ConnectionError(f"no hello: {hello[:100]!r}")
    if pongs is not None:
        pongs.add(asyncio.create_task(_answer_pings(reader, writer)))
    return writer


async def idle_ws_phase(
    pid: int, port: int, sids: Sequence[str], secret: str, window: int
) -> dict[str, Any]:
    warm = await ws_open(port, sids[0], secret)
    await asyncio.sleep(1.5)
    before = rss_kb(pid)
    sem = asyncio.Semaphore(window)

    async def one(sid: str) -> asyncio.StreamWriter:
        async with sem:
            return await ws_open(port, sid, secret)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in sids[1:]), return_exceptions=True)
    took = time.perf_counter() - t0
    writers = [r for r in results if isinstance(r, asyncio.StreamWriter)]
    try:
        bad = [r for r in results if isinstance(r, BaseException)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(results)} WebSockets failed: {bad[0]!r}")
        await asyncio.sleep(2.0)
        after = rss_kb(pid)
    finally:
        for w in [warm, *writers]:
            w.transport.abort()
    n = len(writers)
    return {
        "connections": n,
        "open_seconds": round(took, 2),
        "rss_before_kb": before,
        "rss_after_kb": after,
        "kb_per_conn": round((after - before) / n, 2) if n else 0.0,
    }


# -- replay --------------------------------------------------------------------------------


async def _publish_session(url: str, sid: str, frames: int) -> int:
    redis = connect(url)
    await redis.initialize()
    try:
        gen = await Publisher(redis).open_generation(sid)
        last = 0
        for i in range(0, frames, 100):
            drafts = [
                Draft(kind="token", text=f"token {j} ") for j in range(i, min(i + 100, frames))
            ]
            last = (await gen.publish(drafts))[-1]
        return last
    finally:
        await redis.aclose()


async def _replay_client(port: int, sid: str, secret: str, last: int) -> tuple[int, str]:
    """Read an SSE replay from 0 until ``id: last``; (events seen, how it ended).

    A raw socket counting ``id:`` lines, not :class:`relay.protocol.sse_reader.SSEDecoder`:
    it measures how fast the relay writes a backlog, so the reader must cost next to
    nothing next to it (50 of them share a core with the relay)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    token = issue_token(secret, sid, 3600, time.time())
    writer.write(
        f"GET /v1/sessions/{sid}/events?token={token} HTTP/1.1\r\nHost: bench\r\n"
        "Last-Event-ID: 0\r\n\r\n".encode()
    )
    end = f"id: {last}\n".encode()
    events = 0
    tail = b""
    try:
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return events, "closed by the relay"
            buf = tail + chunk
            events += buf.count(b"\nid: ") - tail.count(b"\nid: ")
            if end in buf:
                return events, "complete"
            if b": close " in buf:
                return events, buf[buf.index(b": close ") :].split(b"\n", 1)[0].decode()
            tail = buf[-64:]
    finally:
        writer.transport.abort()


async def replay_phase(
    url: str, pid: int, port: int, sid: str, secret: str, frames: int, clients: int
) -> dict[str, Any]:
    last = await _publish_session(url, sid, frames)
    before = rss_kb(pid)
    t0 = time.perf_counter()
    async with asyncio.timeout(180):
        results = await asyncio.gather(
            *(_replay_client(port, sid, secret, last) for _ in range(clients))
        )
    took = time.perf_counter() - t0
    delivered = sum(n for n, _ in results)
    ends: dict[str, int] = {}
    for _, how in results:
        ends[how] = ends.get(how, 0) + 1
    return {
        "frames": last,
        "clients": clients,
        "complete": ends.get("complete", 0),
        "endings": ends,
        "delivered": delivered,
        "seconds": round(took, 3),
        "frames_per_s": round(delivered / took) if took > 0 else 0,
        "rss_before_kb": before,
        "rss_peak_kb": rss_kb(pid, "VmHWM"),
    }


# -- rounds --------------------------------------------------------------------------------


def median_round(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round with the median ``key``, plus every round's rate and the losses of all."""
    med = dict(sorted(rounds, key=lambda r: float(r[key]))[len(rounds) // 2])
    med["rounds_per_s"] = [r[key] for r in rounds]
    med["lost_all_rounds"] = sum(int(r.get("lost", r["sent"] - r["received"])) for r in rounds)
    return med
