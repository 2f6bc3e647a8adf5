"""How every tokenrelay process runs: on uvloop where installed, stopped by signals.

Order of use, in a command's ``run(args)``::

    return runtime.run(serve(config))          # uvloop.run, else asyncio.run

and inside ``serve``::

    if (busy := runtime.cannot_listen(host, port)) is not None:   # before Redis: exit 2
        print(f"error: {busy}", file=sys.stderr)
        return 2
    async with runtime.stop_on_signals() as stop:   # SIGTERM / SIGINT set the event
        if not await runtime.set_up(runner, redis_url):  # one line, exit 1
            return 1
        try:
            await site.start()
        except OSError as exc:                      # taken since: the same line
            print(f"error: {runtime.listen_error(host, port, exc)}", file=sys.stderr)
            return 2
        await stop.wait()
        ... drain ...

:func:`run` also calls :func:`return_large_buffers` (glibc keeps the memory of large
freed buffers otherwise: a burst of 4 MiB responses left a relay hundreds of MiB larger
for good) and :func:`quiet_client_errors`: aiohttp logs every malformed
request (a bad request line, an oversized header) at ERROR with a full traceback, so
anyone who can open a socket could flood the logs with them. They are the client's
fault and are answered with a 4xx; they become one INFO line without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from relay.broker.errors import RelayError
from relay.broker.rediscluster.connect import startup_error
from relay.broker.rediscluster.errors import LIBRARY_ERRORS

__all__ = [
    "ClientErrorFilter",
    "cannot_listen",
    "exit_on_sigterm",
    "listen_error",
    "quiet_client_errors",
    "run",
    "set_up",
    "stop_on_signals",
]

T = TypeVar("T")


class ClientErrorFilter(logging.Filter):
    """Turns aiohttp's ERROR + traceback for a malformed request into one INFO line
    (dropped unless the logger is enabled for INFO); other records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        first = (exc.message or type(exc).__name__).strip().splitlines()[0][:200]
        record.msg = f"{record.getMessage()}: {exc.code} {type(exc).__name__}: {first}"
        record.args = None
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


_CLIENT_ERRORS = ClientErrorFilter()


def quiet_client_errors() -> None:
    """Install :class:`ClientErrorFilter` on aiohttp's server logger (idempotent)."""
    logger = logging.getLogger("aiohttp.server")
    if _CLIENT_ERRORS not in logger.filters:
        logger.addFilter(_CLIENT_ERRORS)


MMAP_THRESHOLD = 256 * 1024  # buffers this large or larger are returned to the system when freed


def return_large_buffers() -> bool:
    """Have glibc's malloc map every buffer of :data:`MMAP_THRESHOLD` bytes or more on its
    own and unmap it when freed. Its default threshold rises to the largest buffer freed
    (up to 32 MiB), after which such buffers come from the heap, and a heap fragmented by
    a burst of them is not given back: the relay's RSS stayed a GiB higher after slow
    readers of 4 MiB messages left. False where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    m_mmap_threshold = -3
    return bool(mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(MMAP_THRESHOLD)))


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop (plain asyncio where uvloop is missing)."""
    return_large_buffers()
    quiet_client_errors()
    try:
        import uvloop
    except ImportError:  # not on this platform: the default loop
        return asyncio.run(main)
    return uvloop.run(main)


@contextlib.asynccontextmanager
async def stop_on_signals(
    *signals: signal.Signals, event: asyncio.Event | None = None
) -> AsyncIterator[asyncio.Event]:
    """An event (``event`` if given) set by SIGTERM or SIGINT (or the given signals)
    while the block runs; the handlers are removed on the way out."""
    stop = event if event is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in signals or (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` for one-shot commands (benchmarks, load tests):
    their ``finally`` blocks and atexit hooks then stop the processes they started,
    where the default action would leave those children running."""

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


async def set_up(runner: web.AppRunner, redis_url: str) -> bool:
    """``runner.setup()`` (the app's start-up, which connects to Redis, TLS handshake
    included); False when Redis cannot be reached or refuses: then one line naming the
    URL (password masked) and the cause is printed to stderr and the runner cleaned up,
    and the command exits 1."""
    try:
        await runner.setup()
    except (*LIBRARY_ERRORS, RelayError, OSError) as exc:
        print(f"error: {startup_error(redis_url, exc)}", file=sys.stderr)
        await runner.cleanup()
        return False
    return True


def listen_error(host: str, port: int, exc: OSError) -> str:
    """The one line a process prints when it cannot listen on ``host:port`` (every
    subcommand that serves says the same for the same mistake)."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is in use by another program: stop it, or pick another "
            "port with --port N (0: any free port)"
        )
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def cannot_listen(host: str, port: int) -> str | None:
    """None when ``host:port`` can be listened on now (port 0 always can), else the line
    of :func:`listen_error`: a process checks its port before it connects to anything,
    so that a busy port is the one thing it says."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds
            s.bind((host, port))
    except OSError as exc:
        return listen_error(host, port, exc)
    return None
