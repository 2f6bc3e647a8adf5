"""Run the whole stack as child processes: Redis Cluster, engines, relays, workers.

Used by ``tokenrelay demo``, ``bench.loadtest`` and ``bench.faults``. Every process is
a child started here and stopped here, by pid (SIGTERM, then SIGKILL after a
deadline); nothing is ever killed by name. The token secret (random per stack unless
given) reaches the children in their environment (``TOKENRELAY_SECRET``), never on a
command line that ``ps`` shows. Relays and workers believe ``X-Forwarded-For`` from
127.0.0.1 (the demo's front door); ``abuse_limits=False`` lifts the per-address and
per-session limits for load generators that are all one loopback address.

Order of use::

    async with Stack(StackSpec(relays=2, workers=2, engines=3)) as stack:
        stack.relay_urls, stack.worker_urls, stack.engine_urls, stack.redis_url
        stack.kill("relay-1")            # kill -9 one process (fault injection)
        await stack.restart("relay-1")   # start it again on the same port
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import aiohttp

from devstack.cluster.launcher import ClusterInfo, LocalCluster

__all__ = ["Proc", "Stack", "StackError", "StackSpec", "free_port"]


class StackError(RuntimeError):
    """A process of the stack did not start or did not become healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class StackSpec:
    relays: int = 2
    workers: int = 2
    engines: int = 3
    masters: int = 3
    replicas: int = 1
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    insecure_no_auth: bool = False
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


@dataclass
class Proc:
    name: str
    kind: str  # "relay", "worker", "engine" or "jobworker"
    port: int
    argv: list[str]
    log_path: str
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenrelay", *args]


class Stack:
    """Starts the processes of a :class:`StackSpec` and stops each of them by pid."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Proc] = {}
        self.cluster: LocalCluster | None = None
        self.cluster_info: ClusterInfo | None = None
        self.redis_url = spec.redis_url or ""
        self._tmp = spec.log_dir or tempfile.mkdtemp(prefix="tokenrelay-stack-")
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

    def of_kind(self, kind: str) -> list[Proc]:
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
            worker_limits = ["--session-rate", "0", "--turns-per-minute", "0"]
        if not spec.engine_urls:
            for i in range(spec.engines):
                name = f"engine-{i + 1}"
                port = free_port()
                argv = _cli("engine", "--port", str(port), "--id", name, *spec.engine_args)
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
        self.procs[name] = Proc(name, kind, port, argv, log)

    def _spawn(self, proc: Proc) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TOKENRELAY_INSECURE_NO_AUTH", None)
        if self.spec.insecure_no_auth or proc.kind == "engine":
            env.pop("TOKENRELAY_SECRET", None)  # a secret with --insecure-no-auth: exit 2
        else:
            env["TOKENRELAY_SECRET"] = self.spec.secret
        with open(proc.log_path, "ab") as log:
            proc.popen = subprocess.Popen(
                proc.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )

    async def _wait_healthy(self, proc: Proc, timeout_s: float = 60.0) -> None:
        if proc.kind == "jobworker":  # no HTTP: it touches its health file once consuming
            await self._wait_file(proc, Path(self._tmp) / f"{proc.name}.alive", timeout_s)
            return
        path = "/health" if proc.kind == "engine" else "/readyz"
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if not proc.alive:
                    raise StackError(f"{proc.name} exited: {self.log_tail(proc.name)}")
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with http.get(
                        proc.url + path, timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise StackError(f"{proc.name} not ready after {timeout_s:.0f}s")
                await asyncio.sleep(0.1)

    async def _wait_file(self, proc: Proc, path: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if not proc.alive:
                raise StackError(f"{proc.name} exited: {self.log_tail(proc.name)}")
            if time.monotonic() > deadline:
                raise StackError(f"{proc.name} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return Path(self.procs[name].log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- fault injection ----------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default kill -9) to one process of the stack; returns its pid."""
        proc = self.procs[name]
        if proc.popen is None or proc.popen.poll() is not None:
            raise StackError(f"{name} is not running")
        proc.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=30)
        return proc.popen.pid

    async def restart(self, name: str) -> None:
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        if proc.kind == "jobworker":  # ready again once the new process touches it
            (Path(self._tmp) / f"{proc.name}.alive").unlink(missing_ok=True)
        self._spawn(proc)
        await self._wait_healthy(proc)

    def kill_now(self) -> None:
        """Last resort at interpreter exit: SIGKILL every child still running, by pid."""
        for proc in self.procs.values():
            if proc.popen is not None and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.kill()
                proc.popen.wait()
        if self.cluster is not None:
            self.cluster.kill_now()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child (workers first, so turns end with a frame), then SIGKILL."""
        atexit.unregister(self.kill_now)
        order = {"worker": 0, "jobworker": 0, "relay": 1, "engine": 2}
        procs = sorted(self.procs.values(), key=lambda p: order.get(p.kind, 3))
        for proc in procs:
            if proc.alive and proc.popen is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            if proc.popen is None:
                continue
            while proc.popen.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.kill()
                proc.popen.wait()
        if self.cluster is not None:
            await self.cluster.stop()
            self.cluster = None
