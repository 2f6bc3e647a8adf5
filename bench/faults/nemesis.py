"""Faults that overlap: a nemesis run under load, checked against Redis at the end.

``python -m bench.faults.nemesis [--quick] [--seed N] [--minutes M] [--json PATH]``

One stack (local Redis Cluster 3 masters + 3 replicas, 2 relays, 2 workers, 2 mock
engines) carries a workload for the whole run: sessions posting turns of the mock
engine's natural lengths back to back, some regenerated, some stopped a moment after
they start; screens over SSE and WebSocket (the Python client, which resumes from its
last offset). A schedule drawn from the seed (:mod:`bench.faults.schedule`) starts faults
in bursts so that they overlap: relays and workers killed (SIGKILL, restarted after a
hold) or frozen (SIGSTOP, SIGCONT after the hold), masters killed (the replica is
promoted, the node comes back as a replica) or frozen (past the 2 s node timeout: an
automatic failover), replicas killed, manual failovers, slot migrations of live
sessions, partitions of a master's client port (iptables, root only) and reconnect
storms (half the screens drop at once).

Each fault records its evidence as the single-fault drills do (the killed process's exit
status, who serves a slot before and after, a PING waiting out a freeze or refused by a
partition, a reconnect count); a fault without evidence is an anomaly. A combination
that cannot be survived by design is refused at its time and written in the history:
both nodes of one shard down at once (no setting here waits for replicas: a master
killed before its replica has a frame loses that frame, which the checker would report
as a ``gap``, never as silence), and every relay or every worker down at once.

At the end, new turns stop, running ones end, and the checker
(:mod:`bench.load.accounting`) reads every session's backlog from Redis and compares each
screen with it: ``lost``, ``duplicated``, ``out_of_order``, ``content_mismatches``,
``unended_turns``, ``viewers_behind`` (stuck: had not reached its session's end after the
quiet period) must all be 0, and no process the run started may be left. It prints the
history of faults and anomalies and the seed that replays the schedule; exit 1 on any
anomaly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.faults import partition
from bench.faults.evidence import MUST_BE_ZERO
from bench.faults.probes import ping
from bench.faults.run import FaultConfig, Run
from bench.faults.schedule import KINDS, Fault, overlapping, plan
from bench.harness import Bench, Common, Outcome, flag
from devstack.cluster.launcher import LocalCluster
from devstack.demo.stack import Stack, StackSpec
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import slot_of

__all__ = ["NemesisConfig", "add_arguments", "main", "run_from_args", "run_nemesis"]


@dataclass
class NemesisConfig:
    minutes: float = 30.0
    bursts: int = 25  # 2-4 faults each: 50-100 faults
    sessions: int = 50
    viewers_per_session: int = 4  # 200 screens
    seed: int = 1
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    decode_tok_per_s: float = 40.0
    quiet_s: float = 20.0  # after the last fault's start: every screen catches up

    @classmethod
    def quick(cls) -> NemesisConfig:
        return cls(minutes=3.0, bursts=4, sessions=8, viewers_per_session=3)


class Nemesis:
    """Runs the schedule against one stack, one fault at its time each, and keeps the
    history. Redis faults touch at most one node per shard at a time; relay and worker
    faults leave one of each running."""

    def __init__(self, run: Run, viewers: dict[int, tuple[asyncio.Task[None], asyncio.Event]]):
        self.run = run
        self.stack = run.stack
        self.viewers = viewers
        self.history: list[dict[str, Any]] = []
        self.busy_nodes: set[int] = set()  # Redis ports down, frozen, cut off or rejoining
        self.busy_procs: set[str] = set()  # relays and workers down or frozen
        self.t0 = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self.can_partition = partition.unsupported() is None

    @property
    def cluster(self) -> LocalCluster:
        assert self.stack.cluster is not None
        return self.stack.cluster

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    async def play(self, faults: list[Fault]) -> None:
        for fault in faults:
            await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - self.t0)))
            self._tasks.append(asyncio.create_task(self._one(fault)))
        await asyncio.gather(*self._tasks)

    async def _one(self, fault: Fault) -> None:
        entry: dict[str, Any] = {"at_s": self._now(), "kind": fault.kind, "hold_s": fault.hold_s}
        self.history.append(entry)
        act = getattr(self, f"_{fault.kind}")
        try:
            await act(fault, entry)
        except Exception as exc:  # a fault that could not be carried out is an anomaly
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["ended_s"] = self._now()
        entry.setdefault("took_effect", False)
        print(_line(entry), file=sys.stderr, flush=True)

    # -- targets --------------------------------------------------------------------
    def _pick_proc(self, kind: str, fault: Fault) -> str | None:
        members = [m.name for m in self.stack.of_kind(kind) if m.alive]
        free = [n for n in members if n not in self.busy_procs]
        if len(members) - len(free) >= len(self.stack.of_kind(kind)) - 1 or not free:
            return None  # one of each kind keeps running
        return free[fault.pick % len(free)]

    async def _healthy_shards(self) -> dict[int, tuple[int, ...]]:
        """Shards none of whose nodes is busy and which have a replica."""
        shards = await self.cluster.shards_now()
        return {
            m: reps
            for m, reps in shards.items()
            if reps and m not in self.busy_nodes and not (set(reps) & self.busy_nodes)
        }

    async def _live_slot(self, master: int) -> int | None:
        """A slot of a watched session that ``master`` serves, if any."""
        masters = await self.cluster.masters_now()
        mine = set(masters.get(master, []))
        slots = sorted({slot_of(live_channel(sid)) for sid, _ in self.run.sessions} & mine)
        return slots[0] if slots else None

    async def _owner(self, slot: int) -> int | None:
        masters = await self.cluster.masters_now()
        return next((p for p, ss in masters.items() if slot in ss), None)

    async def _rejoined(self, port: int, timeout_s: float = 60.0) -> bool:
        """Wait until the node on ``port`` is listed again as a replica (or a master)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                shards = await self.cluster.shards_now()
                if port in shards or any(port in reps for reps in shards.values()):
                    return True
            await asyncio.sleep(0.5)
        return False

    # -- relays and workers ------------------------------------------------------------
    async def _proc_kill(self, kind: str, fault: Fault, entry: dict[str, Any]) -> None:
        name = self._pick_proc(kind, fault)
        if name is None:
            entry["refused"] = f"every {kind} but one is down already"
            entry["took_effect"] = None
            return
        self.busy_procs.add(name)
        entry["target"] = name
        try:
            member = self.stack.procs[name]
            old_pid = self.stack.kill(name)
            assert member.proc is not None
            entry["exit"] = await member.proc.wait(5)
            await asyncio.sleep(fault.hold_s)
            await self.stack.restart(name)
            entry["pids"] = [old_pid, member.pid]
            entry["took_effect"] = entry["exit"] == -signal.SIGKILL and member.pid != old_pid
        finally:
            self.busy_procs.discard(name)

    async def _proc_freeze(self, kind: str, fault: Fault, entry: dict[str, Any]) -> None:
        name = self._pick_proc(kind, fault)
        if name is None:
            entry["refused"] = f"every {kind} but one is down already"
            entry["took_effect"] = None
            return
        self.busy_procs.add(name)
        entry["target"] = name
        member = self.stack.procs[name]
        assert member.proc is not None
        try:
            member.proc.send(signal.SIGSTOP)
            t0 = time.monotonic()
            answered = await _answers(self.run.http, member.url + "/healthz", fault.hold_s * 0.8)
            await asyncio.sleep(max(0.0, fault.hold_s - (time.monotonic() - t0)))
        finally:
            member.proc.send(signal.SIGCONT)
            self.busy_procs.discard(name)
        entry["answered_while_frozen"] = answered
        entry["answers_after"] = await _answers(self.run.http, member.url + "/healthz", 10.0)
        entry["took_effect"] = not answered and entry["answers_after"]

    async def _relay_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        await self._proc_kill("relay", fault, entry)

    async def _worker_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        await self._proc_kill("worker", fault, entry)

    async def _relay_freeze(self, fault: Fault, entry: dict[str, Any]) -> None:
        await self._proc_freeze("relay", fault, entry)

    async def _worker_freeze(self, fault: Fault, entry: dict[str, Any]) -> None:
        await self._proc_freeze("worker", fault, entry)

    # -- Redis ----------------------------------------------------------------------
    async def _shard(self, fault: Fault, entry: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
        """A healthy shard, preferring one that serves a watched session; (0, ()) and the
        refusal in ``entry`` when every shard has a node down already."""
        shards = await self._healthy_shards()
        if not shards:
            entry["refused"] = "every shard has a node down or rejoining (by design: not both)"
            entry["took_effect"] = None
            return 0, ()
        ports = sorted(shards)
        watched = [p for p in ports if await self._live_slot(p) is not None]
        pool = watched or ports
        master = pool[fault.pick % len(pool)]
        return master, shards[master]

    async def _master_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        master, _ = await self._shard(fault, entry)
        if not master:
            return
        self.busy_nodes.add(master)
        try:
            slot = await self._live_slot(master) or (await self.cluster.masters_now())[master][0]
            entry.update(target=master, slot=slot)
            self.cluster.kill_node(master)
            entry["exit"] = await self.cluster.process(master).wait(5)
            await asyncio.sleep(fault.hold_s)
            entry["slot_owner_after"] = await self._owner(slot)
            self.cluster.restart_node(master)
            entry["rejoined"] = await self._rejoined(master)
            entry["took_effect"] = (
                entry["exit"] == -signal.SIGKILL
                and entry["slot_owner_after"] not in (None, master)
                and entry["rejoined"]
            )
        finally:
            self.busy_nodes.discard(master)

    async def _master_freeze(self, fault: Fault, entry: dict[str, Any]) -> None:
        master, _ = await self._shard(fault, entry)
        if not master:
            return
        self.busy_nodes.add(master)
        try:
            entry["target"] = master
            self.cluster.pause_node(master)
            try:
                pinged = asyncio.create_task(ping(master, fault.hold_s + 5))
                await asyncio.sleep(fault.hold_s)
            finally:
                self.cluster.resume_node(master)
            answer, took = await pinged
            entry["ping_waited_s"] = round(took, 2) if answer == "PONG" else None
            entry["took_effect"] = answer == "PONG" and took >= fault.hold_s * 0.8
            entry["rejoined"] = await self._rejoined(master)  # maybe a replica now
        finally:
            self.busy_nodes.discard(master)

    async def _replica_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        master, replicas = await self._shard(fault, entry)
        if not master:
            return
        replica = replicas[fault.pick % len(replicas)]
        self.busy_nodes.add(replica)
        try:
            entry["target"] = replica
            self.cluster.kill_node(replica)
            entry["exit"] = await self.cluster.process(replica).wait(5)
            await asyncio.sleep(fault.hold_s)
            self.cluster.restart_node(replica)
            entry["rejoined"] = await self._rejoined(replica)
            entry["took_effect"] = entry["exit"] == -signal.SIGKILL and entry["rejoined"]
        finally:
            self.busy_nodes.discard(replica)

    async def _failover(self, fault: Fault, entry: dict[str, Any]) -> None:
        master, replicas = await self._shard(fault, entry)
        if not master:
            return
        replica = replicas[fault.pick % len(replicas)]
        self.busy_nodes |= {master, replica}
        try:
            entry.update(target=replica, master_before=master)
            await self.cluster.failover(replica)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if replica in await self.cluster.masters_now():
                    break
                await asyncio.sleep(0.2)
            entry["took_effect"] = replica in await self.cluster.masters_now()
        finally:
            self.busy_nodes -= {master, replica}

    async def _migrate(self, fault: Fault, entry: dict[str, Any]) -> None:
        shards = await self._healthy_shards()
        sources = [p for p in sorted(shards) if await self._live_slot(p) is not None]
        if len(shards) < 2 or not sources:
            entry["refused"] = "no two healthy shards with a watched session on one"
            entry["took_effect"] = None
            return
        src = sources[fault.pick % len(sources)]
        dst = next(p for p in sorted(shards) if p != src)
        slot = await self._live_slot(src)
        assert slot is not None
        self.busy_nodes |= {src, dst}
        try:
            entry.update(target=slot, source=src, destination=dst)
            entry["keys_moved"] = await self.cluster.migrate_slot(slot, src, dst)
            entry["slot_owner_after"] = await self._owner(slot)
            entry["took_effect"] = entry["slot_owner_after"] == dst and entry["keys_moved"] > 0
        finally:
            self.busy_nodes -= {src, dst}

    async def _partition(self, fault: Fault, entry: dict[str, Any]) -> None:
        if not self.can_partition:
            entry["refused"] = f"cannot partition here: {partition.unsupported()}"
            entry["took_effect"] = None
            return
        master, _ = await self._shard(fault, entry)
        if not master:
            return
        self.busy_nodes.add(master)
        try:
            entry["target"] = master
            t0 = time.monotonic()
            with partition.dropped(master):
                entry["ping_during"], _ = await ping(master, 1.0)
                await asyncio.sleep(max(0.0, fault.hold_s - (time.monotonic() - t0)))
            entry["ping_after"], _ = await ping(master, 5.0)
            entry["took_effect"] = entry["ping_during"] != "PONG" and entry["ping_after"] == "PONG"
        finally:
            self.busy_nodes.discard(master)

    # -- screens ----------------------------------------------------------------------
    async def _storm(self, fault: Fault, entry: dict[str, Any]) -> None:
        """Half the screens drop their connection at once and reconnect with their offset."""
        rng = random.Random(fault.pick)
        chosen = rng.sample(self.run.viewers, len(self.run.viewers) // 2)
        before = sum(v.connects for v in chosen)
        for v in chosen:
            task, stop = self.viewers[id(v)]
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            again = asyncio.Event()
            self.viewers[id(v)] = (asyncio.create_task(v.run(again)), again)
        await asyncio.sleep(2.0)
        entry.update(
            target=f"{len(chosen)} screens", reconnected=sum(v.connects for v in chosen) - before
        )
        entry["took_effect"] = entry["reconnected"] >= len(chosen) * 0.9


async def _answers(http: aiohttp.ClientSession, url: str, within_s: float) -> bool:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=within_s)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


_PLAIN = ("at_s", "kind", "hold_s", "ended_s", "took_effect", "refused", "error")


def _line(e: dict[str, Any]) -> str:
    """One fault of the history, for a person."""
    if "refused" in e:
        what = "refused: " + e["refused"]
    elif "error" in e:
        what = "error: " + e["error"]
    else:
        what = "took effect" if e.get("took_effect") else "NO EVIDENCE IT TOOK EFFECT"
    detail = json.dumps({k: v for k, v in e.items() if k not in _PLAIN}, sort_keys=True)
    span = f"{e['at_s']:>7.1f}s-{e.get('ended_s', 0):>7.1f}s"
    return f"  {span}  {e['kind']:<14} hold {e['hold_s']:>4.1f}s  {what}  {detail}"


async def run_nemesis(cfg: NemesisConfig) -> dict[str, Any]:
    duration = cfg.minutes * 60
    faults = plan(seed=cfg.seed, duration_s=duration, bursts=cfg.bursts, kinds=cfg.kinds,
                  quiet_s=cfg.quiet_s)  # fmt: skip
    random.seed(f"{cfg.seed}:nemesis")
    fcfg = FaultConfig(sessions=cfg.sessions, viewers_per_session=cfg.viewers_per_session,
                       decode_tok_per_s=cfg.decode_tok_per_s, seed=cfg.seed,
                       regenerate_share=0.1, stop_share=0.1)  # fmt: skip
    spec = StackSpec(relays=2, workers=2, engines=2, abuse_limits=False,
                     engine_args=["--decode-tok-per-s", str(cfg.decode_tok_per_s)])  # fmt: skip
    pids: list[int] = []
    async with Stack(spec) as stack:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            run = Run(fcfg, stack, http)
            await run.setup()
            tasks: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}
            for v in run.viewers:
                stop = asyncio.Event()
                tasks[id(v)] = (asyncio.create_task(v.run(stop)), stop)
            await asyncio.sleep(0.5)
            stop_turns = asyncio.Event()
            drivers = [asyncio.create_task(run.drive(sid, tok, stop_turns))
                       for sid, tok in run.sessions]  # fmt: skip
            nemesis = Nemesis(run, tasks)
            run.fault_at = nemesis.t0
            print(f"nemesis: seed {cfg.seed}, {len(faults)} faults in {cfg.bursts} bursts, "
                  f"{overlapping(faults)} overlapping, {cfg.minutes:g} min", file=sys.stderr,
                  flush=True)  # fmt: skip
            await nemesis.play(faults)
            await asyncio.sleep(max(0.0, duration - (time.monotonic() - nemesis.t0)))
            stop_turns.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(90):
                    await asyncio.gather(*drivers, return_exceptions=True)
            for d in drivers:
                d.cancel()
            await asyncio.sleep(3.0)  # the last frames reach every screen
            for _task, stop in tasks.values():
                stop.set()
            await asyncio.gather(*(t for t, _ in tasks.values()), return_exceptions=True)
            counts = run.report(await run.account())
            pids = [m.pid for m in stack.procs.values()] + [
                p.pid for p in (stack.cluster.procs.values() if stack.cluster else [])
            ]
    left = [p for p in pids if _alive(p)]
    history = nemesis.history
    done = [e for e in history if "refused" not in e]
    anomalies = [f"{e['kind']} at {e['at_s']}s: " + (e.get("error") or "no evidence it took effect")
                 for e in done if not e.get("took_effect")]  # fmt: skip
    anomalies += [f"{k}: {counts[k]}" for k in MUST_BE_ZERO if counts.get(k)]
    anomalies += [f"processes left over: {left}"] if left else []
    return {
        "seed": cfg.seed,
        "minutes": cfg.minutes,
        "faults_planned": len(faults),
        "faults_carried_out": len(done),
        "faults_refused": len(history) - len(done),
        "overlapping_planned": overlapping(faults),
        "overlapping_carried_out": _overlapping_done(done),
        "history": history,
        **counts,
        "anomalies": anomalies,
        "replay": f"python -m bench.faults.nemesis --seed {cfg.seed} --minutes {cfg.minutes:g} "
        f"--bursts {cfg.bursts}",
    }


