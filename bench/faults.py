"""Fault injection: break one piece of a running stack while streams flow, and count
what every viewer got.

``python -m bench.faults [--quick] [--json PATH] [--only NAME ...]``

Each fault gets a stack of its own (local Redis Cluster 3 masters + 3 replicas, 2
relays, 2 workers, 2 mock engines; :class:`worker.stack.Stack`), because it damages
it. Several sessions, several viewers each (SSE and WebSocket, :class:`bench.viewer.Viewer`,
which resumes from its last offset after any disconnect), turns posted continuously;
after a warm-up the fault is injected, the load runs on, then new turns stop and the
running ones finish. Per fault: ``frames``, ``lost``, ``duplicated``, ``out_of_order``
(summed over viewers), ``gaps_reported`` (explicit gap frames), ``error_frames``,
``reconnects`` and ``recovery_p99_ms``: per viewer, the longest wait for a frame from
the moment of the fault on (a disconnect or a stall both count), p99 over viewers;
``stalled_viewers`` got nothing at all after the fault; ``viewers_behind`` had not
received their session's last frame at the end (those frames count as ``lost``).

Faults (:data:`FAULTS`): ``relay_kill``, ``master_kill``, ``reshard``, ``engine_kill``,
``worker_kill``, ``relay_stall_buffer``, ``redis_stall`` (see each ``_fault_*``).

Order of use: :func:`run_fault` (one fault, one stack) or :func:`run_all`; ``main``
is the CLI. Every process is started and stopped by :class:`~worker.stack.Stack` /
:class:`~relay.cluster.LocalCluster`, by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from bench.loadtest import percentile
from bench.viewer import Viewer, settle_sessions
from relay import runtime
from relay.auth import issue_token
from relay.cluster import LocalCluster
from relay.keys import live_channel, new_session_id
from relay.publisher import Draft, Publisher
from relay.slotmap import slot_of
from worker.stack import Stack, StackSpec

__all__ = ["FAULTS", "FaultConfig", "main", "run_all", "run_fault"]

FAULTS = (
    "relay_kill",
    "master_kill",
    "reshard",
    "engine_kill",
    "worker_kill",
    "relay_stall_buffer",
    "redis_stall",
)


@dataclass
class FaultConfig:
    sessions: int = 6
    viewers_per_session: int = 4
    ws_share: float = 0.5
    warm_s: float = 3.0
    after_s: float = 10.0  # load keeps running this long after the fault
    drain_s: float = 25.0  # then running turns get this long to end
    max_tokens: int = 60
    decode_tok_per_s: float = 40.0

    @classmethod
    def quick(cls) -> FaultConfig:
        return cls(sessions=4, viewers_per_session=3, warm_s=2.0, after_s=7.0, max_tokens=40)


class _Run:
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
        self.post_errors = 0
        self.post_status: dict[str, int] = {}
        self.fault_at = 0.0
        self.notes: dict[str, Any] = {}
        self.placed: dict[tuple[str, int], tuple[float, str]] = {}  # turn -> (at, engine)
        self.after_drill: Callable[[_Run], Awaitable[None]] | None = None

    def relays(self) -> list[str]:
        return [p.url for p in self.stack.of_kind("relay") if p.alive]

    def workers(self) -> list[str]:
        return [p.url for p in self.stack.of_kind("worker") if p.alive]

    def _on_frame(self, v: Viewer, frame: dict[str, Any]) -> None:
        now = time.monotonic()
        self.arrivals.setdefault(id(v), []).append(now)
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
        body = {"message": "fault drill", "max_tokens": self.cfg.max_tokens}
        headers = {"Authorization": f"Bearer {token}"}
        while not stop.is_set():
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
            except (aiohttp.ClientError, TimeoutError, IndexError, ValueError) as exc:
                what = type(exc).__name__
                self.post_status[what] = self.post_status.get(what, 0) + 1
            if turn == 0:
                self.post_errors += 1
                await asyncio.sleep(0.3)
                continue
            deadline = time.monotonic() + 60
            while self.ended.get(sid, 0) < turn and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(random.uniform(0.05, 0.3))

    def report(self) -> dict[str, Any]:
        vs = self.viewers
        behind = settle_sessions(vs)  # a viewer missing its session's last frames: lost
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
            "lost": sum(v.tally.lost for v in vs),
            "duplicated": sum(v.tally.duplicated for v in vs),
            "out_of_order": sum(v.tally.out_of_order for v in vs),
            "gaps_reported": sum(v.tally.gaps_reported for v in vs),
            "error_frames": sum(v.error_frames for v in vs),
            "error_reasons": sorted({r for errs in self.error_at.values() for _, r in errs}),
            "first_error_after_fault_ms": round(min(err_ms), 1) if err_ms else None,
            "last_error_after_fault_ms": round(max(err_ms), 1) if err_ms else None,
            "reconnects": sum(max(0, v.connects - 1) for v in vs),
            "viewers_behind": behind,
            "stalled_viewers": stalled,
            "recovery_p99_ms": round(percentile(recov, 99), 1),
            "recovery_p50_ms": round(percentile(recov, 50), 1),
            "viewers": len(vs),
            "sessions": len(self.sessions),
            "turns": self.posted,
            "turn_post_failures": self.post_errors,
            "turn_post_status": dict(sorted(self.post_status.items())),
            "unended_turns": sum(
                1 for sid, t in self.last_posted.items() if self.ended.get(sid, 0) < t
            ),
            **self.notes,
        }


# -- helpers --------------------------------------------------------------------------


def _cluster(stack: Stack) -> LocalCluster:
    assert stack.cluster is not None
    return stack.cluster


async def _busiest_master(run: _Run) -> tuple[int, list[int]]:
    """The master that holds most sessions, and the slots of those sessions."""
    masters = await _cluster(run.stack).masters_now()
    owner = {s: port for port, slots in masters.items() for s in slots}
    by_master: dict[int, list[int]] = {}
    for sid, _ in run.sessions:
        slot = slot_of(live_channel(sid))
        by_master.setdefault(owner[slot], []).append(slot)
    port = max(by_master, key=lambda p: len(by_master[p]))
    return port, sorted(set(by_master[port]))


async def _each_node(stack: Stack, *args: Any) -> None:
    cluster = _cluster(stack)
    assert cluster.info is not None
    for node in cluster.info.nodes:
        if cluster.procs[node.port].poll() is None:
            c = aioredis.Redis(host=node.host, port=node.port)
            try:
                await c.execute_command(*args)
            finally:
                await c.aclose()


_WANTED = ("reaped", "repairs", "connections_lost", "resubscribes", "topology_changes", "gaps")


async def _samples(
    http: aiohttp.ClientSession, url: str, timeout_s: float
) -> list[tuple[str, float]] | None:
    """(name with labels, value) of every sample on ``url``/metrics; None if unreachable."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    out = []
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        out.append((name, float(value)))
    return out


