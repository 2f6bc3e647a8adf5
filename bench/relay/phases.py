"""The phases of :mod:`bench.relay.throughput` that measure one relay process with the
raw-socket SSE clients of :mod:`bench.relay.sse_clients` (the others are in
:mod:`bench.relay.phases_more`):

- :func:`raw_phase`: the ceiling, one redis-py connection draining a backlog;
- :func:`drain_phase`: the relay SIGSTOPped while the publisher writes, then continued:
  token frames received by all clients per second (``viewers`` per session);
- :func:`latency_phase`: a paced publisher, one viewer per session, producer clock to
  client read;
- :func:`idle_phase`: VmRSS per idle SSE connection;
- :func:`median_round`: the median of several rounds of one phase;

:class:`Config` (the sizes of every phase) is re-exported by :mod:`bench.relay.throughput`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aredis

from bench._util import cpu_s, ns_ms, percentile, rss_kb
from bench.relay import phases_more as relay_phases
from bench.relay.harness import CpuMeter, RelayProc, run_publisher, sessions
from bench.relay.sse_clients import Tally, close_clients, open_clients, wait_all
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, SlotMap

__all__ = [
    "Config",
    "drain_phase",
    "idle_phase",
    "latency_phase",
    "median_round",
    "metrics_text",
    "raw_phase",
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


async def raw_phase(url: str, master: Addr, sids: list[str], cfg: Config) -> dict[str, Any]:
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
        pub = await run_publisher(
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


async def metrics_text(relay: RelayProc) -> str:
    async with aiohttp.ClientSession() as http, http.get(relay.base + "/metrics") as r:
        return await r.text()


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
        async with relay_phases.profiled(
            relay.pid, profile, warm + cfg.lat_seconds, native=cfg.profile_native
        ):
            pub = await run_publisher(spec)
        tally.expected = pub["sent"]
        backlog_s = await wait_all(tally)
        cpu = await meter.stop(pub["cpu_s"])
        lost = tally.expected - tally.tokens
        lag: dict[str, Any] = {}
        view: dict[str, Any] = {}
        if metrics:
            metrics_after = await metrics_text(relay)
            lag = relay_phases.loop_lag(metrics_before, metrics_after)
            view = relay_phases.relay_view(metrics_before, metrics_after)
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
        async with aiohttp.ClientSession() as http, http.get(relay.base + "/metrics") as r:
            text = await r.text()
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


def median_round(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round with the median ``key``, plus every round's rate and the losses of all."""
    med = dict(sorted(rounds, key=lambda r: float(r[key]))[len(rounds) // 2])
    med["rounds_per_s"] = [r[key] for r in rounds]
    med["lost_all_rounds"] = sum(int(r.get("lost", r["sent"] - r["received"])) for r in rounds)
    return med
