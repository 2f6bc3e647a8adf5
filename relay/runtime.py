"""How every tokenrelay process runs: on uvloop where installed, stopped by signals.

Order of use, in a command's ``run(args)``::

    return runtime.run(serve(config))          # uvloop.run, else asyncio.run

and inside ``serve``::

    async with runtime.stop_on_signals() as stop:   # SIGTERM / SIGINT set the event
        ... start ...
        await stop.wait()
        ... drain ...
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

__all__ = ["exit_on_sigterm", "run", "stop_on_signals"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop (plain asyncio where uvloop is missing)."""
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
