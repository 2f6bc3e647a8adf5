"""The stack a benchmark measures, started on request and stopped by pid whatever happens.

One context manager holds every process a benchmark starts (a local Redis Cluster,
relays, workers, engines, clients) and stops each of them by pid, in the reverse order,
on the way out: an exception, a Ctrl-C or a SIGTERM (turned into ``SystemExit`` by
:class:`~bench.harness.flags.Bench`) included. Processes are started with
:mod:`devstack.procs` (their logs in the stack's folder, readiness probed), the cluster
with :mod:`devstack.cluster.launcher`. Loopback only.

Order of use::

    async with bench_stack("closed-loop-") as st:
        url = await st.cluster(masters=3, replicas=1)       # or st.cluster(url=given)
        engine = await st.stamp_engine("engine", tokens_per_s=20)
        worker = await st.worker("w-bench", engines={"stamp": engine.url}, model="stamp")
        relay = await st.relay("r-bench")                   # relay.url, relay.pid
        ...                                                 # measure
    # every process stopped (SIGTERM, SIGKILL after a grace period), the cluster too

A relay and a worker are started for a load generator on one loopback address: no
authentication, and no per-address, per-session or per-token limits (``extra`` flags
come after these and win).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from devstack.cluster.launcher import ClusterInfo, LocalCluster
from devstack.procs import Probe, Proc, free_port, http_ok, launched

__all__ = ["BenchStack", "Served", "bench_stack"]

T = TypeVar("T")
HOST = "127.0.0.1"
# every client of a benchmark is 127.0.0.1: the per-address limits would refuse it
RELAY_OPEN = ("--insecure-no-auth", "--log-level", "WARNING", "--max-streams-per-address", "0",
              "--max-connections-per-address", "0", "--durable-address-bytes", "0",
              "--durable-token-bytes", "0")  # fmt: skip
WORKER_OPEN = ("--insecure-no-auth", "--engine-cap", "10000", "--session-rate", "0",
               "--turns-per-minute", "0", "--max-sessions-per-address", "0",
               "--max-connections-per-address", "0")  # fmt: skip


@dataclass
class Served:
    """A process of the stack that serves HTTP on a port: a relay, a worker, an engine."""

    proc: Proc
    port: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    base = url  # the name the relay benchmarks use

    @property
    def log_path(self) -> Path:
        assert self.proc.log is not None
        return self.proc.log


class BenchStack:
    """What :func:`bench_stack` yields: starts processes, each stopped on the way out."""

    def __init__(self, exits: contextlib.AsyncExitStack, log_dir: Path) -> None:
        self._exits = exits
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.cluster_info: ClusterInfo | None = None
        self.redis_url = ""

    async def cluster(self, *, masters: int = 3, replicas: int = 1, url: str | None = None,
                      extra_args: Sequence[str] = ()) -> str:  # fmt: skip
        """A local Redis Cluster (stopped on the way out; ``extra_args``: more flags of
        every node), or ``url`` when one is given; its URL. :attr:`cluster_info`: the
        nodes of the one started here."""
        if url:
            self.redis_url = url
            return url
        cluster = LocalCluster(masters=masters, replicas=replicas, extra_args=extra_args)
        self._exits.push_async_callback(cluster.stop)  # before start: a half-formed one too
        self.cluster_info = await cluster.start()
        self.redis_url = self.cluster_info.url
        return self.redis_url

    async def start(self, name: str, argv: Sequence[str], *, ready: Probe | None = None,
                    env: Mapping[str, str] | None = None, ready_s: float = 30.0,
                    grace_s: float = 15.0) -> Proc:  # fmt: skip
        """``argv`` as a child (its log ``<log_dir>/<name>.log``), ready when ``ready``
        holds; stopped by pid on the way out."""
        proc = await self._exits.enter_async_context(
            launched(
                argv,
                log=self.log_dir / f"{name}.log",
                ready=ready,
                name=name,
                env=env,
                ready_s=ready_s,
                grace_s=grace_s,
            )
        )
        self.procs.append(proc)
        return proc

    async def serve(self, name: str, argv: Callable[[int], Sequence[str]], health: str,
                    env: Mapping[str, str] | None = None) -> Served:  # fmt: skip
        """A server on a free port (``argv(port)``), ready when ``health`` answers 200."""
        port = free_port()
        ready = http_ok(f"http://{HOST}:{port}{health}")
        return Served(await self.start(name, argv(port), ready=ready, env=env), port)

    async def enter(self, cm: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Enter ``cm`` (a process of a peer, a client session); left on the way out."""
        return await self._exits.enter_async_context(cm)

    def on_exit(self, *close: Callable[[], Awaitable[object]]) -> None:
        """Call each of ``close`` on the way out (the last given first), before what was
        started earlier (the cluster) stops."""
        for c in close:
            self._exits.push_async_callback(c)

    def _redis(self, redis: str | None) -> str:
        url = redis or self.redis_url
        if not url:
            raise RuntimeError("no Redis: call cluster() first or give redis=")
        return url

    async def relay(self, name: str = "relay", *extra: str, redis: str | None = None,
                    env: Mapping[str, str] | None = None) -> Served:  # fmt: skip
        """``tokenrelay relay`` (relay id ``name``), open to one address."""
        url = self._redis(redis)
        return await self.serve(name, lambda port: [
            sys.executable, "-m", "tokenrelay", "relay", "--port", str(port), "--redis", url,
            "--relay-id", name, *RELAY_OPEN, *extra], "/readyz", env=env)  # fmt: skip

    async def worker(self, name: str, *extra: str, engines: Mapping[str, str],
                     model: str | None = None, redis: str | None = None) -> Served:  # fmt: skip
        """``tokenrelay worker`` (worker id ``name``) on ``engines`` (id -> URL)."""
        url = self._redis(redis)
        eng = [a for eid, e in engines.items() for a in ("--engine", f"{eid}={e}")]
        mod = ["--model", model] if model else []
        return await self.serve(name, lambda port: [
            sys.executable, "-m", "tokenrelay", "worker", "--port", str(port), "--redis", url,
            "--worker-id", name, *WORKER_OPEN, *mod, *eng, *extra], "/readyz")  # fmt: skip

    async def stamp_engine(self, name: str, tokens_per_s: float) -> Served:
        """:mod:`bench.load.stamp_engine`: tokens that carry the time they were made."""
        return await self.serve(name, lambda port: [
            sys.executable, "-m", "bench.load.stamp_engine", "--port", str(port),
            "--tokens-per-s", str(tokens_per_s)], "/health")  # fmt: skip

    async def mock_engine(self, name: str, *extra: str) -> Served:
        """The mock engine (``python -m devstack engine``) with ``extra`` flags."""
        return await self.serve(name, lambda port: [
            sys.executable, "-m", "devstack", "engine", "--port", str(port), "--id", name,
            *extra], "/health")  # fmt: skip


@contextlib.asynccontextmanager
async def bench_stack(
    prefix: str = "bench-", log_dir: Path | None = None
) -> AsyncIterator[BenchStack]:
    """A :class:`BenchStack` whose logs go to ``log_dir`` (default: a temporary folder,
    removed on the way out); every process it started is stopped by pid on the way out."""
    async with contextlib.AsyncExitStack() as exits:
        if log_dir is None:
            log_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        yield BenchStack(exits, log_dir)