async def _relay_stats(http: aiohttp.ClientSession, stack: Stack) -> dict[str, float]:
    """A few hub counters summed over the relays still alive (from /metrics)."""
    out: dict[str, float] = {}
    for p in stack.of_kind("relay"):
        samples = await _samples(http, p.url, 5) if p.alive else None
        for name, value in samples or []:
            name = name.removesuffix("_total")
            for w in _WANTED:
                if name.endswith("hub_" + w) or f'key="{w}"' in name:
                    out[w] = out.get(w, 0.0) + value
    return out


async def _sub_connections(stack: Stack, relay: str, masters: dict[int, list[int]]) -> int:
    """How many masters still hold the relay's subscriber connection (CLIENT LIST)."""
    n = 0
    for port in masters:
        c = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            text = (await c.execute_command("CLIENT", "LIST")).decode()
        finally:
            await c.aclose()
        n += f"name=tokenrelay-sub:{relay} " in text
    return n


# -- the faults -----------------------------------------------------------------------


async def _fault_relay_kill(run: _Run) -> None:
    """kill -9 relay-1: its clients reconnect to relay-2 with their offset."""
    run.stack.kill("relay-1")


async def _fault_master_kill(run: _Run) -> None:
    """kill -9 the master with most live sessions; its replica is promoted (node
    timeout 2 s); relays re-subscribe and repair; workers' publishes retry."""
    port, slots = await _busiest_master(run)
    _cluster(run.stack).kill_node(port)
    run.notes["killed_master"] = port
    run.notes["sessions_on_it"] = len(slots)


async def _fault_reshard(run: _Run) -> None:
    """Move the slots of the live sessions of one master to another master."""
    port, slots = await _busiest_master(run)
    masters = await _cluster(run.stack).masters_now()
    dst = next(p for p in sorted(masters) if p != port)
    moved = 0
    for slot in slots:
        moved += await _cluster(run.stack).migrate_slot(slot, port, dst)
    run.notes["slots_moved"] = len(slots)
    run.notes["keys_moved"] = moved


