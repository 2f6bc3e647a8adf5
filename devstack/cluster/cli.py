"""``python -m devstack cluster up|form|status|down``: a local Redis Cluster for development.

``up`` starts and forms a cluster of local nodes on loopback ports (the nodes outlive the
command; ``down`` stops them by the pids recorded in the state file), ``status`` asks
every node for its health, ``form`` joins already running nodes (docker-compose's init
service). Registered as the ``cluster`` entry point of :mod:`tokenrelay.cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from devstack.cluster.form import ClusterError
from devstack.cluster.launcher import LocalCluster, read_state, stop_from_state, write_state

__all__ = ["register"]

DEFAULT_DIR = ".tokenrelay/cluster"


def _state_path(directory: str) -> Path:
    return Path(directory) / "cluster.json"


def _cluster_up(args: argparse.Namespace) -> int:
    state = _state_path(args.dir)
    if state.exists():
        print(f"a cluster is already recorded in {state}; "
              "run `python -m devstack cluster down` first")  # fmt: skip
        return 1
    data_dir = str(Path(args.dir).resolve() / "data")
    cluster = LocalCluster(
        masters=args.masters, replicas=args.replicas, base_port=args.port, data_dir=data_dir
    )
    try:
        info = asyncio.run(cluster.start())
    except (ClusterError, TimeoutError) as exc:  # start() stopped what it had started
        shutil.rmtree(data_dir, ignore_errors=True)  # and nothing is left half-built
        why = str(exc) or "the cluster did not form in time (every node was stopped)"
        print(f"error: {why}", file=sys.stderr)
        return 1
    write_state(info, state)
    cluster.detach()  # the nodes outlive this command; `cluster down` stops them by pid
    print(f"cluster up: {info.flavor} {info.version}, {len(info.masters)} masters, "
          f"{len(info.replicas)} replicas")  # fmt: skip
    for node in info.nodes:
        print(f"  {node.role:<8} {node.addr}  pid {node.pid}")
    print(f"url: {info.url}   (state: {state})")
    return 0


async def _status(state: Path) -> int:
    import redis.asyncio as aioredis

    info = read_state(state)
    healthy = True
    for node in info.nodes:
        client = aioredis.Redis(host=node.host, port=node.port, socket_timeout=2)
        try:
            cinfo = (await client.execute_command("CLUSTER", "INFO")).decode()
            fields = dict(ln.split(":", 1) for ln in cinfo.splitlines() if ":" in ln)
            role = (await client.info("replication")).get("role", "?")
            line = f"cluster_state:{fields.get('cluster_state')} role:{role}"
            healthy &= fields.get("cluster_state") == "ok"
        except Exception as exc:  # any failure is a status line, not a crash
            line = f"DOWN ({type(exc).__name__}: {exc})"
            healthy = False
        finally:
            await client.aclose()
        print(f"  {node.addr}  pid {node.pid}  {line}")
    print("healthy" if healthy else "NOT healthy")
    return 0 if healthy else 1


def _cluster_status(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_status(_state_path(args.dir)))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _cluster_down(args: argparse.Namespace) -> int:
    try:
        stopped = stop_from_state(_state_path(args.dir))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"stopped {len(stopped)} processes: {' '.join(map(str, stopped))}")
    return 0


def _cluster_form(args: argparse.Namespace) -> int:
    """Form a cluster of already running nodes (docker-compose's init service)."""
    import socket

    from devstack.cluster.form import Node
    from devstack.cluster.launcher import form_cluster

    addrs = [a for arg in args.node for a in arg.split(",") if a]
    per_shard = 1 + args.replicas
    if len(addrs) % per_shard:
        print(f"error: {len(addrs)} nodes do not split into shards of {per_shard}", file=sys.stderr)
        return 2
    masters = len(addrs) // per_shard
    nodes = []
    for i, addr in enumerate(addrs):
        host, _, port = addr.rpartition(":")
        try:
            ip = socket.gethostbyname(host)  # CLUSTER MEET takes an IP address
        except OSError as exc:
            print(f"error: cannot resolve {host}: {exc}", file=sys.stderr)
            return 1
        nodes.append(Node(ip, int(port), "master" if i < masters else "replica"))
    if len({n.port for n in nodes}) != len(nodes):
        print("error: give every node its own port (nodes are told apart by port)", file=sys.stderr)
        return 2
    for i, node in enumerate(nodes[masters:]):
        node.master_port = nodes[i % masters].port
    try:
        asyncio.run(form_cluster(nodes))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"cluster formed: {masters} masters, {len(nodes) - masters} replicas")
    return 0


def register(sub: Any) -> None:
    """Add ``python -m devstack cluster up|form|status|down`` (:mod:`devstack.cli`)."""
    p = sub.add_parser("cluster", help="a local Redis Cluster on loopback ports")
    csub = p.add_subparsers(dest="cluster_cmd", required=True)
    default_dir = os.environ.get("TOKENRELAY_CLUSTER_DIR", DEFAULT_DIR)
    up = csub.add_parser("up", help="start and form a cluster")
    up.add_argument("--masters", type=int, default=3)
    up.add_argument("--replicas", type=int, default=1)
    up.add_argument("--port", type=int, default=7000, help="first port (default 7000)")
    up.add_argument("--dir", default=default_dir, help="state and data directory")
    up.set_defaults(func=_cluster_up)
    form = csub.add_parser("form", help="form a cluster of running nodes (containers)")
    form.add_argument("--node", action="append", required=True, help="host:port (repeatable)")
    form.add_argument("--replicas", type=int, default=1)
    form.set_defaults(func=_cluster_form)
    for name, func, text in (
        ("status", _cluster_status, "health of every node"),
        ("down", _cluster_down, "stop the nodes (by pid) and remove their data"),
    ):
        cp = csub.add_parser(name, help=text)
        cp.add_argument("--dir", default=default_dir)
        cp.set_defaults(func=func)
