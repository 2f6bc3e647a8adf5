"""Vercel's ``resumable-stream`` (npm 2.2.13 on node-redis 4.7.1) as a peer: its producer and
its resumers on the same Redis as tokenrelay, counted the way every system of the
whole-path benchmark is (:mod:`bench.peers.pathsystem`).

Where the readers live, as the library is used in a Next.js route: a stream's first
reader is the route's own response, in the producer's process (the library hands it the
chunks in memory: one ``INCR``, one ``SUBSCRIBE``, one ``SET`` per stream and nothing per
token). Every further viewer, and every viewer that reconnects, is a request another
instance serves with ``resumeExistingStream`` (here: one separate Node process for all of
them): it SUBSCRIBEs to a channel of its own and PUBLISHes a request; the producer answers
with its buffered chunks joined and then one classic ``PUBLISH`` per chunk per listener.
So the whole path is ``producer`` (the producer process, first readers included),
``redis`` (every node's ``INFO cpu``) and ``server`` (the resuming instance; 0 when a
phase has none). Both processes parse every token (sequence number and send time) to
count deliveries, so that cost is inside ``producer`` and ``server``.

:class:`ResumableStream` is the :class:`~bench.peers.pathsystem.System` the headline runner
(:mod:`bench.peers.pathcost`) imports: ``ResumableStream(url, log_dir, mode="cluster")``,
``url`` a ``redis://host:port`` of the cluster (any node) or of the single node.

Standalone (:func:`main`, ``python -m bench.peers.resumable [--quick] [--json PATH]
[--seed N]``) it starts its own Redis with devstack's launcher, a single node and then the
3+3 cluster through node-redis's ``createCluster`` (the library takes any client with
connect/subscribe/unsubscribe/publish/set/get/incr, and that one has them all), and runs
per target the phases of :mod:`bench.peers.socketio` (1,000 x 1 at 2k / 5k / 10k tokens/s,
100 x 10, a resume storm of 1,000 viewers at once), then its producer killed mid-stream
(what its viewers get, and what a fresh resume gets), and on the cluster the cluster-bus
messages per token of its PUBLISH against tokenrelay's publish script (SPUBLISH).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench._util import percentile, raise_nofile
from bench.peers.pathsystem import Phase, RoundFigures
from bench.peers.rsdriver import Mode, RoundRun, Target, ensure_modules, run_round
from bench.relay.harness import slotmap

__all__ = [
    "GUARANTEE",
    "TOKENRELAY_GUARANTEE",
    "Config",
    "ResumableStream",
    "add_arguments",
    "figures",
    "main",
    "phases",
    "run_from_args",
    "summary",
    "target_of",
]

GUARANTEE = (
    "resumable-stream: a reader resumes only while its producer lives (chunks are kept in "
    "the producer's memory); after the end a resume gets null ('Stream is already done'); "
    "after a producer death its readers get nothing more (and are never ended) and a fresh "
    "resume gets 'Timeout waiting for ack'"
)
TOKENRELAY_GUARANTEE = (
    "tokenrelay: every frame in a backlog in Redis: a reader resumes from its offset on any "
    "relay, after the producer died, and replays the turn after its end"
)


async def target_of(url: str, mode: Mode) -> Target:
    """The :class:`Target` behind ``url``: the node itself, or every node of its cluster."""
    from relay.protocol.slotmap import Addr

    u = urlparse(url)
    seed = Addr(u.hostname or "127.0.0.1", u.port or 6379)
    if mode == "node":
        return Target("node", [seed])
    smap = await slotmap(seed)
    masters = sorted({sh.master for sh in smap.slots if sh is not None})
    return Target("cluster", sorted(smap.nodes()), masters)


def figures(run: RoundRun, phase: Phase, per_stream: int, storm: bool) -> RoundFigures:
    """A round's :class:`RoundFigures` from what its processes printed (pure).
    Deliveries are unique in-order tokens per reader; lost = expected - delivered."""
    p, v = run.producer, run.viewers or {}
    published: list[int] = p["published"]
    by_stream: dict[str, list[dict[str, Any]]] = v.get("by_stream", {})
    readers = 1 if storm else 1 + per_stream
    delivered = duplicated = reordered = tail = errored = 0
    for i, first in enumerate(p["first"]):
        tallies = [first, *by_stream.get(str(i), [])]
        ends = tallies[1:] if storm and len(tallies) > 1 else tallies
        tail += sum(published[i] - t["last"] for t in ends)
        delivered += sum(t["received"] for t in tallies)
        duplicated += sum(t["duplicated"] for t in tallies)
        reordered += sum(t["reordered"] for t in tallies)
        errored += sum(1 for t in tallies if t.get("error"))
    expected = sum(published) * readers
    lat = [*p["lat_us"], *v.get("lat_us", [])]
    last_at = max(int(p["last_at_ns"]), int(v.get("last_at_ns", 0)))
    notes: dict[str, float | int | str] = {
        "readers_in_producer": len(published),
        "readers_in_resumer": int(v.get("viewers", 0)),
        "attach_errors": int(v.get("attach_errors", 0)),
        "reordered": reordered,
        "readers_errored": errored,  # "Timeout waiting for ack" mid-stream
        "lost_at_the_end": tail,  # of lost: tokens after a reader's last one
        "after_end": str(p["after_end"]),
    }
    if storm and v.get("storm_resume_s") is not None:
        notes["storm_resume_s"] = round(float(v["storm_resume_s"]), 3)
    if run.bus:
        notes["bus_msgs_sent"] = run.bus.get("sent", 0)
        notes["bus_publish_sent"] = run.bus.get("publish_sent", 0)
    return RoundFigures(
        system="resumable-stream", phase=phase.name, published=sum(published),
        delivered=delivered, expected=expected, lost=max(0, expected - delivered),
        duplicated=duplicated,
        cpu_s={"producer": float(p["cpu_s"]), "redis": run.redis_cpu_s,
               "server": float(v.get("cpu_s", 0.0))},
        p50_ms=(percentile(lat, 0.5, 0.0)) / 1e3, p99_ms=(percentile(lat, 0.99, 0.0)) / 1e3,
        behind_s=max(0.0, (last_at - int(p["end_ns"])) / 1e9), wall_s=run.wall_s, notes=notes,
    )  # fmt: skip


class ResumableStream:
    """resumable-stream as a :class:`~bench.peers.pathsystem.System`.

    ``url``: ``redis://host:port`` of the single node (``mode="node"``) or of any node of
    the cluster (``mode="cluster"``: the library through node-redis's ``createCluster``).
    ``log_dir``: where each round's specs and the processes' logs go. ``warm_s``: sends
    left out of the latency figures. ``cache``: the npm cache (default
    ``~/.cache/tokenrelay/peer-resumable``). :meth:`start` raises ``RuntimeError`` with
    the reason when node, npm or the registry is missing."""

    name = "resumable-stream"
    guarantee = GUARANTEE

    def __init__(
        self, url: str, log_dir: Path, mode: Mode = "cluster", warm_s: float = 1.0,
        cache: Path | None = None,
    ) -> None:  # fmt: skip
        self.url, self.log_dir, self.mode, self.warm_s, self.cache = (
            url, Path(log_dir), mode, warm_s, cache)  # fmt: skip
        self.modules: Path | None = None
        self.target: Target | None = None
        self.rounds = 0

    def supports(self, phase: Phase) -> bool:
        return phase.kind in ("steady", "resume_storm")

    async def start(self) -> None:
        got = await asyncio.to_thread(ensure_modules, self.cache)
        if isinstance(got, str):
            raise RuntimeError(got)
        self.modules = got
        self.target = await target_of(self.url, self.mode)
        raise_nofile(4096)

    async def round(self, phase: Phase, seed: int) -> RoundFigures:
        assert self.modules is not None, "start() first"
        assert self.target is not None, "start() first"
        self.rounds += 1
        storm = phase.kind == "resume_storm"
        per_stream = 0 if storm else phase.viewers - 1
        tag = uuid.UUID(int=(seed << 32) + self.rounds + uuid.uuid4().int % (1 << 32)).hex
        streams = [f"{tag[-12:]}-{i}" for i in range(phase.sessions)]
        work = self.log_dir / f"resumable-{self.mode}-{phase.name}-{self.rounds}"
        work.mkdir(parents=True, exist_ok=True)
        run = await run_round(
            self.modules, self.target, work, streams, rate=phase.tokens_per_s,
            seconds=phase.seconds, warm_s=self.warm_s, per_stream=per_stream, storm=storm,
        )  # fmt: skip
        return figures(run, phase, per_stream, storm)

    async def kill_round(self, sessions: int, rate: float, seconds: float) -> dict[str, Any]:
        """Its producer killed (SIGKILL, by pid) mid-stream with a resumed viewer on every
        stream: what those viewers got after the kill, whether their streams ended, and
        what a fresh resume of a stream gets then."""
        assert self.modules is not None, "start() first"
        assert self.target is not None, "start() first"
        self.rounds += 1
        streams = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(sessions)]
        work = self.log_dir / f"resumable-{self.mode}-kill-{self.rounds}"
        work.mkdir(parents=True, exist_ok=True)
        run = await run_round(
            self.modules, self.target, work, streams, rate=rate, seconds=seconds,
            warm_s=self.warm_s, per_stream=1, kill=True,
        )  # fmt: skip
        v = run.viewers or {}
        tallies = [t for ts in v.get("by_stream", {}).values() for t in ts]
        after_ms = (int(v.get("last_at_ns", 0)) - run.killed_at_ns) / 1e6
        return {
            "sessions": sessions,
            "viewers": len(tallies),
            "tokens_before_kill": sum(t["received"] for t in tallies),
            "last_arrival_after_kill_ms": round(after_ms, 1),
            "streams_ended": sum(1 for t in tallies if t["ended"]),
            "streams_left_open": sum(1 for t in tallies if not t["ended"]),
            "fresh_resume_after_kill": v.get("after_death"),
            "note": "first readers were in the killed process (its HTTP responses end with it)",
        }

    async def stop(self) -> None:
        return None


@dataclass
class Config:
    sessions: int = 1_000
    rates: tuple[int, ...] = (2_000, 5_000, 10_000)
    fan_sessions: int = 100
    fan_viewers: int = 10
    fan_rate: int = 2_000
    storm_rate: int = 2_000
    kill_sessions: int = 100
    kill_rate: int = 2_000
    seconds: float = 8.0
    repeats: int = 3
    modes: tuple[Mode, ...] = ("node", "cluster")
    tokenrelay: bool = True  # tokenrelay's rounds beside it on the cluster, alternating
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(seconds=3.0, repeats=1)


def phases(cfg: Config) -> list[Phase]:
    out = [Phase(f"{cfg.sessions}x1_{r}", cfg.sessions, 1, r, cfg.seconds) for r in cfg.rates]
    out.append(Phase(f"{cfg.fan_sessions}x{cfg.fan_viewers}_{cfg.fan_rate}", cfg.fan_sessions,
                     cfg.fan_viewers, cfg.fan_rate, cfg.seconds))  # fmt: skip
    out.append(Phase(f"storm_{cfg.sessions}x1_{cfg.storm_rate}", cfg.sessions, 1,
                     cfg.storm_rate, cfg.seconds, "resume_storm"))  # fmt: skip
    return out


def summary(rounds: list[RoundFigures]) -> dict[str, Any]:
    """Medians of a phase's rounds (``lost``/``duplicated`` summed), CPU per delivered token."""
    med = statistics.median
    us = [r.us_per_delivered() for r in rounds]
    return {
        "rounds": len(rounds),
        "published": med(r.published for r in rounds),
        "delivered": med(r.delivered for r in rounds),
        "lost": sum(r.lost for r in rounds),
        "duplicated": sum(r.duplicated for r in rounds),
        "us_per_delivered": {k: round(med(u[k] for u in us), 2) for k in us[0]},
        "p50_ms": round(med(r.p50_ms for r in rounds), 2),
        "p99_ms": round(med(r.p99_ms for r in rounds), 2),
        "behind_s": round(med(r.behind_s for r in rounds), 3),
        "kept_up": all(r.kept_up() for r in rounds),
        "notes": rounds[-1].notes,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from bench.peers.resumable_run import add_arguments as add

    add(ap)


def run_from_args(args: argparse.Namespace) -> int:
    from bench.peers.resumable_run import run_from_args as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.peers.resumable``: the run of :mod:`bench.peers.resumable_run`."""
    from bench.peers.resumable_run import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
