"""Start a server as its own process, wait until it answers, stop it by pid.

What it is for: benchmarks that put each participant (engine, worker, relay) in its own
process, so that their CPU is their own and the client's load does not slow them.

Order of use::

    async with serve_process(argv, "http://127.0.0.1:PORT/readyz", log_path) as proc:
        ...                      # proc.pid; the log file holds its stderr

On the way out the process gets SIGTERM (by pid), then SIGKILL after ``stop_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

__all__ = ["free_port", "serve_process"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_process(
    argv: Sequence[str], ready_url: str, log_path: Path, *, ready_s: float = 30.0,
    stop_s: float = 15.0,
) -> AsyncIterator[asyncio.subprocess.Process]:  # fmt: skip
    with open(log_path, "wb") as log_file:  # noqa: ASYNC230 (a local file, opened once)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + ready_s
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(ready_url) as r:
                        if r.status == 200:
                            break
                if proc.returncode is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{argv[3] if len(argv) > 3 else argv[0]} not ready: {tail}")
                await asyncio.sleep(0.1)
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), stop_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
