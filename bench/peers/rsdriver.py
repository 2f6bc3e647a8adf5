"""The Node side of :mod:`bench.peers.resumable`: resumable-stream's npm install, its Redis
targets, and one round of its two processes (the scripts are ``bench/peers/js/resumable_*.mjs``).

- :func:`ensure_modules`: ``npm ci`` of the committed ``bench/peers/js/resumable/``
  package.json + package-lock.json (resumable-stream 2.2.13, redis 4.7.1) into
  ``~/.cache/tokenrelay/peer-resumable`` (``$XDG_CACHE_HOME`` is honoured), once per lock
  file; the ``node_modules`` directory, or the reason it cannot (no node or npm, node older
  than 18, the registry unreachable).
- :class:`Target`: the Redis the library runs on, a single node or the 3+3 cluster, and
  its nodes' CPU (``INFO cpu``) and cluster-bus counters (``CLUSTER INFO``).
- :func:`run_round`: the producer process (``resumable_producer.mjs``: the streams and
  their first readers, the route's own responses) and, when a phase has more readers or
  a resume storm, the viewers' process (``resumable_viewers.mjs``: ``resumeExistingStream``
  through the per-listener PUBLISH path); both started by pid and stopped by it, their
  JSON lines returned with the Redis CPU over the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.peers.node import npm_ci, peer_cache
from devstack.procs import Proc, ProcError, log_line
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.slotmap import Addr

__all__ = ["Mode", "RoundRun", "Target", "cache_dir", "ensure_modules", "run_round"]

Mode = Literal["node", "cluster"]
JS = Path(__file__).resolve().parent / "js"
PACKAGE = JS / "resumable"


def cache_dir() -> Path:
    return peer_cache("peer-resumable")


def ensure_modules(cache: Path | None = None) -> Path | str:
    """The ``node_modules`` with the committed lock installed (``npm ci``, once per lock),
    or why it cannot be had."""
    side = "the resumable-stream side"
    return npm_ci(PACKAGE, cache or cache_dir(), side, probe="resumable-stream")


def installed_versions(modules: Path) -> dict[str, str]:
    out = {}
    for name in ("resumable-stream", "redis", "@redis/client"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            out[name] = json.loads((modules / name / "package.json").read_text())["version"]
    return out


def _info(text: bytes | str) -> dict[str, str]:
    raw = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


@dataclass
class Target:
    """The Redis under the library: ``mode`` and every node of it (masters first)."""

    mode: Mode
    nodes: list[Addr]
    masters: list[Addr] = field(default_factory=list)

    def spec_nodes(self) -> list[str]:
        return [f"{a.host}:{a.port}" for a in (self.masters or self.nodes)]

    async def cpu_s(self) -> float:
        """Every node's ``used_cpu_sys + used_cpu_user``, summed."""
        total = 0.0
        for node in self.nodes:
            info = _info(await raw_command(node, "INFO", "cpu"))
            total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return total

    async def bus(self) -> dict[str, int]:
        """``CLUSTER INFO``'s ``cluster_stats_messages_*`` counters summed over the nodes."""
        out: dict[str, int] = {}
        for node in self.nodes:
            for k, v in _info(await raw_command(node, "CLUSTER", "INFO")).items():
                if k.startswith("cluster_stats_messages_"):
                    key = k.removeprefix("cluster_stats_messages_")
                    out[key] = out.get(key, 0) + int(v)
        return out


@dataclass
class RoundRun:
    """What one round's processes printed, and the Redis CPU over its window."""

    producer: dict[str, Any]
    viewers: dict[str, Any] | None
    redis_cpu_s: float
    wall_s: float
    bus: dict[str, int] = field(default_factory=dict)  # cluster-bus counters' deltas
    killed_at_ns: int = 0


