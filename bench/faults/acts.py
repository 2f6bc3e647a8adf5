"""The nemesis's acts: one fault carried out against a running stack, with its evidence.

Used by :mod:`bench.faults.nemesis`, which draws the schedule and runs the workload.
Each act records in its history entry what it did (``target``), the evidence that it
took effect (an exit status, who serves a slot after, a PING that waited or got no
answer, a reconnect count) and ``took_effect``; or ``refused`` with the reason where the
combination cannot be survived by design (both nodes of one shard, every relay or
every worker at once). Redis faults touch at most one node per shard at a time.

Order of use::

    nemesis = Nemesis(run, viewer_tasks)
    await nemesis.play(faults)        # each at its time, overlapping
    nemesis.history                   # one entry per fault; line(entry) prints one
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.faults import partition
from bench.faults.probes import ping
from bench.faults.producers import Producers
from bench.faults.run import Run
from bench.faults.schedule import Fault
from devstack.cluster.form import NotMaster
from devstack.cluster.launcher import LocalCluster
from devstack.demo.stack import Member
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import slot_of

__all__ = ["MASTER_OUT", "Nemesis", "line"]

# the faults that take a master out of the cluster's vote (a freeze past the node timeout
# counts: the others mark it failed)
MASTER_OUT = ("master_kill", "master_freeze")


class Nemesis:
    """Runs the schedule against one stack, one fault at its time each, and keeps the
    history. Redis faults touch at most one node per shard at a time; relay and worker
    faults leave one of each running."""

    def __init__(
        self,
        run: Run,
        viewers: dict[int, tuple[asyncio.Task[None], asyncio.Event]],
        producers: Producers | None = None,
    ) -> None:
        self.run = run
        self.producers = producers
        self.stack = run.stack
        self.viewers = viewers
        self.history: list[dict[str, Any]] = []
        self.busy_nodes: set[int] = set()  # Redis ports down, frozen, cut off or rejoining
        self.busy_procs: set[str] = set()  # relays and workers down or frozen
        # masters killed or frozen now: a replica is elected by a majority of the masters,
        # so fewer than half of them may be out at once
        self.masters_out: set[int] = set()
        self._picking = asyncio.Lock()  # a target's choice and its marking, one at a time
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
        print(line(entry), file=sys.stderr, flush=True)

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

    async def _rejoined(self, port: int, timeout_s: float = 90.0) -> bool:
        """Wait until the node on ``port`` is listed again in the cluster and, as a
        replica, has its master's data (``master_link_status:up``, no sync in progress).
        A node restarted without persistence is empty until then: a failover to it would
        lose its whole shard, a combination this run refuses by design, so the shard stays
        busy until this holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                shards = await self.cluster.shards_now()
                if port in shards:
                    return True  # a master again (it outlived a freeze)
                if any(port in reps for reps in shards.values()) and await _synced(port):
                    return True
            await asyncio.sleep(0.5)
        return False

    # -- relays and workers ------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _taking_proc(
        self, kind: str, fault: Fault, entry: dict[str, Any]
    ) -> AsyncIterator[Member | None]:
        """A relay or worker for the ``async with`` block (marked busy, given back at its
        end, named in ``entry``); None when refused (the reason is in ``entry``)."""
        name = self._pick_proc(kind, fault)
        if name is None:
            _refuse(entry, f"every {kind} but one is down already")
            yield None
            return
        self.busy_procs.add(name)
        entry["target"] = name
        try:
            yield self.stack.procs[name]
        finally:
            self.busy_procs.discard(name)

    async def _proc_kill(self, kind: str, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_proc(kind, fault, entry) as member:
            if member is None:
                return
            old_pid = self.stack.kill(member.name)
            assert member.proc is not None
            entry["exit"] = await member.proc.wait(5)
            await asyncio.sleep(fault.hold_s)
            await self.stack.restart(member.name)
            entry["pids"] = [old_pid, member.pid]
            entry["took_effect"] = entry["exit"] == -signal.SIGKILL and member.pid != old_pid

    async def _proc_freeze(self, kind: str, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_proc(kind, fault, entry) as member:
            if member is None:
                return
            assert member.proc is not None
            try:
                member.proc.send(signal.SIGSTOP)
                t0 = time.monotonic()
                answered = await _answers(self.run.http, member.url + "/healthz",
                                          fault.hold_s * 0.8)  # fmt: skip
                await asyncio.sleep(max(0.0, fault.hold_s - (time.monotonic() - t0)))
            finally:
                member.proc.send(signal.SIGCONT)
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
        """A healthy shard, preferring one that serves a watched session, taken whole
        (every node of it marked busy, in one step with the choice, so that two faults
        starting together never pick the same shard; :meth:`_taking_shard` gives it
        back); (0, ()) and the refusal in ``entry`` when every shard has a node down."""
        async with self._picking:
            if fault.kind in MASTER_OUT:
                masters = len(await self.cluster.shards_now())
                if len(self.masters_out) + 1 > (masters - 1) // 2:
                    _refuse(entry, "a majority of the masters would be out at once: no replica "
                                   "could be elected (by design: fewer than half)")  # fmt: skip
                    return 0, ()
            shards = await self._healthy_shards()
            if not shards:
                _refuse(entry, "every shard has a node down or rejoining (by design: not both)")
                return 0, ()
            ports = sorted(shards)
            watched = [p for p in ports if await self._live_slot(p) is not None]
            pool = watched or ports
            master = pool[fault.pick % len(pool)]
            self.busy_nodes |= {master, *shards[master]}
            if fault.kind in MASTER_OUT:
                self.masters_out.add(master)
            return master, shards[master]

    @contextlib.asynccontextmanager
    async def _taking_shard(
        self, fault: Fault, entry: dict[str, Any]
    ) -> AsyncIterator[tuple[int, tuple[int, ...]] | None]:
        """:meth:`_shard`'s shard (master, replicas) for the ``async with`` block, given
        back at its end; None when refused (the reason is in ``entry``)."""
        master, replicas = await self._shard(fault, entry)
        if not master:
            yield None
            return
        try:
            yield master, replicas
        finally:
            self.busy_nodes -= {master, *replicas}
            self.masters_out.discard(master)

    async def _master_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_shard(fault, entry) as shard:
            if shard is None:
                return
            master, _replicas = shard
            slot = await self._live_slot(master) or (await self.cluster.masters_now())[master][0]
            entry.update(target=master, slot=slot)
            self.cluster.kill_node(master)
            entry["exit"] = await self.cluster.process(master).wait(5)
            await asyncio.sleep(fault.hold_s)
            # the replica's election may outlast a short hold on a busy machine: wait for
            # it (the evidence) before the node comes back, at most 20 s
            deadline = time.monotonic() + 20
            while (owner := await self._owner(slot)) in (None, master):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            entry["slot_owner_after"] = owner
            self.cluster.restart_node(master)
            entry["rejoined"] = await self._rejoined(master)
            entry["took_effect"] = (
                entry["exit"] == -signal.SIGKILL
                and entry["slot_owner_after"] not in (None, master)
                and entry["rejoined"]
            )

    async def _master_freeze(self, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_shard(fault, entry) as shard:
            if shard is None:
                return
            master, _replicas = shard
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

    async def _replica_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_shard(fault, entry) as shard:
            if shard is None:
                return
            _master, replicas = shard
            replica = replicas[fault.pick % len(replicas)]
            entry["target"] = replica
            self.cluster.kill_node(replica)
            entry["exit"] = await self.cluster.process(replica).wait(5)
            await asyncio.sleep(fault.hold_s)
            self.cluster.restart_node(replica)
            entry["rejoined"] = await self._rejoined(replica)
            entry["took_effect"] = entry["exit"] == -signal.SIGKILL and entry["rejoined"]

    async def _failover(self, fault: Fault, entry: dict[str, Any]) -> None:
        async with self._taking_shard(fault, entry) as shard:
            if shard is None:
                return
            master, replicas = shard
            replica = replicas[fault.pick % len(replicas)]
            entry.update(target=replica, master_before=master)
            await self.cluster.failover(replica)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if replica in await self.cluster.masters_now():
                    break
                await asyncio.sleep(0.2)
            entry["took_effect"] = replica in await self.cluster.masters_now()

    async def _migrate(self, fault: Fault, entry: dict[str, Any]) -> None:
        """A live slot moved to another shard. The shards are chosen from one node's view,
        which may lag a failover: the move itself checks, right before its first SETSLOT,
        that both nodes are masters by their own account (and the source serves the slot),
        and this act then reads the topology again and chooses once more; a second
        refusal is recorded with its reason."""
        for attempt in range(2):
            async with self._picking:  # choice and marking in one step, as in _shard
                shards = await self._healthy_shards()
                sources = [p for p in sorted(shards) if await self._live_slot(p) is not None]
                if len(shards) < 2 or not sources:
                    _refuse(entry, "no two healthy shards with a watched session on one")
                    return
                src = sources[fault.pick % len(sources)]
                dst = next(p for p in sorted(shards) if p != src)
                slot = await self._live_slot(src)
                assert slot is not None
                taken = {src, dst, *shards[src], *shards[dst]}
                self.busy_nodes |= taken
            try:
                entry.update(target=slot, source=src, destination=dst)
                entry["keys_moved"] = await self.cluster.migrate_slot(slot, src, dst)
            except NotMaster as exc:
                entry.setdefault("stale_views", []).append(str(exc))
                if attempt == 0:
                    await asyncio.sleep(1.0)  # the cluster's view settles; choose again
                    continue
                _refuse(entry, f"the topology changed under the move twice: {exc}")
                return
            finally:
                self.busy_nodes -= taken
            entry["slot_owner_after"] = await self._owner(slot)
            entry["took_effect"] = entry["slot_owner_after"] == dst and entry["keys_moved"] > 0
            return

    async def _partition(self, fault: Fault, entry: dict[str, Any]) -> None:
        if not self.can_partition:
            _refuse(entry, f"cannot partition here: {partition.unsupported()}")
            return
        async with self._taking_shard(fault, entry) as shard:
            if shard is None:
                return
            master, _replicas = shard
            entry["target"] = master
            t0 = time.monotonic()
            with partition.dropped(master):
                entry["ping_during"], _ = await ping(master, 1.0)
                await asyncio.sleep(max(0.0, fault.hold_s - (time.monotonic() - t0)))
            entry["ping_after"], _ = await ping(master, 5.0)
            entry["took_effect"] = entry["ping_during"] != "PONG" and entry["ping_after"] == "PONG"

    # -- producers of your own --------------------------------------------------------
    async def _producer_kill(self, fault: Fault, entry: dict[str, Any]) -> None:
        """SIGKILL a producer process mid-turn, start it again after the hold: its open
        turn is the relays' (its lock expires) or the next start's to end."""
        names = [n for n in (self.producers.names if self.producers else [])
                 if n not in self.busy_procs]  # fmt: skip
        if not names or self.producers is None:
            _refuse(entry, "no producer process to kill")
            return
        name = names[fault.pick % len(names)]
        self.busy_procs.add(name)
        try:
            proc = self.producers.procs[name]
            if not proc.alive:
                _refuse(entry, f"{name} has ended (the run is nearly over)")
                return
            entry["target"] = name
            old = self.producers.kill(name)
            entry["exit"] = await proc.wait(5)
            await asyncio.sleep(fault.hold_s)
            new = self.producers.restart(name)
            entry["pids"] = [old, new]
            entry["took_effect"] = entry["exit"] == -signal.SIGKILL
        finally:
            self.busy_procs.discard(name)

    # -- screens ----------------------------------------------------------------------
    async def _storm(self, fault: Fault, entry: dict[str, Any]) -> None:
        """Half the screens drop their connection at once and reconnect with their
        offset. Evidence: every one of them connected again (within 20 s)."""
        rng = random.Random(fault.pick)
        chosen = rng.sample(self.run.viewers, len(self.run.viewers) // 2)
        before = sum(v.connects for v in chosen)
        dropped = [self.viewers[id(v)] for v in chosen]
        for _task, stop in dropped:
            stop.set()
        await asyncio.gather(*(task for task, _ in dropped), return_exceptions=True)
        for v in chosen:
            again = asyncio.Event()
            self.viewers[id(v)] = (asyncio.create_task(v.run(again)), again)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if sum(v.connects for v in chosen) - before >= len(chosen):
                break
            await asyncio.sleep(0.2)
        reconnected = sum(v.connects for v in chosen) - before
        entry.update(target=f"{len(chosen)} screens", reconnected=reconnected)
        entry["took_effect"] = reconnected >= len(chosen)


def _refuse(entry: dict[str, Any], why: str) -> None:
    """A fault not carried out, by design: the reason, and no verdict on its effect."""
    entry["refused"] = why
    entry["took_effect"] = None


async def _synced(port: int) -> bool:
    """A replica holds its master's data: its link is up and no sync is running."""
    c = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        raw = await c.execute_command("INFO", "replication")
    finally:
        await c.aclose()
    info = raw if isinstance(raw, dict) else {}
    return info.get("master_link_status") == "up" and not int(
        info.get("master_sync_in_progress", 1)
    )


async def _answers(http: aiohttp.ClientSession, url: str, within_s: float) -> bool:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=within_s)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


_PLAIN = ("at_s", "kind", "hold_s", "ended_s", "took_effect", "refused", "error")


def line(e: dict[str, Any]) -> str:
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