async def _fault_engine_kill(run: _Run) -> None:
    """kill -9 engine-1 mid-generation (waiting up to 5 s for it to hold leases, so the
    drill always kills running turns): its turns end with an error frame, the leases
    are released, later turns go to engine-2. The report counts the leases killed, the
    leases still held on engine-1 at the end and the turns placed on it after the
    control plane's grace (``ENGINE_GONE_S``)."""
    deadline = time.monotonic() + 5
    held = 0.0
    while time.monotonic() < deadline:
        held = sum((await _worker_leases(run, engine="engine-1")).values())
        if held > 0:
            break
        await asyncio.sleep(0.05)
    run.fault_at = time.monotonic()
    run.stack.kill("engine-1")
    run.notes["killed_engine_leases"] = held
    run.after_drill = _engine_kill_after


ENGINE_GONE_S = 3.0  # probes every 1 s: the ring has dropped a dead engine by then


async def _engine_kill_after(run: _Run) -> None:
    run.notes["leases_on_killed_engine_end"] = sum(
        (await _worker_leases(run, engine="engine-1")).values()
    )
    run.notes["turns_on_killed_engine_later"] = sum(
        1
        for (_, _), (at, engine) in run.placed.items()
        if engine == "engine-1" and at > run.fault_at + ENGINE_GONE_S
    )


async def _worker_leases(run: _Run, engine: str | None = None) -> dict[str, float]:
    """Leases (= turns generating) each live worker holds, from its /metrics; on
    ``engine`` only when given."""
    prefix = "tokenrelay_worker_engine_in_flight{"
    label = f'engine="{engine}"' if engine else ""
    out: dict[str, float] = {}
    for p in run.stack.of_kind("worker"):
        samples = await _samples(run.http, p.url, 2) if p.alive else None
        if samples is not None:
            out[p.name] = sum(v for name, v in samples if name.startswith(prefix) and label in name)
    return out


async def _fault_worker_kill(run: _Run) -> None:
    """kill -9 a worker mid-generation, the one holding the most leases (waiting up to
    5 s for one to hold any, so that the drill always kills running turns): relays reap
    its turns once their locks expire."""
    leases: dict[str, float] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        leases = await _worker_leases(run)
        if any(n > 0 for n in leases.values()):
            break
        await asyncio.sleep(0.05)
    victim = max(sorted(leases), key=lambda name: leases[name], default="worker-1")
    run.stack.kill(victim)
    run.notes["killed"] = victim
    run.notes["killed_leases"] = leases.get(victim, 0.0)


async def _fault_relay_stall_buffer(run: _Run) -> None:
    """SIGSTOP relay-1, overflow its pubsub output buffer (lowered with CONFIG SET)
    until Redis drops it, SIGCONT: it reconnects and repairs from the backlog."""
    relay = run.stack.procs["relay-1"]
    await _each_node(
        run.stack, "CONFIG", "SET", "client-output-buffer-limit", "pubsub 256kb 128kb 1"
    )
    # one filler session per master, watched through relay-1 only, so that relay-1
    # holds a subscription on every master
    masters = await _cluster(run.stack).masters_now()
    owner = {s: port for port, slots in masters.items() for s in slots}
    fillers: dict[int, str] = {}
    while len(fillers) < len(masters):
        sid = new_session_id()
        fillers.setdefault(owner[slot_of(live_channel(sid))], sid)
    stop = asyncio.Event()
    secret = run.stack.spec.secret
    watchers = []
    for sid in fillers.values():
        token = issue_token(secret, sid, 600, time.time())
        v = Viewer(run.http, lambda: [relay.url], sid, token)
        watchers.append(asyncio.create_task(v.run(stop)))
    host, port = run.stack.cluster_info.startup_nodes[0] if run.stack.cluster_info else ("", 0)
    redis = RedisCluster(host=host, port=port)
    try:
        await asyncio.sleep(1.0)  # filler subscriptions in place
        assert relay.popen is not None
        relay.popen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        pub = Publisher(redis)
        filler = "x" * 32_000
        gens = [await pub.open_generation(sid) for sid in fillers.values()]
        rounds = 0
        while rounds < 800 and await _sub_connections(run.stack, "relay-1", masters):
            for _ in range(10):  # past the kernel socket buffers, then the limit
                await asyncio.gather(*(g.publish([Draft(kind="token", text=filler)]) for g in gens))
            rounds += 10
        run.notes["filler_mb_per_master"] = round(rounds * len(filler) / 2**20, 1)
        run.notes["dropped_by_redis"] = not await _sub_connections(run.stack, "relay-1", masters)
        await asyncio.gather(*(g.done() for g in gens))
        await asyncio.sleep(1.0)
        relay.popen.send_signal(signal.SIGCONT)
        run.notes["stalled_s"] = round(time.monotonic() - stopped_at, 2)
    finally:
        if relay.popen is not None and relay.popen.poll() is None:
            relay.popen.send_signal(signal.SIGCONT)
        await redis.aclose()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)