def _last_json(proc: Proc) -> dict[str, Any]:
    assert proc.log is not None
    lines = [ln for ln in proc.log.read_text().splitlines() if ln.startswith("{")]
    if not lines:
        raise ProcError(proc.why())
    res: dict[str, Any] = json.loads(lines[-1])
    return res


async def _exit(proc: Proc, timeout_s: float) -> dict[str, Any]:
    code = await proc.wait(timeout_s)
    if code != 0:
        raise ProcError(proc.why())
    return _last_json(proc)


async def _bus_delta(target: Target, before: dict[str, int]) -> dict[str, int]:
    if target.mode != "cluster":
        return {}
    after = await target.bus()
    return {k: v - before.get(k, 0) for k, v in after.items()}


async def run_round(
    modules: Path, target: Target, work: Path, streams: list[str], *, rate: float,
    seconds: float, warm_s: float, per_stream: int, storm: bool = False, kill: bool = False,
) -> RoundRun:  # fmt: skip
    """One round: ``streams`` made by one producer at ``rate`` tokens/s over all of them,
    ``per_stream`` further viewers on each in the viewers' process; ``storm``: every first
    reader drops at half time and a viewer per stream resumes from where it was; ``kill``:
    the producer is killed (SIGKILL, by pid) at half time and its viewers are asked
    what they got, and what a fresh resume gets."""
    env = {**os.environ, "RS_MODULES": str(modules)}
    storm_file = work / "storm.json"
    base = {"mode": target.mode, "nodes": target.spec_nodes(), "streams": streams}
    pspec = {**base, "rate": rate, "seconds": seconds, "warm_s": warm_s,
             "storm_file": str(storm_file) if storm else None}  # fmt: skip
    vspec = {**base, "per_stream": per_stream, "warm_s": 0.0 if storm else warm_s,
             "storm_file": pspec["storm_file"], "probe_after_death": kill}  # fmt: skip
    (work / "producer.json").write_text(json.dumps(pspec))
    (work / "viewers.json").write_text(json.dumps(vspec))
    procs: list[Proc] = []
    try:
        producer = Proc.start(
            ["node", str(JS / "resumable_producer.mjs"), str(work / "producer.json")],
            log=work / "producer.log", name="resumable-stream producer", env=env,
        )  # fmt: skip
        procs.append(producer)
        await producer.ready(log_line(f"ready {len(streams)}"), timeout_s=120)
        viewers: Proc | None = None
        if per_stream > 0 or storm:
            viewers = Proc.start(
                ["node", str(JS / "resumable_viewers.mjs"), str(work / "viewers.json")],
                log=work / "viewers.log", name="resumable-stream viewers", env=env,
            )  # fmt: skip
            procs.append(viewers)
            await viewers.ready(log_line("attached"), timeout_s=120)
        bus0 = await target.bus() if target.mode == "cluster" else {}
        red0, t0 = await target.cpu_s(), time.perf_counter()
        producer.send(signal.SIGUSR1)
        killed_at = 0
        if storm or kill:
            await asyncio.sleep(seconds / 2)
        if storm:
            assert viewers is not None
            producer.send(signal.SIGUSR2)
            await producer.ready(log_line("dropped"), timeout_s=30)
            viewers.send(signal.SIGUSR1)
        if kill:
            assert viewers is not None
            killed_at = time.monotonic_ns()
            producer.kill()
            await asyncio.sleep(2.0)  # anything still in flight arrives
            viewers.send(signal.SIGUSR2)
            after = await _exit(viewers, 60)
            red, wall = await target.cpu_s() - red0, time.perf_counter() - t0
            return RoundRun({}, after, red, wall, await _bus_delta(target, bus0), killed_at)
        pout = await _exit(producer, seconds + 120)
        vout = await _exit(viewers, 60) if viewers is not None else None
        red, wall = await target.cpu_s() - red0, time.perf_counter() - t0
        return RoundRun(pout, vout, red, wall, await _bus_delta(target, bus0))
    finally:
        for proc in procs:
            await proc.stop(grace_s=5)
