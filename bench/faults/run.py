"""One fault drill's run: its sessions, viewers and turn drivers, and its report.

Used by :mod:`bench.faults.drills`, which injects the fault. Order of use::

    run = Run(cfg, stack, http); await run.setup()
    ... viewers run (``Viewer.run``), ``run.drive`` per session, the fault ...
    report = run.report(await run.account())
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio.cluster import ClusterNode, RedisCluster

from bench._util import percentile
from bench.load.accounting import SessionLog, account, read_logs
from bench.load.viewer import Viewer
from devstack.demo.stack import Stack

__all__ = ["FaultConfig", "Run"]


@dataclass
class FaultConfig:
    sessions: int = 6
    viewers_per_session: int = 4
    ws_share: float = 0.5
    warm_s: float = 3.0
    after_s: float = 10.0  # load keeps running this long after the fault
    drain_s: float = 60.0  # then running turns get this long to end (a reply runs to 2,000)
    max_tokens: int = 0  # 0: not sent, the engine's natural reply length
    decode_tok_per_s: float = 40.0
    seed: int | None = None
    partition_s: float = 8.0
    stall_s: float = 1.5
    regenerate_share: float = 0.0  # of turns posted as "regenerate the newest reply"
    stop_share: float = 0.0  # of turns stopped (POST .../cancel) a moment after they start

    @classmethod
    def quick(cls) -> FaultConfig:
        return cls(sessions=4, viewers_per_session=3, warm_s=2.0, after_s=7.0)


class Run:
    """One fault run: sessions, viewers, the turn driver and the counts."""

    def __init__(self, cfg: FaultConfig, stack: Stack, http: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.stack = stack
        self.http = http
        self.sessions: list[tuple[str, str]] = []
        self.viewers: list[Viewer] = []
        self.arrivals: dict[int, list[float]] = {}  # id(viewer) -> arrival times
        self.ended: dict[str, int] = {}  # sid -> highest turn with a done/error frame
        self.error_at: dict[str, list[tuple[float, str]]] = {}
        self.posted = 0
        self.last_posted: dict[str, int] = {}
        self.posted_turns: set[tuple[str, int]] = set()
        self.paused: set[str] = set()  # sessions whose driver posts nothing for now
        self.session_gen: dict[str, str] = {}  # the generation a reset announced
        self.post_errors = 0
        self.post_status: dict[str, int] = {}
        self.fault_at = 0.0
        self.notes: dict[str, Any] = {}
        self.placed: dict[tuple[str, int], tuple[float, str]] = {}  # turn -> (at, engine)
        self.after_drill: Callable[[Run], Awaitable[None]] | None = None
        # (viewer, turn, epoch) of every frame a viewer was given: a generation whose
        # frames reached screens but not the backlog (a failover lost them, and their
        # writer is gone) shows as an epoch the backlog's turn does not have
        self.seen_epochs: set[tuple[int, int, int]] = set()
        self.logs: dict[str, SessionLog] = {}

    def relays(self) -> list[str]:
        return [p.url for p in self.stack.of_kind("relay") if p.alive]

    def workers(self) -> list[str]:
        return [p.url for p in self.stack.of_kind("worker") if p.alive]

    def _on_frame(self, v: Viewer, frame: dict[str, Any]) -> None:
        now = time.monotonic()
        if frame["kind"] == "reset":  # turns number from 1 again in the new generation
            gen = str((frame.get("meta") or {}).get("gen", ""))
            if self.session_gen.get(v.sid) != gen:
                self.session_gen[v.sid] = gen
                self.ended[v.sid] = 0
            return
        self.arrivals.setdefault(id(v), []).append(now)
        self.seen_epochs.add((id(v), int(frame.get("turn", 0)), int(frame.get("epoch", 0))))
        if frame["kind"] == "meta":
            engine = str((frame.get("meta") or {}).get("engine", ""))
            self.placed.setdefault((v.sid, int(frame.get("turn", 0))), (now, engine))
        if frame["kind"] in ("done", "error"):
            sid, turn = v.sid, int(frame.get("turn", 0))
            if turn > self.ended.get(sid, 0):
                self.ended[sid] = turn
                if frame["kind"] == "error":
                    self.error_at.setdefault(sid, []).append((now, str(frame.get("text"))))

    async def setup(self) -> None:
        for _ in range(self.cfg.sessions):
            async with self.http.post(random.choice(self.workers()) + "/v1/sessions") as r:
                body = await r.json()
                self.sessions.append((body["session"], body["token"]))
        for i in range(self.cfg.sessions * self.cfg.viewers_per_session):
            sid, token = self.sessions[i % len(self.sessions)]
            transport = "ws" if (i // len(self.sessions)) % 2 else "sse"
            v = Viewer(self.http, self.relays, sid, token, transport=transport)
            v.on_frame = self._on_frame
            self.viewers.append(v)

    async def drive(self, sid: str, token: str, stop: asyncio.Event) -> None:
        """Post a turn, wait for its done/error frame, repeat until ``stop``."""
        headers = {"Authorization": f"Bearer {token}"}
        while not stop.is_set():
            if sid in self.paused:
                await asyncio.sleep(0.05)
                continue
            body: dict[str, Any] = {"message": f"fault drill {random.randrange(1 << 30)}"}
            if sid in self.last_posted and random.random() < self.cfg.regenerate_share:
                body = {"regenerate": True}
            if self.cfg.max_tokens:
                body["max_tokens"] = self.cfg.max_tokens
            turn = 0
            try:
                base = random.choice(self.workers())
                async with self.http.post(
                    f"{base}/v1/sessions/{sid}/turns",
                    json=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as r:
                    data = await r.json(content_type=None)
                    self.post_status[str(r.status)] = self.post_status.get(str(r.status), 0) + 1
                    if r.status == 202:
                        turn = int(data["turn"])
                        self.posted += 1
                        self.last_posted[sid] = turn
                        self.posted_turns.add((sid, turn))
            except (aiohttp.ClientError, TimeoutError, IndexError, ValueError) as exc:
                what = type(exc).__name__
                self.post_status[what] = self.post_status.get(what, 0) + 1
            if turn == 0:
                self.post_errors += 1
                await asyncio.sleep(0.3)
                continue
            if random.random() < self.cfg.stop_share:  # Stop, as a screen presses it
                await asyncio.sleep(random.uniform(0.2, 1.5))
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, IndexError):
                    async with self.http.post(
                        f"{random.choice(self.workers())}/v1/sessions/{sid}/cancel",
                        headers=headers, timeout=aiohttp.ClientTimeout(total=10),
                    ) as r:  # fmt: skip
                        key = f"cancel {r.status}"
                        self.post_status[key] = self.post_status.get(key, 0) + 1
            deadline = time.monotonic() + 90  # the longest reply: 2,000 tokens at 40/s
            while self.ended.get(sid, 0) < turn and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(random.uniform(0.05, 0.3))

    async def account(self) -> dict[str, Any]:
        """Every viewer against its session's backlog in Redis (bench.load.accounting)."""
        # every node the stack started: the first master may be the one a drill killed
        info = self.stack.cluster_info
        nodes = [ClusterNode(n.host, n.port) for n in info.nodes] if info is not None else []
        redis = (
            RedisCluster(startup_nodes=nodes)
            if nodes
            else RedisCluster.from_url(self.stack.redis_url)
        )
        try:
            logs = await read_logs(redis, [sid for sid, _ in self.sessions])
        finally:
            await redis.aclose()
        self.logs = logs
        return {**account(logs, self.viewers, self.posted_turns), **self.lost_writes()}

    def lost_writes(self) -> dict[str, Any]:
        """Frames screens were given whose generation the backlog's turn does not hold:
        ``lost_writes`` (viewer, turn) pairs the screen was not told of and a few samples;
        ``lost_writes_told``: the same where the screen got a ``gap`` frame in that turn
        (the next writer's skip after a failover: reported, not silent). Counted against
        Redis after :meth:`account` read the backlogs."""
        by_id = {id(v): v for v in self.viewers}
        bad: list[str] = []
        told = 0
        for vid, turn, epoch in sorted(self.seen_epochs):
            v = by_id.get(vid)
            log = self.logs.get(v.sid) if v is not None else None
            if v is None or log is None or turn == 0:
                continue
            tl = log.turns.get(turn)
            if tl is not None and tl.complete and epoch not in tl.epochs:
                if turn in v.gap_turns:
                    told += 1
                    continue
                bad.append(f"{v.sid}/{turn}: epoch {epoch} reached a screen, the backlog has "
                           f"{sorted(tl.epochs)}")  # fmt: skip
        unended = [
            f"{log.sid}/{turn}: {len(tl.offsets)} frames to offset {max(tl.offsets)}, "
            f"epochs {sorted(tl.epochs)}, session's last offset {log.last}"
            for log in self.logs.values()
            for turn, tl in sorted(log.turns.items())
            if tl.end is None and tl.offsets
        ]
        return {"lost_writes": len(bad), "lost_write_samples": sorted(set(bad))[:5],
                "lost_writes_told": told,
                "unended_samples": unended[:5]}  # fmt: skip

    def report(self, counts: dict[str, Any]) -> dict[str, Any]:
        vs = self.viewers
        recov: list[float] = []
        stalled = 0  # viewers that got nothing at all after the fault
        for v in vs:
            times = [t for t in self.arrivals.get(id(v), []) if t >= self.fault_at]
            marks = [self.fault_at, *times]
            gaps = [(b - a) * 1000 for a, b in itertools.pairwise(marks)]
            if gaps:
                recov.append(max(gaps))
            else:
                stalled += 1
        err_ms = [
            (t - self.fault_at) * 1000
            for errs in self.error_at.values()
            for t, _ in errs
            if t >= self.fault_at
        ]
        return {
            "frames": sum(v.tally.frames for v in vs),
            **counts,
            "gaps_reported": sum(v.tally.gaps_reported for v in vs),
            "error_frames": sum(v.error_frames for v in vs),
            "error_reasons": sorted({r for errs in self.error_at.values() for _, r in errs}),
            "first_error_after_fault_ms": round(min(err_ms), 1) if err_ms else None,
            "last_error_after_fault_ms": round(max(err_ms), 1) if err_ms else None,
            "reconnects": sum(max(0, v.connects - 1) for v in vs),
            "stalled_viewers": stalled,
            "recovery_p99_ms": round(percentile(recov, 0.99, float("nan")), 1),
            "recovery_p50_ms": round(percentile(recov, 0.50, float("nan")), 1),
            "viewers": len(vs),
            "sessions": len(self.sessions),
            "turns": self.posted,
            "turn_post_failures": self.post_errors,
            "turn_post_status": dict(sorted(self.post_status.items())),
            **self.notes,
        }
