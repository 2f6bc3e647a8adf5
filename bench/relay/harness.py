"""What the relay benchmarks share: the relay under test as its own process, the
publisher child, sessions placed on one master, and CPU accounting of every participant.

Used by :mod:`bench.relay.throughput` (its :mod:`bench.relay.ceilings` and
:mod:`bench.relay.phases`) and the peer comparisons (:mod:`bench.peers.socketio`,
:mod:`bench.peers.ws_clients`, :mod:`bench.peers.node`).
Processes are started and stopped (by pid) with :mod:`devstack.procs`.

Order of use::

    smap = await slotmap(seed)                          # the cluster's slot map
    sids = sessions(n, smap, master)                    # n new sessions, all on master
    async with relay_process(url, log_dir, "a", max_conn) as relay:   # ready to serve
        meter = CpuMeter(relay.pid, smap); await meter.start()
        pub = await run_publisher({"mode": "flood", ...})   # bench.relay.publisher
        cpu = await meter.stop(pub["cpu_s"])
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from bench._util import cpu_s, free_port, run_json, self_cpu_s
from bench.harness.stack import Served
from devstack.procs import http_ok, launched, log_line
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.keys import live_channel, new_session_id
from relay.protocol.slotmap import Addr, SlotMap, parse_shards, slot_of

__all__ = [
    "SECRET",
    "STAMP",
    "CpuMeter",
    "RelayProc",
    "bare_process",
    "machine_busy_s",
    "redis_cpu_s",
    "relay_process",
    "run_publisher",
    "sessions",
    "slotmap",
]

SECRET = "relay-throughput-bench-5e8c1a7f3d9b2064"
STAMP = re.compile(rb"(\d{19});")  # a token's text: the producer's time.time_ns()


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle (``/proc/stat``), since boot."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


async def redis_cpu_s(smap: SlotMap) -> float:
    """CPU seconds of every Redis node (``INFO cpu``), summed."""
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
            cpu_s(self.pid),
            self_cpu_s(),
            await redis_cpu_s(self.smap),
            machine_busy_s(),
        )

    async def stop(self, publisher_cpu_s: float) -> dict[str, float]:
        wall = time.perf_counter() - self.t[0]
        relay = cpu_s(self.pid) - self.t[1]
        own = self_cpu_s() - self.t[2]
        red = await redis_cpu_s(self.smap) - self.t[3]
        machine = machine_busy_s() - self.t[4]
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


async def slotmap(seed: Addr) -> SlotMap:
    """The cluster's slot map, read from ``seed``."""
    return parse_shards(await raw_command(seed, "CLUSTER", "SHARDS"))


def sessions(n: int, smap: SlotMap, master: Addr | None) -> list[str]:
    """``n`` new session ids; all on ``master`` when given."""
    out: list[str] = []
    while len(out) < n:
        sid = new_session_id()
        if master is None or smap.node_for(slot_of(live_channel(sid))) == master:
            out.append(sid)
    return out


async def run_publisher(spec: dict[str, Any]) -> dict[str, Any]:
    """Run a publisher child (:mod:`bench.relay.publisher`) and return its result."""
    argv = [sys.executable, "-m", "bench.relay.publisher"]
    return await run_json(argv, spec, name="publisher", timeout_s=300)


RelayProc = Served  # a relay (or a peer server) under test: its process and port


@contextlib.asynccontextmanager
async def relay_process(
    url: str,
    log_dir: Path,
    name: str,
    max_conn: int,
    extra: Sequence[str] = (),
    profile: Path | None = None,
) -> AsyncIterator[RelayProc]:
    """``tokenrelay relay`` as its own process (``extra``: more flags; ``profile``: under
    cProfile, its stats written there when it stops), ready to serve; stopped by pid."""
    port = free_port()
    under = ("-m", "cProfile", "-o", str(profile)) if profile is not None else ()
    argv = [
        sys.executable, *under, "-m", "tokenrelay", "relay", "--port", str(port),
        "--redis", url, "--secret", SECRET, "--relay-id", name,
        "--max-connections", str(max_conn), "--reap-after-s", "0",
        "--max-streams-per-address", "0",  # every client of the bench is 127.0.0.1
        "--max-connections-per-address", "0",
        "--max-streams-per-token", "0",  # a capacity bench, not an abuse test
        "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    ready = http_ok(f"http://127.0.0.1:{port}/readyz")
    async with launched(argv, log=log_dir / f"{name}.log", ready=ready, name=name) as proc:
        yield RelayProc(proc, port)


@contextlib.asynccontextmanager
async def bare_process(url: str, log_dir: Path) -> AsyncIterator[RelayProc]:
    """:mod:`bench.relay.bare` (the least a relay does) as its own process; stopped by pid."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.relay.bare", url, str(port)]
    name = "bench-bare"
    async with launched(
        argv, log=log_dir / f"{name}.log", ready=log_line("ready"), name=name
    ) as proc:
        yield RelayProc(proc, port)
