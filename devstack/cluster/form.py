"""Forming a local Redis Cluster with CLUSTER commands, and reading and changing its slot map.

Order of use::

    await form_cluster(nodes, procs)           # fresh cluster-enabled nodes -> one cluster
    masters = await masters_now(nodes, procs)  # master port -> the slots it serves
    moved = await migrate_slot(nodes, procs, slot, src, dst, host="127.0.0.1")
    # one slot and its keys moved from the master on port src to the one on port dst

The cluster is formed with CLUSTER commands from Python (MEET, ADDSLOTSRANGE,
REPLICATE): no redis-cli. :func:`form_cluster` returns once every node agrees:
cluster_state:ok, all 16384 slots assigned, the same slot map (read from CLUSTER NODES)
with every replica attached and listed in CLUSTER SLOTS.

:mod:`devstack.cluster.launcher` starts and stops the processes and calls in here;
:meth:`~devstack.cluster.launcher.LocalCluster.masters_now` and
:meth:`~devstack.cluster.launcher.LocalCluster.migrate_slot` are thin wrappers over the functions of
the same name. The two types both modules share, :class:`Node` and
:class:`ClusterError`, live here (this module imports nothing from :mod:`devstack.cluster.launcher`)
and are re-exported by :mod:`devstack.cluster.launcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from devstack.procs import Proc

__all__ = [
    "TOTAL_SLOTS",
    "ClusterError",
    "Node",
    "NotMaster",
    "form_cluster",
    "masters_now",
    "migrate_slot",
]

TOTAL_SLOTS = 16384


class ClusterError(RuntimeError):
    """The cluster could not be started, formed or stopped; the message says why."""


@dataclass
class Node:
    host: str
    port: int
    role: str  # "master" or "replica"
    pid: int = 0
    node_id: str = ""
    master_port: int = 0  # for replicas: the port of their master
    data_dir: str = ""
    start_ticks: int = 0  # /proc/<pid>/stat start time: tells our process from a reused pid

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


async def form_cluster(
    nodes: list[Node],
    procs: Mapping[int, Proc] | None = None,
    client_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Form a cluster of fresh cluster-enabled nodes with CLUSTER commands; wait until
    every node agrees. Nodes with role "replica" replicate the node at ``master_port``.
    ``client_kwargs`` go to every redis-py client opened here (TLS files, a password).
    """
    procs = procs or {}
    kw = dict(client_kwargs or {})
    clients = {n.port: aioredis.Redis(host=n.host, port=n.port, **kw) for n in nodes}
    try:
        for node in nodes:
            await _wait_ping(clients[node.port], node, procs.get(node.port))
            node.node_id = (await clients[node.port].execute_command("CLUSTER", "MYID")).decode()
        first = nodes[0]
        for node in nodes[1:]:
            await clients[node.port].execute_command("CLUSTER", "MEET", first.host, first.port)
        await _until(lambda: _all_know(clients, len(nodes)), "nodes to meet")
        masters = [n for n in nodes if n.role == "master"]
        for i, node in enumerate(masters):
            lo = i * TOTAL_SLOTS // len(masters)
            hi = (i + 1) * TOTAL_SLOTS // len(masters) - 1
            await clients[node.port].execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        by_port = {n.port: n for n in nodes}
        for node in nodes:
            if node.role == "replica":
                master_id = by_port[node.master_port].node_id
                await _until(
                    lambda n=node, m=master_id: _knows_master(clients[n.port], m),
                    f"{node.addr} to see its master",
                )
                await clients[node.port].execute_command("CLUSTER", "REPLICATE", master_id)
        await _until(lambda: _converged(clients, nodes), "cluster_state:ok on every node")
    finally:
        for c in clients.values():
            await c.aclose()


async def _wait_ping(client: aioredis.Redis, node: Node, proc: Proc | None) -> None:
    deadline = time.monotonic() + 15
    while True:
        if proc is not None and not proc.alive:
            raise ClusterError(proc.why())
        try:
            if await client.ping():
                return
        except (aioredis.ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"server on port {node.port} did not answer PING")
        await asyncio.sleep(0.05)


