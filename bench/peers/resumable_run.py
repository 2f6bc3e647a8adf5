"""The standalone run of :mod:`bench.peers.resumable`: its own Redis per target (a single
node, then the 3+3 cluster, both from devstack's launcher so that their ``INFO cpu`` is
this run's alone), the phases on each, the producer killed mid-stream, and on the cluster
the cluster-bus cost of its classic PUBLISH against tokenrelay's publish script (SPUBLISH).
On the cluster tokenrelay runs the same phases beside it, rounds alternating (the first
by ``--seed``), driven as the whole-path runner drives it
(:class:`bench.peers.pathdrivers.RelaySystem`: the relay process, the paced publisher,
WebSocket readers in this process, loss counted against the backlog); ``--no-tokenrelay``
leaves it out. Its producer killed: its backlogs' length after the kill.

Bus traffic: ``CLUSTER INFO``'s ``cluster_stats_messages_*`` counters summed over the six
nodes, and the bytes both ends of every cluster-bus connection received (``ss -tin``,
loopback), before and after: for resumable-stream over its 100 x 10 round (9 PUBLISHes per
token, one per listener), for tokenrelay over its paced publisher
(:mod:`bench.relay.publisher`, one call of the publish script per frame: XADD + SPUBLISH)
at the same tokens/s on as many sessions. Each is divided by the tokens published; the
cluster's own pings over the same seconds are in both.

``python -m bench.peers.resumable [--quick] [--json PATH] [--seed N]``; ``--report PATH``
prints the table of a saved ``--json`` (the one in bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import Bench, Common, Outcome, flag
from bench.peers.pathsystem import RoundFigures
from bench.peers.resumable import (
    GUARANTEE,
    TOKENRELAY_GUARANTEE,
    Config,
    ResumableStream,
    phases,
    summary,
)
from bench.peers.rsdriver import Mode, Target, ensure_modules, installed_versions
from bench.relay.harness import run_publisher, sessions, slotmap
from devstack.cluster.binary import find_server_binary
from devstack.cluster.launcher import local_cluster
from devstack.procs import Proc, ProcError, free_port, launched, port_open
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.keys import log_key
from relay.protocol.slotmap import slot_of

__all__ = ["add_arguments", "bus_bytes", "main", "run", "run_from_args"]

_SOCK = re.compile(r"\S+:(\d+)\s+\S+:(\d+)")
_RECV = re.compile(r"bytes_received:(\d+)")


def bus_bytes(ports: set[int]) -> int:
    """Bytes received so far by both ends of every TCP connection to a port in ``ports``
    (``ss -tin``; 0 without ss)."""
    try:
        out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    total, hit = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line; its details follow, indented
            m = _SOCK.search(line)
            hit = m is not None and (int(m[1]) in ports or int(m[2]) in ports)
        elif hit and (r := _RECV.search(line)):
            total += int(r[1])
            hit = False
    return total


@contextlib.asynccontextmanager
async def _redis(mode: Mode, log_dir: Path) -> AsyncIterator[str]:
    """A Redis of its own: one node (no cluster mode) or 3 masters + 3 replicas."""
    if mode == "cluster":
        async with local_cluster(masters=3, replicas=1) as info:
            yield info.url
        return
    port = free_port()
    argv = [find_server_binary().path, "--port", str(port), "--bind", "127.0.0.1",
            "--protected-mode", "no", "--save", "", "--appendonly", "no"]  # fmt: skip
    async with launched(argv, log=log_dir / f"redis-{port}.log", ready=port_open(port),
                        name=f"redis node {port}"):  # fmt: skip
        yield f"redis://127.0.0.1:{port}"


async def _bus_window(target: Target, work: Any) -> tuple[dict[str, int], int, Any]:
    ports = {a.port + 10000 for a in target.nodes}
    b0, c0 = bus_bytes(ports), await target.bus()
    out = await work
    c1, b1 = await target.bus(), bus_bytes(ports)
    return {k: v - c0.get(k, 0) for k, v in c1.items()}, b1 - b0, out


async def _bus_compare(system: ResumableStream, url: str, cfg: Config, seed: int) -> dict[str, Any]:
    """Cluster-bus messages and bytes per published token: resumable-stream's 100 x 10
    round (per-listener PUBLISH) and tokenrelay's publisher at the same rate."""
    from bench.peers.pathsystem import Phase

    target = system.target
    assert target is not None
    ph = Phase("bus_100x10", cfg.fan_sessions, cfg.fan_viewers, cfg.fan_rate, cfg.seconds)
    counts, nbytes, rs = await _bus_window(target, system.round(ph, seed))
    assert isinstance(rs, RoundFigures)
    sids = sessions(cfg.fan_sessions, await slotmap(target.nodes[0]), None)
    spec = {"mode": "paced", "url": url, "sids": sids, "rate": cfg.fan_rate / cfg.fan_sessions,
            "seconds": cfg.seconds, "stamp": "build"}  # fmt: skip
    tcounts, tbytes, tr = await _bus_window(target, run_publisher(spec))
    tsent = int(tr["sent"])

    def per(counts: dict[str, int], nbytes: int, tokens: int) -> dict[str, Any]:
        n = max(tokens, 1)
        return {
            "tokens": tokens,
            "bus_msgs_per_token": round(counts.get("sent", 0) / n, 2),
            "bus_publish_msgs_per_token": round(counts.get("publish_sent", 0) / n, 2),
            "bus_publishshard_msgs_per_token": round(counts.get("publishshard_sent", 0) / n, 2),
            "bus_bytes_per_token": round(nbytes / n, 1),
            "counters": counts,
        }

    return {
        "resumable-stream (PUBLISH per listener, 9 listeners)": per(counts, nbytes, rs.published),
        "tokenrelay (publish script: XADD + SPUBLISH)": per(tcounts, tbytes, tsent),
    }


