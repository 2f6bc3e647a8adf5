"""Start a child process with its log in a file, wait until it is ready, stop it by pid.

The one process launcher of the development stack (Redis nodes, the demo stack), the
benchmarks and the tests. The product packages (``relay``, ``worker``) never import it.

Rules it keeps:

- the child's stdout and stderr go to a log file (or nowhere), never to a pipe: a pipe
  nobody drains fills up and blocks the child on a log write;
- readiness is a probe polled until it holds: :func:`http_ok` (an HTTP status),
  :func:`port_open` (a TCP port accepts), :func:`log_line` (a text in the log) or
  :func:`file_exists`; a child that exits first, or a probe that never holds, raises
  :class:`ProcError` naming the child, its exit code and the last lines of its log;
- a child is stopped by its pid only: SIGCONT (a paused child must be able to exit),
  SIGTERM, then SIGKILL after a grace period; nothing is ever killed by name;
- a child finds this checkout's packages (:func:`child_env`): ``devstack`` and ``bench``
  are not in the wheel, so ``python -m devstack engine`` or ``python -m bench.relay.publisher``
  started from any folder imports them from here.

Order of use::

    proc = Proc.start(argv, log=path, name="relay-1")   # or launched(...) below
    await proc.ready(http_ok(f"http://127.0.0.1:{port}/readyz"), timeout_s=30)
    ...                                                 # proc.pid, proc.alive, proc.tail()
    await proc.stop(grace_s=15)                         # or stop_all(procs); kill() at exit

    async with launched(argv, log=path, ready=port_open(port)) as proc:
        ...                                             # stopped on the way out
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import aiohttp

__all__ = [
    "HOST",
    "Probe",
    "Proc",
    "ProcError",
    "child_env",
    "file_exists",
    "free_port",
    "http_ok",
    "launched",
    "log_line",
    "port_open",
    "stop_all",
]

HOST = "127.0.0.1"
# The folder that holds devstack/ and bench/: the root of this checkout.
CHECKOUT = str(Path(__file__).resolve().parents[1])


class ProcError(RuntimeError):
    """A child exited early or did not become ready; the message says which and why."""


Probe = Callable[["Proc"], Awaitable[bool]]


# Ports handed out for listeners come from below the kernel's ephemeral range (32768 and
# up on Linux) and below the local clusters' node ports (20000-29000, buses 30000-39000):
# a port the kernel picks for bind(0) is one it may hand to the next outgoing connection
# (a client's socket to Redis) before the child that was given it listens there.
_LISTEN_PORTS = (10000, 20000)
_handed: set[int] = set()
_rng = random.Random(os.getpid() ^ time.time_ns())


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now, never one this process handed out before
    and never one the kernel gives outgoing connections (see ``_LISTEN_PORTS``)."""
    low, high = _LISTEN_PORTS
    for _ in range(500):
        port = _rng.randrange(low, high)
        if port in _handed:
            continue
        try:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
                s.bind((host, port))
        except OSError:
            continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # the range is full: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment when None) with this checkout last on
    ``PYTHONPATH``: a ``PYTHONPATH`` already set (another tree's, as a benchmark that
    compares two trees gives) keeps its precedence; the checkout is where ``devstack``
    and ``bench`` are found, since no install holds them."""
    out = dict(os.environ if env is None else env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if CHECKOUT not in paths:
        out["PYTHONPATH"] = os.pathsep.join([*paths, CHECKOUT])
    return out


class Proc:
    """One child process: its argv, its log file, and how to stop it by pid."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        argv: Sequence[str],
        log: Path | None,
        name: str,
        err_log: Path | None = None,
    ) -> None:
        self.popen = popen
        self.argv = list(argv)
        self.log = log
        self.name = name
        self.err_log = err_log

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        log: str | Path | None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        append: bool = False,
        new_session: bool = False,
        err_log: str | Path | None = None,
    ) -> Proc:
        """Start ``argv``; stdout and stderr to ``log`` (truncated unless ``append``;
        None: discarded), or stderr apart to ``err_log`` when given (a test that tells
        what a command printed from what it complained about). ``new_session``: the
        child does not get the terminal's Ctrl-C. The child's environment is ``env``
        (this process's when None) through :func:`child_env`."""
        path = Path(log) if log is not None else None
        err_path = Path(err_log) if err_log is not None else None
        out: int | object = subprocess.DEVNULL
        with contextlib.ExitStack() as files:
            if path is not None:
                out = files.enter_context(open(path, "ab" if append else "wb"))
            err = out
            if err_path is not None:
                err = files.enter_context(open(err_path, "ab" if append else "wb"))
            popen = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err,  # type: ignore[arg-type]
                env=child_env(env), cwd=cwd,
                start_new_session=new_session,
            )  # fmt: skip
        return cls(popen, argv, path, name or Path(argv[0]).name, err_path)

    # -- state ------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, None while it runs (polls, so it reaps a dead child)."""
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self, *, stderr: bool = False) -> str:
        """What the child wrote so far: its log, or its ``err_log`` with ``stderr``
        ("" without one)."""
        path = self.err_log if stderr else self.log
        if path is None:
            return ""
        try:
            return path.read_bytes().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20, *, stderr: bool = False) -> str:
        """The last ``lines`` lines of the log (of ``err_log`` with ``stderr``; "" without
        one)."""
        path = self.err_log if stderr else self.log
        if path is None:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def why(self) -> str:
        """Why the child is not running, for an error message."""
        code = self.popen.poll()
        state = "is still running" if code is None else f"exited with code {code}"
        where = ""
        for path, tail in ((self.log, self.tail()), (self.err_log, self.tail(stderr=True))):
            if tail:
                where += f"; last lines of {path}:\n{tail}"
        return f"{self.name} (pid {self.pid}) {state}{where}"

    def check(self) -> None:
        """Raise :class:`ProcError` if the child has exited."""
        if self.popen.poll() is not None:
            raise ProcError(self.why())

    # -- readiness --------------------------------------------------------------------
    async def ready(self, probe: Probe, *, timeout_s: float = 30.0, every_s: float = 0.1) -> None:
        """Poll ``probe`` until it holds; :class:`ProcError` if the child exits first or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if await probe(self):
                return
            if time.monotonic() > deadline:
                raise ProcError(f"{self.name} not ready after {timeout_s:g} s: {self.why()}")
            await asyncio.sleep(every_s)

    # -- signals and stopping, by pid -------------------------------------------------
    def send(self, sig: int) -> None:
        """Send ``sig`` to the child if it still runs (SIGSTOP / SIGCONT to pause it)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGCONT then SIGTERM, without waiting."""
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL and reap, now (fault injection, last resort at exit); the exit code."""
        self.send(signal.SIGKILL)
        return self.popen.wait()

    async def wait(self, timeout_s: float) -> int | None:
        """The exit code once the child has exited, None if it still runs after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (code := self.popen.poll()) is None and time.monotonic() < deadline:  # noqa: ASYNC110 (a child's exit sets no event)
            await asyncio.sleep(0.05)
        return code

    async def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, SIGKILL after ``grace_s``; the exit code. Never raises."""
        self.terminate()
        code = await self.wait(grace_s)
        return code if code is not None else self.kill()