async def _until(check: Any, what: str, timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _all_know(clients: dict[int, aioredis.Redis], count: int) -> bool:
    for c in clients.values():
        text = (await c.execute_command("CLUSTER", "NODES")).decode()
        lines = [ln for ln in text.splitlines() if ln.strip() and "handshake" not in ln]
        if len(lines) < count:
            return False
    return True


async def _knows_master(client: aioredis.Redis, master_id: str) -> bool:
    text = (await client.execute_command("CLUSTER", "NODES")).decode()
    return any(ln.startswith(master_id) and "master" in ln for ln in text.splitlines())


def _parse_info(raw: bytes | str) -> dict[str, str]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    return dict(ln.split(":", 1) for ln in text.splitlines() if ":" in ln)


def _topology(cluster_nodes: str) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Canonical slot map from CLUSTER NODES: (first slot, last slot, master port, replicas).

    CLUSTER NODES rather than CLUSTER SLOTS: Redis 7.0 hides a replica from CLUSTER SLOTS
    until its replication offset is non-zero, i.e. until the first write or ping.
    """
    port_of: dict[str, int] = {}
    replicas_of: dict[str, list[int]] = {}
    ranges: list[tuple[int, int, str]] = []
    for line in cluster_nodes.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        node_id, addr, flags, master_id = parts[0], parts[1], parts[2].split(","), parts[3]
        if "fail" in flags or "handshake" in flags or "noaddr" in flags:
            continue
        port_of[node_id] = int(addr.split("@")[0].rsplit(":", 1)[1])
        if "slave" in flags and master_id != "-":
            replicas_of.setdefault(master_id, []).append(port_of[node_id])
        for slot in parts[8:]:
            if slot.startswith("["):
                continue  # a slot being imported/migrated
            lo, _, hi = slot.partition("-")
            ranges.append((int(lo), int(hi or lo), node_id))
    return sorted(
        (lo, hi, port_of[nid], tuple(sorted(replicas_of.get(nid, ())))) for lo, hi, nid in ranges
    )


async def _converged(clients: dict[int, aioredis.Redis], nodes: list[Node]) -> bool:
    """Every node: cluster_state:ok, all slots assigned, the same slot map with replicas."""
    maps = []
    for c in clients.values():
        info = _parse_info(await c.execute_command("CLUSTER", "INFO"))
        if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(TOTAL_SLOTS):
            return False
        maps.append(_topology((await c.execute_command("CLUSTER", "NODES")).decode()))
    if any(m != maps[0] for m in maps):
        return False
    want = {
        m.port: tuple(sorted(r.port for r in nodes if r.master_port == m.port))
        for m in nodes
        if m.role == "master"
    }
    have = {master: replicas for _lo, _hi, master, replicas in maps[0]}
    if have != want:
        return False
    for c in clients.values():  # what cluster clients see: replicas listed in CLUSTER SLOTS
        slots = await c.execute_command("CLUSTER", "SLOTS")
        listed = {int(e[2][1]): tuple(sorted(int(r[1]) for r in e[3:])) for e in slots}
        if listed != want:
            return False
    for node in nodes:
        if node.role == "replica":
            role = await clients[node.port].info("replication")
            if role.get("master_link_status") != "up":
                return False
    return True


async def _topology_now(
    nodes: list[Node], procs: Mapping[int, Proc], client_kwargs: Mapping[str, Any] | None
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """:func:`_topology` from the first of ``nodes`` whose process in ``procs`` is running
    and answers ``CLUSTER NODES`` (after a failover the roles differ from ``nodes``)."""
    for node in nodes:
        if node.port not in procs or not procs[node.port].alive:
            continue
        c = aioredis.Redis(host=node.host, port=node.port, **dict(client_kwargs or {}))
        try:
            text = (await c.execute_command("CLUSTER", "NODES")).decode()
        except (aioredis.ConnectionError, OSError):
            continue
        finally:
            await c.aclose()
        return _topology(text)
    raise ClusterError("no node answered CLUSTER NODES")


async def masters_now(
    nodes: list[Node],
    procs: Mapping[int, Proc],
    client_kwargs: Mapping[str, Any] | None = None,
) -> dict[int, list[int]]:
    """Current master port -> slots it serves (see :func:`_topology_now`)."""
    out: dict[int, list[int]] = {}
    for lo, hi, master, _replicas in await _topology_now(nodes, procs, client_kwargs):
        out.setdefault(master, []).extend(range(lo, hi + 1))
    return out


async def shards_now(
    nodes: list[Node],
    procs: Mapping[int, Proc],
    client_kwargs: Mapping[str, Any] | None = None,
) -> dict[int, tuple[int, ...]]:
    """Current master port -> the ports of its replicas that are not marked failed (see
    :func:`_topology_now`)."""
    topology = await _topology_now(nodes, procs, client_kwargs)
    return {master: replicas for _lo, _hi, master, replicas in topology}


async def failover(
    node: Node, *, force: bool = False, client_kwargs: Mapping[str, Any] | None = None
) -> None:
    """``CLUSTER FAILOVER`` on the replica ``node``: it takes over its master's slots
    (``force``: without the master's agreement, for a master that does not answer)."""
    c = aioredis.Redis(host=node.host, port=node.port, **dict(client_kwargs or {}))
    try:
        await c.execute_command("CLUSTER", "FAILOVER", *(["FORCE"] if force else []))
    finally:
        await c.aclose()


class NotMaster(ClusterError):
    """A node a slot migration needs as a master is not one now (a failover demoted it,
    or the view it was chosen from was stale): nothing was changed."""


async def _role(client: aioredis.Redis) -> str:
    """What the node says it is: ``master`` or ``slave`` (``ROLE``)."""
    reply = await client.execute_command("ROLE")
    role = reply[0]
    return role.decode() if isinstance(role, bytes) else str(role)


async def _still_owner(client: aioredis.Redis, port: int, slot: int | None) -> None:
    """Raise :class:`NotMaster` unless the node is a master now and, given ``slot``,
    serves it by its own account (``CLUSTER NODES``' ``myself`` line)."""
    if (role := await _role(client)) != "master":
        raise NotMaster(f"{port} is a {role} now, not a master")
    if slot is None:
        return
    text = (await client.execute_command("CLUSTER", "NODES")).decode()
    mine: list[str] = next(
        (ln.split() for ln in text.splitlines() if "myself" in ln.split()[2]), []
    )
    for r in mine[8:]:
        if r.startswith("["):
            continue  # a slot being imported or migrated
        lo, _, hi = r.partition("-")
        if int(lo) <= slot <= int(hi or lo):
            return
    raise NotMaster(f"{port} does not serve slot {slot} now")


async def migrate_slot(
    nodes: list[Node],
    procs: Mapping[int, Proc],
    slot: int,
    src: int,
    dst: int,
    *,
    host: str,
    batch: int = 100,
    timeout_ms: int = 5000,
    client_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Move ``slot`` from the master on port ``src`` to the master on port ``dst`` (all
    masters on ``host``) while clients keep using it; return the number of keys moved.

    The standard resharding steps: SETSLOT IMPORTING on dst, SETSLOT MIGRATING on
    src, MIGRATE the keys in batches (clients meanwhile get ASK / TRYAGAIN), then
    SETSLOT NODE on dst, src and every other master. The servers then push an
    unsolicited ``sunsubscribe`` to the slot's shard subscribers.
    """
    if not 0 <= slot < TOTAL_SLOTS or src == dst:
        raise ClusterError(f"cannot move slot {slot} from {src} to {dst}")
    kw = dict(client_kwargs or {})
    masters = await masters_now(nodes, procs, kw)
    if src not in masters or dst not in masters:
        raise NotMaster(f"{src} and {dst} must both be masters (masters: {list(masters)})")
    clients = {p: aioredis.Redis(host=host, port=p, **kw) for p in masters}
    try:
        # the view above is one node's, and gossip may lag a failover: right before the
        # first SETSLOT, each of the two says itself what it is and what it serves
        await _still_owner(clients[src], src, slot)
        await _still_owner(clients[dst], dst, None)
        ids = {
            p: (await clients[p].execute_command("CLUSTER", "MYID")).decode() for p in (src, dst)
        }
        await clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        await clients[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        moved = 0
        while True:
            keys = await clients[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            await clients[src].execute_command(
                "MIGRATE", host, dst, "", 0, timeout_ms, "REPLACE", "KEYS", *keys
            )
            moved += len(keys)
        await clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        await clients[src].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        for p in masters:  # the others learn it by gossip too: told only while masters
            if p in (src, dst):
                continue
            with contextlib.suppress(aioredis.ConnectionError, OSError):  # one gone: gossip
                if await _role(clients[p]) == "master":
                    await clients[p].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        return moved
    finally:
        for c in clients.values():
            await c.aclose()