async def tokenrelay_killed(
    url: str, target: Target, n: int, rate: float, secs: float
) -> dict[str, Any]:
    """tokenrelay's publisher (:mod:`bench.relay.publisher`) killed (SIGKILL, by pid) half
    way through: what its backlogs in Redis hold then, which is what a reader resuming on
    any relay reads (XRANGE from its offset)."""
    smap = await slotmap(target.nodes[0])
    sids = sessions(n, smap, None)
    spec = {"mode": "paced", "url": url, "sids": sids, "rate": rate / n, "seconds": secs,
            "stamp": "build"}  # fmt: skip
    first = smap.node_for(slot_of(log_key(sids[0])))
    assert first is not None
    with tempfile.TemporaryDirectory(prefix="bench-tr-kill-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "bench.relay.publisher", str(Path(tmp) / "spec.json")]
        proc = Proc.start(argv, log=Path(tmp) / "publisher.log", name="publisher")
        try:
            deadline = time.monotonic() + 60
            while int(await raw_command(first, "XLEN", log_key(sids[0]))) == 0:
                if time.monotonic() > deadline or not proc.alive:
                    raise ProcError(f"the publisher published nothing: {proc.why()}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(secs / 2)
            proc.kill()
        finally:
            await proc.stop(grace_s=5)
    held = []
    for sid in sids:
        node = smap.node_for(slot_of(log_key(sid)))
        assert node is not None
        held.append(int(await raw_command(node, "XLEN", log_key(sid))))
    return {
        "sessions": n,
        "backlog_frames_after_kill": sum(held),
        "sessions_with_a_backlog": sum(1 for h in held if h > 0),
        "note": "a reader resumes from its offset on any relay and reads these (XRANGE); "
        "a relay ends a watched open turn whose producer fell silent with a reap "
        "(an error frame, worker_lost: docs/PROTOCOL.md)",
    }


async def _tokenrelay(cfg: Config, url: str, target: Target, log_dir: Path) -> Any:
    """tokenrelay's relay and publisher as the whole-path runner drives them
    (:class:`bench.peers.pathdrivers.RelaySystem`), started; None with ``--no-tokenrelay``."""
    if not cfg.tokenrelay:
        return None
    from bench.peers.pathdrivers import Bench, RelaySystem

    readers = max(ph.sessions * ph.viewers for ph in phases(cfg))
    seed = target.nodes[0]
    bench = Bench(url, seed, await slotmap(seed), log_dir, None, readers + 100, 1.0)
    relay = RelaySystem(bench, "ws")
    await relay.start()
    return relay


async def run(cfg: Config) -> dict[str, Any]:
    modules = await asyncio.to_thread(ensure_modules)
    if isinstance(modules, str):
        return {"skipped": modules, "guarantees": _guarantees()}
    started, load_start = time.monotonic(), Path("/proc/loadavg").read_text().split()[:3]
    out: dict[str, Any] = {"targets": {}}
    with tempfile.TemporaryDirectory(prefix="bench-resumable-") as tmp:
        for mode in cfg.modes:
            log_dir = Path(tmp) / mode
            log_dir.mkdir()
            async with _redis(mode, log_dir) as url:
                system = ResumableStream(url, log_dir, mode)
                await system.start()
                assert system.target is not None
                tr = (
                    await _tokenrelay(cfg, url, system.target, log_dir)
                    if mode == "cluster"
                    else None
                )
                res: dict[str, Any] = {"phases": {}}
                if tr is not None:
                    res["tokenrelay_phases"] = {}
                for k, ph in enumerate(phases(cfg)):
                    print(f"[{time.monotonic() - started:6.1f}s] {mode} {ph.name}", file=sys.stderr)
                    mine: list[RoundFigures] = []
                    theirs: list[RoundFigures] = []
                    for i in range(cfg.repeats):  # alternating, the first by the seed
                        seed = cfg.seed + k * 100 + i
                        turns: list[tuple[Any, list[RoundFigures]]] = [(system, mine)]
                        if tr is not None:
                            turns.insert((cfg.seed + k + i) % 2, (tr, theirs))
                        for sys_, into in turns:
                            into.append(await sys_.round(ph, seed))
                    res["phases"][ph.name] = summary(mine)
                    if tr is not None:
                        res["tokenrelay_phases"][ph.name] = summary(theirs)
                if tr is not None:
                    await tr.stop()
                res["producer_killed"] = await system.kill_round(
                    cfg.kill_sessions, cfg.kill_rate, cfg.seconds
                )
                if mode == "cluster":
                    assert system.target is not None
                    res["tokenrelay_killed"] = await tokenrelay_killed(
                        url, system.target, cfg.kill_sessions, cfg.kill_rate, cfg.seconds
                    )
                    res["cluster_bus"] = await _bus_compare(system, url, cfg, cfg.seed)
                await system.stop()
                out["targets"][mode] = res
    out.update({
        "guarantees": _guarantees(),
        "readers": "first reader in the producer process (the route's response); further "
                   "and reconnecting viewers in one separate Node process (resumeExistingStream)",
        "config": asdict(cfg),
        "versions": {"node": _node_version(), **installed_versions(modules)},
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "seconds": round(time.monotonic() - started, 1),
    })  # fmt: skip
    return out


def _guarantees() -> dict[str, str]:
    return {"resumable-stream": GUARANTEE, "tokenrelay": TOKENRELAY_GUARANTEE}


def _node_version() -> str:
    try:
        return subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "none"


def table(res: dict[str, Any]) -> str:
    """The results as a text table, one row per target and phase."""
    head = ("system/target", "phase", "delivered", "lost", "dup", "producer µs", "redis µs",
            "server µs", "whole µs", "p50 ms", "p99 ms", "kept up")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for mode, t in res["targets"].items():
        both = [("", t["phases"])]
        if "tokenrelay_phases" in t:
            both.append(("tokenrelay ", t["tokenrelay_phases"]))
        for who, name, r in ((w, n, r) for w, ph in both for n, r in ph.items()):
            u = r["us_per_delivered"]
            rows.append((f"{who}{mode}", name, f"{r['delivered']:,.0f}", str(r["lost"]),
                         str(r["duplicated"]), f"{u.get('producer', 0):.1f}",
                         f"{u.get('redis', 0):.1f}", f"{u.get('server', 0):.1f}",
                         f"{u['whole']:.1f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                         "yes" if r["kept_up"] else "no"))  # fmt: skip
    w = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(f"{v:{w[c]}}" for c, v in enumerate(r)).rstrip() for r in rows]
    for mode, t in res["targets"].items():
        lines.append(f"{mode} producer killed: {json.dumps(t['producer_killed'])}")
        if "tokenrelay_killed" in t:
            killed = json.dumps(t["tokenrelay_killed"])
            lines.append(f"{mode} tokenrelay publisher killed: {killed}")
        for name, b in t.get("cluster_bus", {}).items():
            lines.append(f"{mode} bus {name}: {b['bus_msgs_per_token']} msgs/token, "
                         f"{b['bus_bytes_per_token']} B/token")  # fmt: skip
    lines += [f"guarantee: {g}" for g in res["guarantees"].values()]
    return "\n".join(lines)


_D, _Q = Config(), Config.quick()


@dataclass
class Flags(Common):
    seed: int = flag(0, "names the rounds' streams")
    seconds: float = flag(_D.seconds, "publishing seconds per round", quick=_Q.seconds, above=0)
    repeats: int = flag(_D.repeats, "rounds per phase", quick=_Q.repeats, least=1)
    modes: str = flag("node,cluster", "comma-separated targets: node,cluster")
    sessions: int = flag(_D.sessions, "sessions of the 1 x N phases", least=1)
    no_tokenrelay: bool = flag(False, "no tokenrelay rounds beside it on the cluster")


def config_from_args(args: argparse.Namespace | Flags) -> Config:
    f = args if isinstance(args, Flags) else BENCH.flags(args)
    cfg = Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, sessions=f.sessions,
                 tokenrelay=not f.no_tokenrelay)  # fmt: skip
    modes = tuple(m.strip() for m in f.modes.split(","))
    if bad := [m for m in modes if m not in ("node", "cluster")]:
        raise SystemExit(f"--modes: unknown target {bad[0]!r} (node, cluster)")
    cfg.modes = modes  # type: ignore[assignment]
    return cfg


def _run(f: Flags) -> Outcome:
    res = asyncio.run(run(config_from_args(f)))
    if "skipped" in res:
        print(f"peer_resumable: skipped: {res['skipped']}", file=sys.stderr)
        return Outcome(res)
    return Outcome(res, table(res))


BENCH = Bench(Flags, _run, prog="python -m bench.peers.resumable", description=__doc__,
              quick_help="1 round of 3 s per phase", markdown=table)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main