async def stop_all(procs: Iterable[Proc], grace_s: float = 10.0) -> None:
    """SIGTERM every child (in the order given), one shared grace period, then SIGKILL
    the ones still running."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if await p.wait(max(0.0, deadline - time.monotonic())) is None:
            p.kill()


@contextlib.asynccontextmanager
async def launched(
    argv: Sequence[str],
    *,
    log: str | Path | None,
    ready: Probe | None = None,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    ready_s: float = 30.0,
    grace_s: float = 15.0,
) -> AsyncIterator[Proc]:
    """Start ``argv``, wait for ``ready``, yield the :class:`Proc`; stop it on the way out."""
    proc = Proc.start(argv, log=log, name=name, env=env)
    try:
        if ready is not None:
            await proc.ready(ready, timeout_s=ready_s)
        yield proc
    finally:
        await proc.stop(grace_s)


# -- probes -------------------------------------------------------------------------------


def http_ok(url: str, status: int = 200) -> Probe:
    """Ready when a GET of ``url`` answers ``status``."""

    async def probe(_: Proc) -> bool:
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=2)
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as r:
                return r.status == status
        return False

    return probe


def port_open(port: int, host: str = HOST) -> Probe:
    """Ready when a TCP connection to ``host:port`` is accepted."""

    async def probe(_proc: Proc) -> bool:
        try:
            async with asyncio.timeout(2):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    return probe


def log_line(text: str) -> Probe:
    """Ready when ``text`` appears in the child's log."""

    async def probe(proc: Proc) -> bool:
        if proc.log is None:
            raise ProcError(f"{proc.name}: log_line needs a log file")
        try:
            return text.encode() in proc.log.read_bytes()
        except OSError:
            return False

    return probe


def file_exists(path: str | Path) -> Probe:
    """Ready when ``path`` exists (a health file the child touches)."""

    async def probe(_: Proc) -> bool:
        return os.path.exists(path)  # noqa: ASYNC240 (one stat of a local file)

    return probe
