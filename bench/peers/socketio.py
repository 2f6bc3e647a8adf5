"""tokenrelay's relay side by side with the peer a user would pick instead: Socket.IO 4.8
with ``@socket.io/redis-adapter`` 8.3's sharded adapter (SSUBSCRIBE / SPUBLISH), on the
same Redis 7 Cluster, on the same machine, driven by the same clients.

Per phase, both systems in alternating rounds (``repeats``, the first system chosen by
``--seed``), each round on fresh sessions:

- ``1000x1_<rate>``: 1,000 sessions x 1 WebSocket client each, ``rate`` messages/s in
  all (2,000, 5,000 and 10,000);
- ``100x10_20000``: 100 sessions x 10 clients each, 2,000 messages/s published =
  20,000 deliveries/s;
- ``idle``: a fresh server process of each system, VmRSS before and after ``idle``
  WebSocket connections on a session each, divided by their number.

The systems under test, each one process:

- tokenrelay: ``python -m tokenrelay relay`` (:func:`bench.relay.harness.relay_process`),
  clients on ``/v1/sessions/{sid}/ws``. Publisher: the project's paced publisher
  (``bench.relay.publisher``, a child process): one call per message of the producer's
  publish script (fence check, XADD to the backlog, SPUBLISH, offset, TTLs).
- Socket.IO: ``node bench/peers/js/socketio_server.cjs`` (WebSocket transport only, the
  sharded adapter in its default ``dynamic`` mode: one shard channel per room, each
  client in the room of its session). Publisher: ``node bench/peers/js/socketio_emit.cjs``, a
  second Socket.IO instance on the same cluster broadcasting with ``io.to(room).emit``
  (the adapter's own path to Redis: one SPUBLISH per message). Installed with npm into
  ``~/.cache/tokenrelay/peer-socketio`` (``$XDG_CACHE_HOME`` is honoured); without node or
  npm, or when the install fails, the run is skipped with the reason.

Both publishers pace the same way (a 10 ms tick, the same share of sessions per tick).
The clients are :mod:`bench.peers.ws_clients` (aiohttp, this process), one message per frame.

Figures per phase and system (medians of the rounds; ``lost`` sums them):
``offered_per_s`` (deliveries the publisher asked for per second), ``delivered_per_s``
(deliveries received / seconds from the first to the last), ``lost`` (asked minus
received), ``cpu_us_per_msg`` (server process CPU from ``/proc/<pid>/stat`` between the
first and the last delivery, sampled every 50 ms, / deliveries), ``p50_ms`` / ``p99_ms``
(send time in the message to arrival, the first ``warm_s`` of sends left out),
``behind_s`` (last delivery after the publisher finished), ``redis_cpu_us_per_msg``
(every node's INFO cpu over the round / messages published).

Call order: :func:`main` (or ``python -m bench peer_socketio``) -> :func:`run_from_args`
-> :func:`run` with a :class:`Config`: npm install (:func:`ensure_socketio`) -> cluster ->
relay + Socket.IO server -> rounds -> idle on fresh servers -> JSON and table.
``python -m bench.peers.socketio [--quick] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._util import cpu_s, percentile, raise_nofile, rss_kb, self_cpu_s
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.harness.report import progress as _progress
from bench.peers.node import emit, ensure_socketio, installed_versions, socketio_server
from bench.peers.ws_clients import Kind, Tally, close_clients, open_clients
from bench.relay.harness import (
    RelayProc,
    machine_busy_s,
    redis_cpu_s,
    relay_process,
    run_publisher,
    sessions,
    slotmap,
)
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, SlotMap

__all__ = ["Config", "add_arguments", "main", "run", "run_from_args"]

SYSTEMS: tuple[Kind, Kind] = ("tokenrelay", "socketio")


@dataclass
class Config:
    sessions: int = 1_000  # sessions (= clients) of the rate phases
    rates: tuple[int, ...] = (2_000, 5_000, 10_000)  # messages/s over all sessions
    fan_sessions: int = 100
    fan_viewers: int = 10
    fan_deliveries: int = 20_000  # deliveries/s of the fan-out phase
    seconds: float = 10.0  # publishing time per round, warm-up included
    warm_s: float = 1.0  # sends left out of the latency figures
    repeats: int = 3  # rounds per system and phase; medians are reported
    idle: int = 10_000  # idle WebSocket connections per system
    connect_window: int = 200  # handshakes in flight at once
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(seconds=3.0, repeats=1, idle=1_000)


# -- measurement helpers -----------------------------------------------------------------


class CpuSampler:
    """A process's CPU seconds every ``every_s``; :meth:`between` interpolates."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid = pid
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.samples = [(time.perf_counter(), cpu_s(self.pid))]
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.samples.append((time.perf_counter(), cpu_s(self.pid)))

    async def stop(self) -> None:
        """Stop sampling (once; later calls do nothing) and take a last sample."""
        if self.task is None:
            return
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.task = None
        self.samples.append((time.perf_counter(), cpu_s(self.pid)))

    def _at(self, t: float) -> float:
        s = self.samples
        for (t0, c0), (t1, c1) in itertools.pairwise(s):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return s[0][1] if t < s[0][0] else s[-1][1]

    def between(self, t0: float, t1: float) -> float:
        return self._at(t1) - self._at(t0)


