"""``tokenrelay relay`` with a monitor of its event loop's own work, for
:mod:`bench.hostile.durable`.

The relay's ``tokenrelay_relay_loop_lag_seconds`` says how late a 10 ms timer fired,
which on a loaded machine is mostly the time the process waited for a CPU. This monitor
runs a timer of its own on the relay's loop and, between two of its ticks, reads the
main thread's CPU time (``time.thread_time``) as well as the clock: the CPU time is the
work the loop did in between (its callbacks and the collector), which a busy machine
does not inflate. Each gap of more than :data:`NOTE_S` is appended as a JSON line
(``{"t": unix time, "wall_ms", "cpu_ms"}``) to the file ``$LAGGED_RELAY_OUT`` names.

Order of use: ``python -m bench.hostile.lagged_relay relay --port ...`` (the relay's own
flags) with ``LAGGED_RELAY_OUT=path``; read the lines whose ``t`` falls in a phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Coroutine
from typing import Any, Final, TextIO

__all__ = ["NOTE_S", "main"]

NOTE_S: Final = 0.02
TICK_S: Final = 0.01


async def _monitor(out: TextIO) -> None:
    wall, cpu = time.monotonic(), time.thread_time()
    while True:
        await asyncio.sleep(TICK_S)
        now_wall, now_cpu = time.monotonic(), time.thread_time()
        gap = now_wall - wall - TICK_S
        if gap > NOTE_S:  # a line of a few dozen bytes: the write does not wait
            line = {"t": time.time(), "wall_ms": round(gap * 1000, 1),
                    "cpu_ms": round((now_cpu - cpu) * 1000, 1)}  # fmt: skip
            out.write(json.dumps(line) + "\n")
        wall, cpu = now_wall, now_cpu


def main() -> int:
    from relay.service import runtime  # patched before the relay's command imports it

    path = os.environ["LAGGED_RELAY_OUT"]
    run = runtime.run

    def monitored(serve: Coroutine[Any, Any, int]) -> int:
        async def both(out: TextIO) -> int:
            task = asyncio.create_task(_monitor(out))
            try:
                return await serve
            finally:
                task.cancel()

        with open(path, "a", buffering=1) as out:
            return run(both(out))

    runtime.run = monitored  # type: ignore[assignment]
    from tokenrelay.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
