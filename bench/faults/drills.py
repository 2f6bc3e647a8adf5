"""Fault injection: break one piece of a running stack while streams flow, and count
what every viewer got.

``python -m bench.faults [--quick] [--seed N] [--json PATH] [--only NAME ...]``

Each fault gets a stack of its own (local Redis Cluster 3 masters + 3 replicas, 2
relays, 2 workers, 2 mock engines; :class:`devstack.demo.stack.Stack`), because it damages
it. Several sessions, several viewers each (SSE and WebSocket,
:class:`bench.load.viewer.Viewer`, the Python client, which resumes from its last offset
after any disconnect), turns posted continuously; after a warm-up the fault is injected,
the load runs on, then new turns stop and the running ones finish. Replies have the mock
engine's natural lengths (mean 300 tokens, a tail to 2,000) unless ``max_tokens`` caps
them. Then every viewer is compared with its
session's backlog in Redis (:mod:`bench.load.accounting`): ``lost``, ``duplicated``,
``out_of_order``, ``content_mismatches``, ``unended_turns``, ``viewers_behind`` (had
not received their session's last frame: those frames count as ``lost``); and per
fault ``gaps_reported`` (explicit gap frames), ``error_frames``, ``reconnects``,
``recovery_p99_ms`` (per viewer, the longest wait for a frame from the moment of the
fault on, p99 over viewers) and ``stalled_viewers`` (got nothing at all after it).

Every fault proves it happened: ``took_effect`` with its ``evidence``
(:mod:`bench.faults.evidence`); a drill whose fault did not take effect fails, and so
does one with any of :data:`MUST_BE_ZERO` non-zero (exit 1). ``--seed`` fixes the
drill's random choices (each fault seeded from the seed and its name).

Faults (:data:`FAULTS`): ``relay_kill``, ``master_kill``, ``reshard``, ``engine_kill``,
``worker_kill``, ``relay_stall_buffer``, ``redis_stall``, ``partition`` (needs root and
iptables, which ``make test`` installs with apt), ``session_expiry`` (see each
``_fault_*``). A drill that cannot run here is a failure too, with the reason, unless it
was asked to be skipped (``--skip NAME``): a fault class that silently did not run
would prove nothing.

Order of use: :func:`run_fault` (one fault, one stack) or :func:`run_all`; ``main``
is the CLI. Every process is started and stopped by :class:`~devstack.demo.stack.Stack` /
:class:`~devstack.cluster.launcher.LocalCluster`, by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio.cluster import RedisCluster

from bench.faults import partition
from bench.faults.evidence import MUST_BE_ZERO, judge
from bench.faults.probes import each_node, ping, relay_stats, samples, sub_connections
from bench.faults.run import FaultConfig, Run
from bench.harness import Bench, Common, Outcome, flag
from bench.load.viewer import Viewer
from devstack.cluster.launcher import LocalCluster
from devstack.demo.stack import Stack, StackSpec
from relay.broker.rediscluster.publisher import Draft, Publisher, read_backlog
from relay.protocol.auth import issue_token
from relay.protocol.frame import decode
from relay.protocol.keys import hist_key, live_channel, log_key, meta_key, new_session_id
from relay.protocol.slotmap import slot_of
from worker.chat.store import state_key

__all__ = [
    "FAULTS",
    "MUST_BE_ZERO",
    "FaultConfig",
    "add_arguments",
    "main",
    "run_all",
    "run_fault",
    "run_from_args",
]

FAULTS = (
    "relay_kill",
    "master_kill",
    "reshard",
    "engine_kill",
    "worker_kill",
    "relay_stall_buffer",
    "redis_stall",
    "partition",
    "session_expiry",
)


# -- helpers --------------------------------------------------------------------------


def _cluster(stack: Stack) -> LocalCluster:
    assert stack.cluster is not None
    return stack.cluster


async def _busiest_master(run: Run) -> tuple[int, list[int]]:
    """The master that holds most sessions, and the slots of those sessions."""
    masters = await _cluster(run.stack).masters_now()
    owner = {s: port for port, slots in masters.items() for s in slots}
    by_master: dict[int, list[int]] = {}
    for sid, _ in run.sessions:
        slot = slot_of(live_channel(sid))
        by_master.setdefault(owner[slot], []).append(slot)
    port = max(by_master, key=lambda p: len(by_master[p]))
    return port, sorted(set(by_master[port]))


# -- the faults -----------------------------------------------------------------------


async def _fault_relay_kill(run: Run) -> None:
    """kill -9 relay-1: its clients reconnect to relay-2 with their offset. Evidence:
    relay-1's exit status and the viewers' reconnects."""
    run.stack.kill("relay-1")
    proc = run.stack.procs["relay-1"].proc
    run.notes["killed_relay_exit"] = None if proc is None else await proc.wait(5)


async def _fault_master_kill(run: Run) -> None:
    """kill -9 the master with most live sessions; its replica is promoted (node
    timeout 2 s); relays re-subscribe and repair; workers' publishes retry."""
    port, slots = await _busiest_master(run)
    _cluster(run.stack).kill_node(port)
    run.notes["killed_master"] = port
    run.notes["sessions_on_it"] = len(slots)
    run.notes["slot_master_before"] = port
    run.notes["watched_slot"] = slots[0]
    run.after_drill = _slot_master_after