def _channel(kind: Kind, sid: str) -> str:
    return live_channel(sid) if kind == "tokenrelay" else f"socket.io#/#{sid}#"


async def _wait_subscribed(smap: SlotMap, channels: Sequence[str], timeout_s: float = 60) -> None:
    """Until every channel has a shard subscriber somewhere in the cluster."""
    deadline = time.monotonic() + timeout_s
    todo = set(channels)
    while todo:
        for node in smap.nodes():
            reply = await raw_command(node, "PUBSUB", "SHARDNUMSUB", *sorted(todo))
            for name, n in zip(reply[::2], reply[1::2], strict=True):
                if int(n) > 0:
                    todo.discard(name.decode())
        if todo and time.monotonic() > deadline:
            raise RuntimeError(f"{len(todo)} channels have no subscriber after {timeout_s} s")
        if todo:
            await asyncio.sleep(0.05)


async def _wait_delivered(tally: Tally, expected: int, stall_s: float = 5.0) -> None:
    seen, since = tally.received, time.perf_counter()
    while tally.received < expected:
        await asyncio.sleep(0.02)
        if tally.received != seen:
            seen, since = tally.received, time.perf_counter()
        elif time.perf_counter() - since > stall_s:
            return


# -- rounds and phases -------------------------------------------------------------------


@dataclass
class Side:
    """One system under test: its server process and how to publish to it."""

    kind: Kind
    server: RelayProc
    url: str
    seed: Addr
    modules: Path

    async def publish(self, sids: list[str], rate: float, seconds: float) -> dict[str, Any]:
        if self.kind == "tokenrelay":
            spec = {
                "mode": "paced",
                "url": self.url,
                "sids": sids,
                "rate": rate,
                "seconds": seconds,
                # a stamp per frame as it is made, as the Node emitter does per emit
                "stamp": "build",
            }
            return await run_publisher(spec)
        return await emit(self.modules, self.seed, sids, rate, seconds)


async def _round(
    side: Side, smap: SlotMap, sids: list[str], viewers: int, rate: float, cfg: Config
) -> dict[str, Any]:
    """One round: open the clients, publish ``rate`` messages/s per session, count."""
    tally = Tally(time.time_ns if side.kind == "tokenrelay" else time.monotonic_ns)
    clients = await open_clients(
        side.kind, side.server.port, [s for s in sids for _ in range(viewers)], tally,
        cfg.connect_window,
    )  # fmt: skip
    sampler = CpuSampler(side.server.pid)
    try:
        await _wait_subscribed(smap, [_channel(side.kind, s) for s in sids])
        await asyncio.sleep(0.5)
        redis0 = await redis_cpu_s(smap)
        own0, busy0, t0 = self_cpu_s(), machine_busy_s(), time.perf_counter()
        sampler.start()
        pub = await side.publish(sids, rate, cfg.seconds)
        expected = int(pub["sent"]) * viewers
        await _wait_delivered(tally, expected)
        await sampler.stop()
        redis_s = await redis_cpu_s(smap) - redis0
        own_s, busy_s = self_cpu_s() - own0, machine_busy_s() - busy0
        wall_s = time.perf_counter() - t0
    finally:
        await sampler.stop()
        await close_clients(clients)
    span = tally.last - tally.first
    cpu = sampler.between(tally.first, tally.last) if tally.received else 0.0
    lat = tally.latencies_ms(cfg.warm_s)
    return {
        "offered_per_s": round(expected / pub["seconds"]),
        "delivered_per_s": round(tally.received / span) if span > 0 else 0,
        "lost": expected - tally.received,
        "cpu_us_per_msg": round(cpu / tally.received * 1e6, 1) if tally.received else 0.0,
        "p50_ms": round(percentile(lat, 0.50, float("nan")), 2),
        "p99_ms": round(percentile(lat, 0.99, float("nan")), 2),
        # the first delivery stands for the first send: how long after the last send
        # (first + the publisher's own duration) the last delivery came
        "behind_s": round(max(0.0, span - pub["seconds"]), 2),
        "redis_cpu_us_per_msg": round(redis_s / max(1, pub["sent"]) * 1e6, 1),
        # the whole path (bench.peers.pathcost): the producer's pacing, every Redis node
        "producer_cpu_s": round(pub.get("publish_cpu_s", pub["cpu_s"]), 3),
        "redis_cpu_s": round(redis_s, 3),
        "sent": pub["sent"],
        "received": tally.received,
        "messages": tally.messages,
        "server_cpu_s": round(cpu, 2),
        "publisher_cpu_s": round(pub["cpu_s"], 2),
        "clients_cpu_s": round(own_s, 2),
        "machine_busy_cpu_s": round(busy_s, 2),
        "machine_capacity_cpu_s": round(wall_s * (os.cpu_count() or 1), 2),
        "publish_errors": int(pub.get("errors", 0)) + int(pub.get("failed", 0)),
        "client_errors": len(tally.errors),
        "handshake_retries": tally.retries,
        "resumes": tally.resumes,
        "samples": len(lat),
    }