async def _fault_redis_stall(run: _Run) -> None:
    """SIGSTOP the busiest master for 1.5 s (below the 2 s node timeout), SIGCONT."""
    port, _ = await _busiest_master(run)
    cluster = _cluster(run.stack)
    cluster.pause_node(port)
    try:
        await asyncio.sleep(1.5)
    finally:
        cluster.resume_node(port)


_INJECT: dict[str, Callable[[_Run], Awaitable[None]]] = {
    "relay_kill": _fault_relay_kill,
    "master_kill": _fault_master_kill,
    "reshard": _fault_reshard,
    "engine_kill": _fault_engine_kill,
    "worker_kill": _fault_worker_kill,
    "relay_stall_buffer": _fault_relay_stall_buffer,
    "redis_stall": _fault_redis_stall,
}


# -- running --------------------------------------------------------------------------


async def run_fault(name: str, cfg: FaultConfig) -> dict[str, Any]:
    """Start a stack, stream, inject ``name``, stream on, drain; return the counts."""
    inject = _INJECT[name]
    spec = StackSpec(
        relays=2,
        workers=2,
        engines=2,
        abuse_limits=False,  # every simulated client is 127.0.0.1, turns back to back
        engine_args=["--decode-tok-per-s", str(cfg.decode_tok_per_s)],
    )
    async with Stack(spec) as stack:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            run = _Run(cfg, stack, http)
            await run.setup()
            stop_view, stop_turns = asyncio.Event(), asyncio.Event()
            viewers = [asyncio.create_task(v.run(stop_view)) for v in run.viewers]
            await asyncio.sleep(0.5)
            drivers = [
                asyncio.create_task(run.drive(sid, tok, stop_turns)) for sid, tok in run.sessions
            ]
            await asyncio.sleep(cfg.warm_s)
            run.fault_at = time.monotonic()
            t0 = time.monotonic()
            await inject(run)
            run.notes["inject_s"] = round(time.monotonic() - t0, 2)
            await asyncio.sleep(max(0.0, cfg.after_s - (time.monotonic() - t0)))
            stop_turns.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.drain_s):
                    await asyncio.gather(*drivers, return_exceptions=True)
            for d in drivers:
                d.cancel()
            await asyncio.sleep(1.0)  # the last frames reach every screen
            if run.after_drill is not None:
                await run.after_drill(run)
            run.notes["relay_stats"] = await _relay_stats(http, stack)
            run.notes["log_dir"] = stack._tmp
            stop_view.set()
            await asyncio.gather(*viewers, return_exceptions=True)
            return run.report()


async def run_all(names: list[str], cfg: FaultConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        t0 = time.monotonic()
        out[name] = await run_fault(name, cfg)
        out[name]["run_s"] = round(time.monotonic() - t0, 1)
        r = out[name]
        print(
            f"{name:<20} frames={r['frames']:<6} lost={r['lost']} dup={r['duplicated']} "
            f"ooo={r['out_of_order']} gaps={r['gaps_reported']} errors={r['error_frames']} "
            f"reconnects={r['reconnects']} recovery_p99={r['recovery_p99_ms']}ms",
            file=sys.stderr,
            flush=True,
        )
    return {"faults": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sessions, shorter phases")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--only", action="append", choices=FAULTS, help="run only this fault")
    args = p.parse_args(argv)
    runtime.exit_on_sigterm()  # a killed run still stops its clusters and processes
    cfg = FaultConfig.quick() if args.quick else FaultConfig()
    names = args.only or list(FAULTS)
    report = asyncio.run(run_all(names, cfg))
    report["config"] = vars(cfg)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    bad = [
        n
        for n, r in report["faults"].items()
        if r["duplicated"] or r["out_of_order"] or (r["lost"] and n != "master_kill")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