async def _slot_master_after(run: Run) -> None:
    """Evidence of a failover: who serves the killed master's first slot now."""
    masters = await _cluster(run.stack).masters_now()
    slot = run.notes["watched_slot"]
    run.notes["slot_master_after"] = next((p for p, ss in masters.items() if slot in ss), None)


async def _fault_reshard(run: Run) -> None:
    """Move the slots of the live sessions of one master to another master."""
    port, slots = await _busiest_master(run)
    masters = await _cluster(run.stack).masters_now()
    dst = next(p for p in sorted(masters) if p != port)
    moved = 0
    for slot in slots:
        moved += await _cluster(run.stack).migrate_slot(slot, port, dst)
    after = await _cluster(run.stack).masters_now()
    run.notes["slots_moved"] = len(slots)
    run.notes["keys_moved"] = moved
    run.notes["slot_owner_before"] = [port] * len(slots)
    run.notes["slot_owner_after"] = [
        next((p for p, ss in after.items() if slot in ss), None) for slot in slots
    ]


async def _fault_engine_kill(run: Run) -> None:
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


async def _engine_kill_after(run: Run) -> None:
    run.notes["leases_on_killed_engine_end"] = sum(
        (await _worker_leases(run, engine="engine-1")).values()
    )
    run.notes["turns_on_killed_engine_later"] = sum(
        1
        for (_, _), (at, engine) in run.placed.items()
        if engine == "engine-1" and at > run.fault_at + ENGINE_GONE_S
    )


async def _worker_leases(run: Run, engine: str | None = None) -> dict[str, float]:
    """Leases (= turns generating) each live worker holds, from its /metrics; on
    ``engine`` only when given."""
    prefix = "tokenrelay_worker_engine_in_flight{"
    label = f'engine="{engine}"' if engine else ""
    out: dict[str, float] = {}
    for p in run.stack.of_kind("worker"):
        got = await samples(run.http, p.url, 2) if p.alive else None
        if got is not None:
            out[p.name] = sum(v for name, v in got if name.startswith(prefix) and label in name)
    return out


async def _fault_worker_kill(run: Run) -> None:
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


async def _fault_relay_stall_buffer(run: Run) -> None:
    """SIGSTOP relay-1, overflow its pubsub output buffer (lowered with CONFIG SET)
    until Redis drops it, SIGCONT: it reconnects and repairs from the backlog."""
    relay = run.stack.procs["relay-1"]
    await each_node(
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
        assert relay.proc is not None
        relay.proc.send(signal.SIGSTOP)
        stopped_at = time.monotonic()
        pub = Publisher(redis)
        filler = "x" * 32_000
        gens = [await pub.open_generation(sid) for sid in fillers.values()]
        rounds = 0
        while rounds < 800 and await sub_connections(run.stack, "relay-1", masters):
            for _ in range(10):  # past the kernel socket buffers, then the limit
                await asyncio.gather(*(g.publish([Draft(kind="token", text=filler)]) for g in gens))
            rounds += 10
        run.notes["filler_mb_per_master"] = round(rounds * len(filler) / 2**20, 1)
        run.notes["dropped_by_redis"] = not await sub_connections(run.stack, "relay-1", masters)
        await asyncio.gather(*(g.done() for g in gens))
        await asyncio.sleep(1.0)
        relay.proc.send(signal.SIGCONT)
        run.notes["stalled_s"] = round(time.monotonic() - stopped_at, 2)
    finally:
        if relay.proc is not None:
            relay.proc.send(signal.SIGCONT)
        await redis.aclose()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)