_SUMMED = frozenset({"lost", "client_errors", "publish_errors", "handshake_retries", "resumes"})


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds; counts of trouble (:data:`_SUMMED`) summed."""
    out: dict[str, Any] = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds]
        out[key] = sum(vals) if key in _SUMMED else statistics.median(vals)
    out["rounds"] = rounds
    return out


async def _idle(side: Side, smap: SlotMap, n: int, window: int) -> dict[str, Any]:
    """VmRSS of a fresh server before and after ``n`` idle connections, a session each."""
    clock = time.time_ns if side.kind == "tokenrelay" else time.monotonic_ns
    warm_sids = sessions(1, smap, None)
    warm = await open_clients(side.kind, side.server.port, warm_sids, Tally(clock), 1)
    try:
        await _wait_subscribed(smap, [_channel(side.kind, s) for s in warm_sids])
        await asyncio.sleep(1.5)
        before = rss_kb(side.server.pid)
        sids = sessions(n, smap, None)
        tally = Tally(clock)
        t0 = time.perf_counter()
        clients = await open_clients(side.kind, side.server.port, sids, tally, window)
        try:
            opened = time.perf_counter() - t0
            await _wait_subscribed(smap, [_channel(side.kind, s) for s in sids])
            await asyncio.sleep(2.0)
            cpu0 = cpu_s(side.server.pid)
            await asyncio.sleep(2.0)
            idle_share = (cpu_s(side.server.pid) - cpu0) / 2.0
            after = rss_kb(side.server.pid)
        finally:
            await close_clients(clients)
    finally:
        await close_clients(warm)
    return {
        "connections": n,
        "rss_before_kb": before,
        "rss_after_kb": after,
        "rss_kb_per_conn": round((after - before) / n, 2),
        "cpu_share_when_idle": round(idle_share, 3),
        "open_seconds": round(opened, 2),
        "client_errors": len(tally.errors),
        "handshake_retries": tally.retries,
    }


def _phases(cfg: Config) -> list[tuple[str, int, int, float]]:
    """(name, sessions, viewers per session, messages/s per session) of every phase."""
    out = [(f"{cfg.sessions}x1_{r}", cfg.sessions, 1, r / cfg.sessions) for r in cfg.rates]
    per_session = cfg.fan_deliveries / cfg.fan_viewers / cfg.fan_sessions
    name = f"{cfg.fan_sessions}x{cfg.fan_viewers}_{cfg.fan_deliveries}"
    return [*out, (name, cfg.fan_sessions, cfg.fan_viewers, per_session)]


async def run(cfg: Config, url: str | None = None, modules: Path | None = None) -> dict[str, Any]:
    """Every phase on the cluster at ``url`` (or on a 3+3 cluster started here), or
    ``{"skipped": reason}`` when Socket.IO cannot be installed."""
    started = time.monotonic()
    if modules is None:
        got = await asyncio.to_thread(ensure_socketio)
        if isinstance(got, str):
            return {"skipped": got}
        modules = got
    raise_nofile(cfg.idle + max(cfg.sessions, cfg.fan_sessions * cfg.fan_viewers) + 1_000)
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    order = list(SYSTEMS)
    random.Random(cfg.seed).shuffle(order)
    async with bench_stack("peer-bench-") as st:
        own = url is None
        url = await st.cluster(masters=3, replicas=1, url=url)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        seed = Addr(host, int(port))
        smap = await slotmap(seed)
        log_dir = st.log_dir
        max_conn = max(cfg.sessions, cfg.fan_sessions * cfg.fan_viewers) + 100

        async def sides(
            within: contextlib.AsyncExitStack, tag: str, conns: int
        ) -> dict[Kind, Side]:
            """A relay and a Socket.IO server, both stopped when ``within`` closes."""
            relay = await within.enter_async_context(relay_process(url, log_dir, tag, conns))
            sio = await within.enter_async_context(socketio_server(modules, seed, log_dir))
            return {
                "tokenrelay": Side("tokenrelay", relay, url, seed, modules),
                "socketio": Side("socketio", sio, url, seed, modules),
            }

        async with contextlib.AsyncExitStack() as servers:
            both = await sides(servers, "peer-bench-relay", max_conn)
            phases: dict[str, dict[str, Any]] = {}
            for name, n, viewers, rate in _phases(cfg):
                rounds: dict[Kind, list[dict[str, Any]]] = {k: [] for k in SYSTEMS}
                for i in range(cfg.repeats):
                    for kind in order if i % 2 == 0 else order[::-1]:
                        _progress(started, f"{name} round {i + 1}/{cfg.repeats}: {kind}")
                        sids = sessions(n, smap, None)
                        rounds[kind].append(
                            await _round(both[kind], smap, sids, viewers, rate, cfg)
                        )
                phases[name] = {k: _medians(v) for k, v in rounds.items()}
        idle: dict[str, dict[str, Any]] = {}
        for kind in order:
            async with contextlib.AsyncExitStack() as servers:
                fresh = await sides(servers, f"peer-bench-idle-{kind}", cfg.idle + 100)
                _progress(started, f"idle: {cfg.idle} WebSocket connections on {kind}")
                idle[kind] = await _idle(fresh[kind], smap, cfg.idle, cfg.connect_window)
        logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
    return {
        "phases": phases,
        "idle": idle,
        "config": asdict(cfg),
        "first_system": order[0],
        "versions": {"python": sys.version.split()[0], **installed_versions(modules)},
        "cluster": "started here (3 masters + 3 replicas)" if own else url,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "server_log_tracebacks": logs.count("Traceback"),
        "seconds": round(time.monotonic() - started, 1),
    }


def _table(res: dict[str, Any]) -> str:
    head = ("phase", "system", "offered/s", "delivered/s", "lost", "CPU µs/msg", "p50 ms",
            "p99 ms", "behind s")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for name, by_kind in res["phases"].items():
        for kind in SYSTEMS:
            r = by_kind[kind]
            rows.append((name, kind, f"{r['offered_per_s']:,.0f}", f"{r['delivered_per_s']:,.0f}",
                         str(r["lost"]), f"{r['cpu_us_per_msg']:.1f}", f"{r['p50_ms']:.2f}",
                         f"{r['p99_ms']:.2f}", f"{r['behind_s']:.2f}"))  # fmt: skip
    for kind in SYSTEMS:
        i = res["idle"][kind]
        conns, cpu = f"{i['connections']:,} conns", f"CPU {i['cpu_share_when_idle']}"
        rows.append(("idle", kind, "", "", "", f"{i['rss_kb_per_conn']} KB/conn", conns, cpu, ""))
    w = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(f"{v:{w[c]}}" for c, v in enumerate(r)).rstrip() for r in rows)


_D, _Q = Config(), Config.quick()


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "picks the system of the first round")
    seconds: float = flag(_D.seconds, "publishing seconds per round", quick=_Q.seconds, above=0)
    repeats: int = flag(_D.repeats, "rounds per system and phase", quick=_Q.repeats, least=1)
    idle: int = flag(_D.idle, "idle connections per system", quick=_Q.idle, least=0)


def config_from_args(args: argparse.Namespace | Flags) -> Config:
    f = args if isinstance(args, Flags) else BENCH.flags(args)
    return Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, idle=f.idle)


def _run(f: Flags) -> Outcome:
    res = asyncio.run(run(config_from_args(f), f.redis))
    if "skipped" in res:
        print(f"peer_socketio: skipped: {res['skipped']}", file=sys.stderr)
        return Outcome(res)
    bad = sum(r[k]["lost"] + r[k]["client_errors"] for r in res["phases"].values() for k in SYSTEMS)
    return Outcome(res, _table(res), 1 if bad or res["server_log_tracebacks"] else 0)


BENCH = Bench(Flags, _run, uvloop=True, prog="python -m bench.peers.socketio", description=__doc__,
              quick_help="1 round of 3 s per phase, 1,000 idle")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
