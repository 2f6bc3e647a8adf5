"""A write's JSON-mode body turned into its messages off the relay's event loop.

Parsing and re-encoding JSON is CPU work in C that holds the interpreter's lock: a
4 MiB body of tiny elements takes a few hundred milliseconds, during which no other
stream, chat or health check of the relay is served (a thread would not help, the lock
is held throughout). So a JSON body over :data:`ON_LOOP_BYTES` is parsed by
:func:`relay.durable.core.body_messages` in a process of its own (one per relay,
started on the first such body, stopped with the app); a smaller one, a few
milliseconds at most, on the loop. At most :data:`MAX_PENDING` bodies wait for that
process at once: more get 503 with ``Retry-After`` (each waiting body is held in
memory). A body the process refuses is refused the same way as on the loop (the
:class:`relay.durable.core.BadRequest` crosses the process boundary).

Order of use::

    parser = Parser()                       # app cleanup: parser.close()
    messages = await parser.messages(body, json_mode, allow_empty_array=True)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Final

from relay.durable import core
from relay.durable.auth import Refused

__all__ = ["MAX_PENDING", "ON_LOOP_BYTES", "Parser"]

log = logging.getLogger(__name__)
ON_LOOP_BYTES: Final = 4096  # parsed on the loop: ~2,000 elements, a few ms at worst
MAX_PENDING: Final = 4
_RETRY: Final = {"Retry-After": "1"}


class Parser:
    """See the module docstring."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self.pending = 0
        self.off_loop = 0  # bodies parsed in the process (a figure for tests and metrics)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")  # never fork a running event loop
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
        return self._pool

    async def messages(
        self, body: bytes, json_mode: bool, *, allow_empty_array: bool
    ) -> list[bytes]:
        """:func:`relay.durable.core.body_messages` of ``body``; raises its
        BadRequest / TooLarge, or :class:`relay.durable.auth.Refused` (503) when the
        parsing process is busy or failed."""
        if not json_mode or len(body) <= ON_LOOP_BYTES:
            return core.body_messages(body, json_mode, allow_empty_array=allow_empty_array)
        if self.pending >= MAX_PENDING:
            raise Refused(503, "too many large JSON writes are being parsed on this relay: "
                          "try again", _RETRY)  # fmt: skip
        self.pending += 1
        try:
            call = functools.partial(
                core.body_messages, body, True, allow_empty_array=allow_empty_array
            )
            out: list[bytes] = await asyncio.get_running_loop().run_in_executor(
                self._executor(), call
            )
            self.off_loop += 1
            return out
        except BrokenProcessPool as exc:  # the process died (killed, out of memory)
            log.warning("durable: the JSON parsing process failed: %s", exc)
            self.close()  # the next body starts another
            raise Refused(503, "could not parse the body: try again", _RETRY) from None
        finally:
            self.pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