async def _fault_redis_stall(run: Run) -> None:
    """SIGSTOP the busiest master for ``stall_s`` (1.5 s, below the 2 s node timeout),
    SIGCONT. Evidence: a PING sent to it right after the SIGSTOP waits out the stall."""
    port, _ = await _busiest_master(run)
    cluster = _cluster(run.stack)
    stall = run.cfg.stall_s
    cluster.pause_node(port)
    try:
        pinged = asyncio.create_task(ping(port, stall + 5))
        await asyncio.sleep(stall)
    finally:
        cluster.resume_node(port)
    answer, took = await pinged
    run.notes["stall_s"] = stall
    run.notes["stall_seen_ms"] = round(took * 1000, 1) if answer == "PONG" else None


async def _fault_partition(run: Run) -> None:
    """Drop every loopback packet to and from the busiest master's client port for
    ``partition_s`` (8 s), both directions (iptables; rules removed in a finally). The
    cluster bus is untouched, so no failover: clients wait, retry and repair. Evidence:
    a PING during the partition gets no answer, one after it PONG."""
    port, _ = await _busiest_master(run)
    run.notes["partitioned_master"] = port
    run.notes["partition_s"] = run.cfg.partition_s
    t0 = time.monotonic()
    with partition.dropped(port):
        answer, _ = await ping(port, 1.0)
        run.notes["partition_ping"] = answer
        await asyncio.sleep(max(0.0, run.cfg.partition_s - (time.monotonic() - t0)))
    run.notes["healed_ping"], _ = await ping(port, 5.0)