def _overlapping_done(done: list[dict[str, Any]]) -> int:
    """How many faults carried out overlapped another in time."""
    spans = [(e["at_s"], max(e.get("ended_s", e["at_s"]), e["at_s"] + 0.1)) for e in done]
    return sum(
        1
        for i, (a0, a1) in enumerate(spans)
        if any(j != i and b0 < a1 and a0 < b1 for j, (b0, b1) in enumerate(spans))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Flags(Common):
    seed: int = flag(1, "the schedule's seed (the report prints the line that replays it)")
    minutes: float = flag(0.0, "length of the run (0: 30, or 3 with --quick)", least=0)
    bursts: int = flag(0, "bursts of 2-4 overlapping faults (0: 25, or 4 with --quick)", least=0)
    sessions: int = flag(0, "live sessions (0: 50, or 8 with --quick)", least=0)
    kinds: list[str] | None = flag(None, "schedule only this kind of fault", choices=KINDS)


def _run(f: Flags) -> Outcome:
    cfg = NemesisConfig.quick() if f.quick else NemesisConfig()
    cfg.seed = f.seed
    cfg.minutes = f.minutes or cfg.minutes
    cfg.bursts = f.bursts or cfg.bursts
    cfg.sessions = f.sessions or cfg.sessions
    cfg.kinds = list(f.kinds or cfg.kinds)
    report = asyncio.run(run_nemesis(cfg))
    lines = [_line(e) for e in report["history"]]
    summary = (
        f"nemesis seed {report['seed']}: {report['faults_carried_out']} faults carried out "
        f"({report['overlapping_carried_out']} overlapping), {report['faults_refused']} refused; "
        f"{report['viewers']} screens, {report['sessions']} sessions, {report['turns']} turns, "
        f"{report['frames']} frames; lost {report['lost']}, duplicated {report['duplicated']}, "
        f"out of order {report['out_of_order']}, unended {report['unended_turns']}, "
        f"stuck {report['viewers_behind']}, gaps reported {report['gaps_reported']}"
    )
    text = "\n".join(["history:", *lines, summary, *(f"ANOMALY {a}" for a in report["anomalies"]),
                      f"replay: {report['replay']}"])  # fmt: skip
    return Outcome(report, text, 1 if report["anomalies"] else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.faults.nemesis",
              description=__doc__.split("\n\n")[0],
              quick_help="3 minutes, 4 bursts, 8 sessions")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
