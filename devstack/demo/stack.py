"""Run the whole stack as child processes: Redis Cluster, engines, relays, workers.

Used by ``python -m devstack demo``, ``bench.load.loadtest`` and
``bench.faults.drills``. Every process is a child started here and stopped here, by pid
(SIGTERM, then SIGKILL after a deadline: :mod:`devstack.procs`); nothing is ever killed
by name. A child that exits before it is ready raises :class:`StackError` with the last
lines of its log. The token secret (random per stack unless given) and the admin key
(``StackSpec.admin_key``, when given) reach the children in their environment
(``TOKENRELAY_SECRET``, ``TOKENRELAY_ADMIN_KEY``), never on a command line that ``ps``
shows. Relays and workers believe ``X-Forwarded-For`` from 127.0.0.1 (the demo's front
door); ``abuse_limits=False`` lifts the per-address and per-session limits for load
generators that are all one loopback address.

Order of use::

    async with Stack(StackSpec(relays=2, workers=2, engines=3)) as stack:
        stack.relay_urls, stack.worker_urls, stack.engine_urls, stack.redis_url
        stack.log_dir                    # the children's logs; stack.remove_logs() after
        stack.kill("relay-1")            # kill -9 one process (fault injection)
        await stack.restart("relay-1")   # start it again on the same port
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from devstack.cluster.launcher import ClusterInfo, LocalCluster
from devstack.procs import Proc, ProcError, file_exists, free_port, http_ok, stop_all

__all__ = ["Member", "Stack", "StackError", "StackSpec", "free_port"]


class StackError(RuntimeError):
    """A process of the stack did not start or did not become healthy."""


@dataclass
class StackSpec:
    relays: int = 2
    workers: int = 2
    engines: int = 3
    masters: int = 3
    replicas: int = 1
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    insecure_no_auth: bool = False
    # the operator's endpoints (/metrics, /v1/router) of relays and workers: "" leaves
    # them to local requests without a key (what the load tests scrape)
    admin_key: str = ""
    engine_urls: list[str] = field(default_factory=list)  # real engines instead of mocks
    model: str = "mock"
    engine_cap: int = 12  # 1.5 x the mock engines' 8 concurrent requests (docs/ROUTING.md)
    abuse_limits: bool = True  # False: no per-address / per-session limits (load tests)
    engine_args: list[str] = field(default_factory=list)
    relay_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    redis_url: str | None = None  # use an existing cluster instead of starting one
    log_dir: str | None = None
    amqp_url: str | None = None  # RabbitMQ: workers take /v1/jobs and a job worker runs them
    jobs_queue: str = "tokenrelay.demo.jobs"
    # the workers' and relays' OpenAI gateway keys, in their environment
    # (TOKENRELAY_GATEWAY_KEYS, never a command line): None leaves the variable as this
    # process has it, [] takes it away
    gateway_keys: list[str] | None = None


@dataclass
class Member:
    """One process of the stack: what to start, and the running :class:`Proc` (None
    before it starts)."""

    name: str
    kind: str  # "relay", "worker", "engine" or "jobworker"
    port: int
    argv: list[str]
    log_path: str
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive


def _lost_its_port(member: Member) -> bool:
    """True when ``member`` exited because its port was taken (the one line a process
    prints for that, see ``relay.service.runtime.listen_error``)."""
    assert member.proc is not None
    return member.proc.returncode == 2 and f"port {member.port} on " in member.proc.tail()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenrelay", *args]


def _devstack(*args: str) -> list[str]:
    """A development stack's command (the mock engine): ``python -m devstack``, found
    from this checkout (:func:`devstack.procs.child_env`)."""
    return [sys.executable, "-m", "devstack", *args]


class Stack:
    """Starts the processes of a :class:`StackSpec` and stops each of them by pid."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Member] = {}
        self.cluster: LocalCluster | None = None
        self.cluster_info: ClusterInfo | None = None
        self.redis_url = spec.redis_url or ""
        self._tmp = spec.log_dir or tempfile.mkdtemp(prefix="tokenrelay-stack-")
        self._own_logs = spec.log_dir is None  # a folder made here: remove_logs() may go
        atexit.register(self.kill_now)  # a caller that dies before stop() leaks nothing

    # -- views --------------------------------------------------------------------
    def _urls(self, kind: str) -> list[str]:
        return [p.url for p in self.procs.values() if p.kind == kind]

    @property
    def relay_urls(self) -> list[str]:
        return self._urls("relay")

    @property
    def worker_urls(self) -> list[str]:
        return self._urls("worker")

    @property
    def engine_urls(self) -> list[str]:
        return self.spec.engine_urls or self._urls("engine")

    @property
    def log_dir(self) -> str:
        """The folder of the children's logs (``<name>.log``)."""
        return self._tmp

    def remove_logs(self) -> None:
        """Remove the log folder once the stack has stopped, when this stack made it (a
        ``log_dir`` the caller gave is the caller's)."""
        if self._own_logs:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def of_kind(self, kind: str) -> list[Member]:
        return [p for p in self.procs.values() if p.kind == kind]

    # -- lifecycle ----------------------------------------------------------------
    async def __aenter__(self) -> Stack:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        spec = self.spec
        if not self.redis_url:
            self.cluster = LocalCluster(masters=spec.masters, replicas=spec.replicas)
            self.cluster_info = await self.cluster.start()
            self.redis_url = self.cluster_info.url
        auth = ["--insecure-no-auth"] if spec.insecure_no_auth else []
        auth += ["--trusted-proxy", "127.0.0.1"]  # the front door sets X-Forwarded-For
        relay_limits = worker_limits = []
        if not spec.abuse_limits:
            relay_limits = ["--max-streams-per-address", "0"]
            worker_limits = ["--session-rate", "0", "--turns-per-minute", "0",
                             "--max-sessions-per-address", "0"]  # fmt: skip
        if not spec.engine_urls:
            for i in range(spec.engines):
                name = f"engine-{i + 1}"
                port = free_port()
                argv = _devstack("engine", "--port", str(port), "--id", name, *spec.engine_args)
                self._add(name, "engine", port, argv)
        if spec.engine_urls:
            named = list(spec.engine_urls)
        else:
            named = [f"{p.name}={p.url}" for p in self.of_kind("engine")]
        engine_flags = [x for engine in named for x in ("--engine", engine)]
        for i in range(spec.relays):
            name = f"relay-{i + 1}"
            port = free_port()
            argv = _cli(
                "relay", "--port", str(port), "--redis", self.redis_url,
                "--relay-id", name, *auth, *relay_limits, *spec.relay_args,
            )  # fmt: skip
            self._add(name, "relay", port, argv)
        jobs = ["--amqp", spec.amqp_url, "--jobs-queue", spec.jobs_queue] if spec.amqp_url else []
        for i in range(spec.workers):
            name = f"worker-{i + 1}"
            port = free_port()
            argv = _cli(
                "worker", "--port", str(port), "--redis", self.redis_url,
                "--worker-id", name, "--model", spec.model,
                "--engine-cap", str(spec.engine_cap), *engine_flags, *auth, *worker_limits,
                *jobs, *spec.worker_args,
            )  # fmt: skip
            self._add(name, "worker", port, argv)
        if spec.amqp_url:  # runs the jobs, below a reserve of each engine's slots for chat
            argv = _cli(
                "jobworker", "--redis", self.redis_url, "--amqp", spec.amqp_url,
                "--queue", spec.jobs_queue, "--worker-id", "jobworker-1", "--model", spec.model,
                "--engine-cap", str(spec.engine_cap), "--chat-reserve", "4", *engine_flags,
                "--health-file", str(Path(self._tmp) / "jobworker-1.alive"),
            )  # fmt: skip
            self._add("jobworker-1", "jobworker", 0, argv)
        for proc in self.procs.values():
            self._spawn(proc)
        await asyncio.gather(*(self._wait_healthy(p) for p in self.procs.values()))

    def _add(self, name: str, kind: str, port: int, argv: list[str]) -> None:
        log = str(Path(self._tmp) / f"{name}.log")
        self.procs[name] = Member(name, kind, port, argv, log)

    def _spawn(self, member: Member) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TOKENRELAY_INSECURE_NO_AUTH", None)
        if self.spec.insecure_no_auth or member.kind == "engine":
            env.pop("TOKENRELAY_SECRET", None)  # a secret with --insecure-no-auth: exit 2
        else:
            env["TOKENRELAY_SECRET"] = self.spec.secret
        env.pop("TOKENRELAY_ADMIN_KEY", None)  # the spec's, or none: never a shell's
        if self.spec.admin_key and member.kind in ("relay", "worker"):
            env["TOKENRELAY_ADMIN_KEY"] = self.spec.admin_key
        # the relays take the same keys: they serve the Responses API's resumable stream
        if member.kind in ("worker", "relay") and self.spec.gateway_keys is not None:
            env.pop("TOKENRELAY_GATEWAY_KEYS", None)
            if self.spec.gateway_keys:
                env["TOKENRELAY_GATEWAY_KEYS"] = ",".join(self.spec.gateway_keys)
        member.proc = Proc.start(
            member.argv, log=member.log_path, name=member.name, env=env, append=True
        )

    async def _wait_healthy(self, member: Member, timeout_s: float = 60.0) -> None:
        assert member.proc is not None
        if member.kind == "jobworker":  # no HTTP: it touches its health file once consuming
            probe = file_exists(Path(self._tmp) / f"{member.name}.alive")
        else:
            probe = http_ok(member.url + ("/health" if member.kind == "engine" else "/readyz"))
        for attempt in range(3):
            try:
                await member.proc.ready(probe, timeout_s=timeout_s)
                return
            except ProcError as exc:
                # another program took the port between its pick and the child's listen
                # (tests run side by side): a new port, at most twice; else the error
                if attempt == 2 or member.port == 0 or not _lost_its_port(member):
                    raise StackError(str(exc)) from None
            old = str(member.port)
            member.port = free_port()
            member.argv = [str(member.port) if a == old else a for a in member.argv]
            self._spawn(member)
            probe = http_ok(member.url + ("/health" if member.kind == "engine" else "/readyz"))

    # -- fault injection ----------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default kill -9) to one process of the stack; returns its pid."""
        member = self.procs[name]
        if member.proc is None or not member.proc.alive:
            raise StackError(f"{name} is not running")
        member.proc.send(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.proc.popen.wait(timeout=30)
        return member.proc.pid

    async def restart(self, name: str) -> None:
        member = self.procs[name]
        if member.alive:
            self.kill(name)
        if member.kind == "jobworker":  # ready again once the new process touches it
            (Path(self._tmp) / f"{member.name}.alive").unlink(missing_ok=True)
        self._spawn(member)
        await self._wait_healthy(member)

    def kill_now(self) -> None:
        """Last resort at interpreter exit: SIGKILL every child still running, by pid."""
        for member in self.procs.values():
            if member.proc is not None:
                member.proc.kill()
        if self.cluster is not None:
            self.cluster.kill_now()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child (workers first, so turns end with a frame), then SIGKILL."""
        atexit.unregister(self.kill_now)
        order = {"worker": 0, "jobworker": 0, "relay": 1, "engine": 2}
        members = sorted(self.procs.values(), key=lambda m: order.get(m.kind, 3))
        await stop_all([m.proc for m in members if m.proc is not None], timeout_s)
        if self.cluster is not None:
            await self.cluster.stop()
            self.cluster = None