async def _fault_session_expiry(run: Run) -> None:
    """The keys of one watched session expire (what the session TTL does after an idle
    period) while its viewers stay connected, then its next turn starts a new
    generation. Evidence: the generation id changed, the new stream starts at offset 1,
    and the session's viewers got a ``reset`` frame (not the new frames dropped as
    duplicates)."""
    sid = run.sessions[0][0]
    run.paused.add(sid)
    deadline = time.monotonic() + 90  # its running turn ends first (an idle session)
    while run.ended.get(sid, 0) < run.last_posted.get(sid, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    redis = RedisCluster.from_url(run.stack.redis_url)
    try:
        before = await redis.hget(meta_key(sid), "gen")
        for k in (meta_key(sid), log_key(sid), hist_key(sid), state_key(sid)):
            await redis.pexpire(k, 1)
        await asyncio.sleep(0.05)
        run.notes["keys_left"] = sum([await redis.exists(meta_key(sid), log_key(sid))])
        run.posted_turns = {(s, t) for s, t in run.posted_turns if s != sid}  # gone with them
        run.last_posted.pop(sid, None)
        run.paused.discard(sid)
        # the next turn's OPEN writes the new gen before its first frame: wait for both
        after: bytes | str | None = None
        frames: list[bytes] = []
        while not frames and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            after = await redis.hget(meta_key(sid), "gen")
            if after is not None:
                frames, _, _ = await read_backlog(redis, sid, 0, 1)
    finally:
        await redis.aclose()
    run.notes["expired_session"] = sid
    run.notes["gen_before"] = _text(before)
    run.notes["gen_after"] = _text(after)
    run.notes["first_offset_after"] = decode(frames[0]).offset if frames else None
    run.after_drill = _resets_seen


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


async def _resets_seen(run: Run) -> None:
    sid = run.notes["expired_session"]
    run.notes["resets_seen"] = sum(v.resets for v in run.viewers if v.sid == sid)
    run.notes["viewers_of_it"] = sum(1 for v in run.viewers if v.sid == sid)


_INJECT: dict[str, Callable[[Run], Awaitable[None]]] = {
    "relay_kill": _fault_relay_kill,
    "master_kill": _fault_master_kill,
    "reshard": _fault_reshard,
    "engine_kill": _fault_engine_kill,
    "worker_kill": _fault_worker_kill,
    "relay_stall_buffer": _fault_relay_stall_buffer,
    "redis_stall": _fault_redis_stall,
    "partition": _fault_partition,
    "session_expiry": _fault_session_expiry,
}

# faults that cannot run everywhere: name -> the reason they cannot run here, or None
_SUPPORTED: dict[str, Callable[[], str | None]] = {"partition": partition.unsupported}


# -- running --------------------------------------------------------------------------


async def run_fault(name: str, cfg: FaultConfig) -> dict[str, Any]:
    """Start a stack, stream, inject ``name``, stream on, drain; return the counts, the
    evidence and ``took_effect``. A fault that cannot run here returns ``skipped``."""
    inject = _INJECT[name]
    reason = _SUPPORTED.get(name, lambda: None)()
    if reason is not None:
        return {"skipped": reason, "took_effect": None}
    if cfg.seed is not None:
        random.seed(f"{cfg.seed}:{name}")
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
            run = Run(cfg, stack, http)
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
            run.notes["relay_stats"] = await relay_stats(http, stack)
            run.notes["log_dir"] = stack._tmp
            stop_view.set()
            await asyncio.gather(*viewers, return_exceptions=True)
            report = run.report(await run.account())
            report["took_effect"], report["evidence"] = judge(name, report)
            return report


async def run_all(names: list[str], cfg: FaultConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        t0 = time.monotonic()
        out[name] = await run_fault(name, cfg)
        out[name]["run_s"] = round(time.monotonic() - t0, 1)
        r = out[name]
        if "skipped" in r:
            print(f"{name:<20} skipped: {r['skipped']}", file=sys.stderr, flush=True)
            continue
        print(
            f"{name:<20} took_effect={r['took_effect']} frames={r['frames']:<6} "
            f"lost={r['lost']} dup={r['duplicated']} ooo={r['out_of_order']} "
            f"mismatch={r['content_mismatches']} unended={r['unended_turns']} "
            f"gaps={r['gaps_reported']} errors={r['error_frames']} "
            f"reconnects={r['reconnects']} recovery_p99={r['recovery_p99_ms']}ms",
            file=sys.stderr,
            flush=True,
        )
    return {"faults": out}


def failures(report: dict[str, Any], skip: Collection[str] = ()) -> list[str]:
    """``fault: why`` for every drill that failed: it could not run here (unless its name
    is in ``skip``: asked not to run), its fault did not take effect, or a counter of
    :data:`MUST_BE_ZERO` is not 0."""
    bad = []
    for name, r in report["faults"].items():
        if "skipped" in r:
            if name not in skip:
                bad.append(f"{name}: could not run here: {r['skipped']} (or --skip {name})")
            continue
        if not r["took_effect"]:
            bad.append(f"{name}: the fault did not take effect ({r['evidence']})")
        nonzero = [k for k in MUST_BE_ZERO if r.get(k)]
        if nonzero:
            bad.append(f"{name}: non-zero {', '.join(nonzero)}")
    return bad


@dataclass
class Flags(Common):
    only: list[str] | None = flag(None, "run only this fault", choices=FAULTS)
    skip: list[str] = flag([], "do not run this fault (a fault that cannot run here and is not "
                           "skipped fails)", choices=FAULTS)  # fmt: skip
    seed: int | None = flag(None, "seed each drill's random choices")  # type: ignore[assignment]
    max_tokens: int = flag(0, "cap every reply (0: natural length)", least=0)


def _run(f: Flags) -> Outcome:
    cfg = FaultConfig.quick() if f.quick else FaultConfig()
    cfg.seed, cfg.max_tokens = f.seed, f.max_tokens
    names = [n for n in f.only or list(FAULTS) if n not in f.skip]
    report = asyncio.run(run_all(names, cfg))
    report["skipped_on_request"] = list(f.skip)
    report["config"] = vars(cfg)
    bad = failures(report, f.skip)
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    return Outcome(report, json.dumps(report, indent=2), 1 if bad else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.faults", description=__doc__.split("\n\n")[0],
              quick_help="fewer sessions, shorter phases")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
