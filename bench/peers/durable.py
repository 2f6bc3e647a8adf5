"""tokenrelay's Durable Streams routes side by side with the protocol's reference server,
``@durable-streams/server`` (one Node process), on the same machine, driven by the same
clients (:mod:`bench.peers.durable_clients`).

The systems, every one up for the whole run, in alternating rounds (the order rotated by
one system each round, the first order chosen by ``--seed``), medians of the rounds:

- ``reference-file``: the reference server file-backed (log files + LMDB, an fdatasync
  per append: it keeps what it acknowledges, as tokenrelay does in Redis);
- ``reference-memory``: the reference server in memory (loses everything on a restart);
- ``tokenrelay-1`` / ``tokenrelay-2``: one and two ``tokenrelay relay`` processes on a
  local 3+3 Redis Cluster, the open prefix (``--durable-open-prefix``) on the bench's
  paths; writers and readers split across the relays.

Phases and figures (server CPU from ``/proc/<pid>/stat`` of the server processes; for
tokenrelay Redis CPU from every node's ``INFO cpu``, shown apart and summed):

- ``append``: ``append_conc`` loops appending a JSON message (``pad`` bytes) back to back
  over ``append_streams`` streams, from a writer child process, for ``seconds``:
  ``appends_per_s``, ``server_us``/``redis_us``/``total_us`` per append;
- ``catchup``: ``catchup_readers`` readers at once read a stream of ``catchup_mb`` MB
  (written once per system, 64 KiB appends) from ``-1`` to its tail, again and again for
  half of ``seconds``: ``mb_per_s``, CPU per MB read;
- ``sse`` / ``longpoll``: ``streams`` x ``readers`` live readers (1,000 by default),
  ``rate`` appends/s over the streams from the paced writer child: CPU per delivered
  message (``server_us``, ``redis_us``, ``total_us``), ``p50_ms``/``p99_ms`` from the
  writer's stamp to the reader (the first ``warm_s`` left out), ``lost`` (what the
  streams hold, read back after the round, x readers, minus what the readers received).

``python -m bench.peers.durable [--quick] [--json PATH] [--seed N]``;
``python -m bench.peers.durable --report PATH`` prints the markdown table of a result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import cpu_s, percentile, raise_nofile, run_json, self_cpu_s
from bench.harness import Bench, OnCluster, Outcome, flag
from bench.harness.report import progress as _progress
from bench.peers import durable_clients as dc
from bench.peers.durable_node import ensure_reference, reference_server, reference_version
from bench.peers.durable_report import table
from bench.relay.harness import machine_busy_s, redis_cpu_s, relay_process, slotmap
from relay.protocol.slotmap import Addr, SlotMap

__all__ = [
    "SYSTEMS",
    "Config",
    "add_arguments",
    "main",
    "routes_missing",
    "run",
    "run_from_args",
]

SYSTEMS = ("reference-file", "reference-memory", "tokenrelay-1", "tokenrelay-2")
PREFIX = "bench/"  # the paths the bench uses; tokenrelay's open prefix
STREAM_ROOT = "/v1/stream/"


@dataclass
class Config:
    seconds: float = 10.0  # writing time per round of append, sse and longpoll
    append_streams: int = 16
    append_conc: int = 64  # appends in flight at once
    pad: int = 100  # bytes of padding per message
    catchup_mb: float = 32.0
    catchup_readers: int = 4
    streams: int = 100  # live phases: streams x readers
    readers: int = 10
    rate: float = 200.0  # appends/s over all streams (x readers = deliveries/s)
    warm_s: float = 1.0
    drain_s: float = 15.0  # a live round ends when no message came for this long
    repeats: int = 3
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    profile: str | None = None  # a directory: each relay under cProfile, its stats there

    @classmethod
    def quick(cls) -> Config:
        return cls(seconds=3.0, catchup_mb=8.0, repeats=1)


def routes_missing() -> str | None:
    """None when ``tokenrelay relay`` has the Durable Streams routes (its
    ``--durable-open-prefix`` flag), else why tokenrelay cannot be measured here."""
    import subprocess

    argv = [sys.executable, "-m", "tokenrelay", "relay", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if "--durable-open-prefix" in out.stdout:
        return None
    return "this tree's relay has no Durable Streams routes (no --durable-open-prefix flag)"


@dataclass
class Side:
    """A system under test: its server processes, their stream roots, Redis or not."""

    name: str
    pids: list[int]
    roots: list[str]  # http://127.0.0.1:PORT/v1/stream/
    smap: SlotMap | None

    def url(self, i: int, path: str) -> str:
        return self.roots[i % len(self.roots)] + path

    def server_cpu_s(self) -> float:
        return sum(cpu_s(p) for p in self.pids)

    async def redis_cpu_s(self) -> float:
        return await redis_cpu_s(self.smap) if self.smap is not None else 0.0


class Meter:
    """Server, Redis, this process's and the machine's CPU between start and stop."""

    async def start(self, side: Side) -> None:
        self.side = side
        self.t0 = time.perf_counter()
        self.s0, self.r0 = side.server_cpu_s(), await side.redis_cpu_s()
        self.c0, self.m0 = self_cpu_s(), machine_busy_s()

    async def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        return {
            "wall_s": wall,
            "server_cpu_s": self.side.server_cpu_s() - self.s0,
            "redis_cpu_s": await self.side.redis_cpu_s() - self.r0,
            "readers_cpu_s": self_cpu_s() - self.c0,
            "machine_busy_share": (machine_busy_s() - self.m0) / (wall * (os.cpu_count() or 1)),
        }


def _per(cpu: dict[str, float], n: float) -> dict[str, float]:
    """CPU µs per unit (server, Redis, summed) of ``n`` units, and the cores each of the
    server processes, Redis, the readers (this process) and the machine kept busy: which
    resource ran out."""
    n, wall = max(1e-9, n), max(1e-9, cpu["wall_s"])
    server, red = cpu["server_cpu_s"] / n * 1e6, cpu["redis_cpu_s"] / n * 1e6
    return {
        "server_us": round(server, 1),
        "redis_us": round(red, 1),
        "total_us": round(server + red, 1),
        "server_cores": round(cpu["server_cpu_s"] / wall, 2),
        "redis_cores": round(cpu["redis_cpu_s"] / wall, 2),
        "readers_cores": round(cpu["readers_cpu_s"] / wall, 2),
        "machine_busy_share": round(cpu["machine_busy_share"], 3),
    }


def _writer(spec: dict[str, Any], timeout_s: float) -> Any:
    argv = [sys.executable, "-m", "bench.peers.durable_clients"]
    return run_json(argv, spec, name="durable writer", timeout_s=timeout_s)


async def _streams(
    http: aiohttp.ClientSession, side: Side, tag: str, n: int, ct: str = dc.JSON
) -> list[tuple[str, str]]:
    """``n`` new streams: (url, tail offset) each."""
    urls = [side.url(i, f"{PREFIX}{tag}/{i}") for i in range(n)]
    offsets = await asyncio.gather(*(dc.create(http, u, ct) for u in urls))
    return list(zip(urls, offsets, strict=True))


async def _append(http: aiohttp.ClientSession, side: Side, tag: str, cfg: Config) -> dict[str, Any]:
    made = await _streams(http, side, tag, cfg.append_streams)
    meter = Meter()
    await meter.start(side)
    spec = {"mode": "append", "urls": [u for u, _ in made], "seconds": cfg.seconds,
            "concurrency": cfg.append_conc, "pad": cfg.pad}  # fmt: skip
    got = await _writer(spec, cfg.seconds + 120)
    cpu = await meter.stop()
    return {
        "appends_per_s": round(got["acks"] / got["seconds"]),
        **_per(cpu, got["acks"]),
        "acks": got["acks"],
        "errors": len(got["errors"]),
        "error_sample": got["errors"][:3],
        "writer_cpu_s": round(got["cpu_s"], 2),
    }


async def _fill(http: aiohttp.ClientSession, side: Side, tag: str, mb: float) -> str:
    """A stream of ``mb`` MB of bytes (64 KiB appends) on ``side``; its path."""
    path = f"{PREFIX}{tag}/catchup"
    url = side.url(0, path)
    ct = "application/octet-stream"
    await dc.create(http, url, ct)
    chunk, left = os.urandom(65_536), int(mb * 1_000_000)
    while left > 0:
        await dc.send(http, url, chunk[: min(left, len(chunk))], ct)
        left -= len(chunk)
    return path


async def _catchup(
    http: aiohttp.ClientSession, side: Side, path: str, cfg: Config
) -> dict[str, Any]:
    meter = Meter()
    await meter.start(side)
    t0 = time.perf_counter()
    until = t0 + cfg.seconds / 2

    async def reader(i: int) -> tuple[int, int]:
        """Whole reads from ``-1`` to the tail, again until ``until`` (at least one)."""
        total, requests = 0, 0
        while not total or time.perf_counter() < until:
            got, reqs = await dc.catch_up(http, side.url(i, path))
            total, requests = total + got, requests + reqs
        return total, requests

    done = await asyncio.gather(*(reader(i) for i in range(cfg.catchup_readers)))
    wall = time.perf_counter() - t0
    cpu = await meter.stop()
    total = sum(b for b, _ in done)
    return {
        "mb_per_s": round(total / 1e6 / wall, 1),
        **_per(cpu, total / 1e6),  # µs per MB
        "bytes": total,
        "requests": sum(r for _, r in done),
    }


async def _live(
    http: aiohttp.ClientSession, side: Side, tag: str, mode: str, cfg: Config
) -> dict[str, Any]:
    made = await _streams(http, side, tag, cfg.streams)
    tally = dc.Tally()
    reader = dc.sse_reader if mode == "sse" else dc.longpoll_reader
    readies, tasks = [], []
    for i, (url, offset) in enumerate(made):
        for j in range(cfg.readers):
            ready = asyncio.Event()
            path = url.split(STREAM_ROOT, 1)[1]
            readies.append(ready)
            tasks.append(
                asyncio.create_task(reader(http, side.url(i + j, path), offset, tally, ready))
            )
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 120)
        await asyncio.sleep(1.0)
        meter = Meter()
        await meter.start(side)
        start_ns = time.time_ns()
        spec = {"mode": "paced", "urls": [u for u, _ in made], "rate": cfg.rate,
                "seconds": cfg.seconds, "pad": cfg.pad}  # fmt: skip
        got = await _writer(spec, cfg.seconds + 120)
        # what the streams hold (an append whose answer was lost may be there): the
        # count every reader must reach, no more, no less
        stored = sum(await asyncio.gather(*(dc.held(http, u) for u, _ in made)))
        expected = stored * cfg.readers
        seen, since = tally.received, time.perf_counter()
        while tally.received < expected and time.perf_counter() - since < cfg.drain_s:
            await asyncio.sleep(0.02)
            if tally.received != seen:
                seen, since = tally.received, time.perf_counter()
        cpu = await meter.stop()
    finally:
        await dc.stop_readers(tasks)
    lat = tally.latencies_ms(start_ns + int(cfg.warm_s * 1e9))
    return {
        "delivered_per_s": round(tally.received / max(1e-9, tally.last - tally.first)),
        **_per(cpu, tally.received),
        "p50_ms": round(percentile(lat, 0.50, float("nan")), 2),
        "p99_ms": round(percentile(lat, 0.99, float("nan")), 2),
        "lost": expected - tally.received,  # < 0: a reader got a message twice
        "sent": got["acked"],
        "append_failed": got["failed"],
        "held": stored,
        "received": tally.received,
        "requests": tally.requests,
        "errors": len(tally.errors) + len(got["errors"]),
        "error_sample": (tally.errors + got["errors"])[:3],
        "writer_cpu_s": round(got["cpu_s"], 2),
    }


_SUMMED = frozenset(
    {"lost", "errors", "acks", "sent", "held", "received", "requests", "append_failed"}
)


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, first in rounds[0].items():
        vals = [r[key] for r in rounds]
        if isinstance(first, list):
            out[key] = [v for r in vals for v in r][:3]
        else:
            out[key] = sum(vals) if key in _SUMMED else statistics.median(vals)
    out["rounds"] = rounds
    return out


async def _sides(
    stack: contextlib.AsyncExitStack, cfg: Config, modules: Path | None, url: str | None, tmp: Path
) -> tuple[dict[str, Side], str]:
    """Every system of ``cfg.systems`` started (stopped when ``stack`` closes); where Redis is."""
    sides: dict[str, Side] = {}
    need = cfg.streams * cfg.readers + cfg.append_conc + 200
    for name in cfg.systems:
        if name.startswith("reference"):
            assert modules is not None
            data = tmp / "reference-data" if name == "reference-file" else None
            proc = await stack.enter_async_context(reference_server(modules, tmp, data))
            sides[name] = Side(name, [proc.pid], [proc.base + STREAM_ROOT], None)
    tokenrelay = [n for n in cfg.systems if n.startswith("tokenrelay")]
    where = "none"
    if tokenrelay:
        if url is None:
            from devstack.cluster.launcher import local_cluster

            url = (await stack.enter_async_context(local_cluster(masters=3, replicas=1))).url
            where = "started here (3 masters + 3 replicas)"
        else:
            where = url
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        smap = await slotmap(Addr(host, int(port)))
        relays = []
        if cfg.profile:
            Path(cfg.profile).mkdir(parents=True, exist_ok=True)
        for i in range(max(int(n.rsplit("-", 1)[1]) for n in tokenrelay)):
            # a capacity bench, every client 127.0.0.1, a catch-up stream of 32 MB: no byte bounds
            flags = ("--durable-open-prefix", "/" + PREFIX, "--durable-max-stream-bytes", "0",
                     "--durable-token-bytes", "0", "--durable-address-bytes", "0")  # fmt: skip
            prof = Path(cfg.profile) / f"relay-{i}.prof" if cfg.profile else None
            launch = relay_process(url, tmp, f"durable-bench-{i}", need, flags, prof)
            relays.append(await stack.enter_async_context(launch))
        for n in tokenrelay:
            k = int(n.rsplit("-", 1)[1])
            sides[n] = Side(n, [r.pid for r in relays[:k]],
                            [r.base + STREAM_ROOT for r in relays[:k]], smap)  # fmt: skip
    return sides, where


async def run(cfg: Config, url: str | None = None, modules: Path | None = None) -> dict[str, Any]:
    """Every phase for every system of ``cfg.systems``, or ``{"skipped": reason}`` when the
    reference server cannot be installed or the relay has no Durable Streams routes."""
    started = time.monotonic()
    if modules is None and any(s.startswith("reference") for s in cfg.systems):
        got = await asyncio.to_thread(ensure_reference)
        if isinstance(got, str):
            return {"skipped": got}
        modules = got
    if any(s.startswith("tokenrelay") for s in cfg.systems):
        why = await asyncio.to_thread(routes_missing)
        if why is not None:
            return {"skipped": f"{why}; measure the reference alone with --systems "
                    "reference-file,reference-memory"}  # fmt: skip
    raise_nofile(2 * cfg.streams * cfg.readers + 1_000)
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    order = list(cfg.systems)
    random.Random(cfg.seed).shuffle(order)
    run_id = uuid.uuid4().hex[:8]
    phases: dict[str, dict[str, Any]] = {}
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="durable-bench-")))
        sides, where = await _sides(stack, cfg, modules, url, tmp)
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=dc.KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        http = await stack.enter_async_context(
            aiohttp.ClientSession(connector=conn, timeout=timeout)
        )
        filled = {}
        for name in order:
            _progress(started, f"catch-up stream of {cfg.catchup_mb:g} MB on {name}")
            filled[name] = await _fill(http, sides[name], f"{run_id}/{name}", cfg.catchup_mb)
        for phase in ("append", "catchup", "sse", "longpoll"):
            rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
            for i in range(cfg.repeats):
                for name in order[i % len(order) :] + order[: i % len(order)]:
                    _progress(started, f"{phase} round {i + 1}/{cfg.repeats}: {name}")
                    side, tag = sides[name], f"{run_id}/{name}/{phase}/{i}"
                    if phase == "append":
                        r = await _append(http, side, tag, cfg)
                    elif phase == "catchup":
                        r = await _catchup(http, side, filled[name], cfg)
                    else:
                        r = await _live(http, side, tag, phase, cfg)
                    rounds[name].append(r)
            phases[phase] = {n: _medians(rounds[n]) for n in cfg.systems}
        logs = "".join(p.read_text(errors="replace") for p in tmp.glob("*.log"))
    return {
        "phases": phases,
        "config": {**asdict(cfg), "systems": list(cfg.systems)},
        "order": order,
        "versions": {
            "python": sys.version.split()[0],
            "@durable-streams/server": reference_version(modules) if modules else None,
        },
        "cluster": where,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "server_log_tracebacks": logs.count("Traceback"),
        "seconds": round(time.monotonic() - started, 1),
    }


_D, _Q = Config(), Config.quick()


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "picks the order of the systems")
    seconds: float = flag(_D.seconds, "writing seconds per round", quick=_Q.seconds, above=0)
    repeats: int = flag(_D.repeats, "rounds per system and phase", quick=_Q.repeats, least=1)
    catchup_mb: float = flag(_D.catchup_mb, "MB of the catch-up stream", quick=_Q.catchup_mb,
                             above=0)  # fmt: skip
    systems: str = flag("", f"comma-separated subset of {','.join(SYSTEMS)}")
    profile: str | None = flag(None, "run each relay under cProfile, stats in DIR", metavar="DIR")


def config_from_args(args: argparse.Namespace | Flags) -> Config:
    f = args if isinstance(args, Flags) else BENCH.flags(args)
    cfg = Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, catchup_mb=f.catchup_mb,
                 profile=f.profile)  # fmt: skip
    if f.systems:
        picked = tuple(s.strip() for s in f.systems.split(",") if s.strip())
        unknown = sorted(set(picked) - set(SYSTEMS))
        if unknown:
            raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        cfg.systems = picked
    return cfg


def _run(f: Flags) -> Outcome:
    cfg = config_from_args(f)
    res = asyncio.run(run(cfg, f.redis))
    if "skipped" in res:
        print(f"peer_durable: skipped: {res['skipped']}", file=sys.stderr)
        return Outcome(res)
    bad = sum(
        r.get("lost", 0) + r.get("errors", 0) for p in res["phases"].values() for r in p.values()
    )
    return Outcome(res, table(res), 1 if bad or res["server_log_tracebacks"] else 0)


BENCH = Bench(Flags, _run, uvloop=True, prog="python -m bench.peers.durable", description=__doc__,
              quick_help="1 round of 3 s per phase, 8 MB catch-up", markdown=table)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
