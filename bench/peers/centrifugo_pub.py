"""Centrifugo's producer in :mod:`bench.peers.pathcost`, as a child process (its CPU is
its own): the tokens of a tick schedule (:func:`bench.peers.llmshape.ticks`, or today's
even pacing, :func:`bench.peers.llmshape.even_ticks`) through Centrifugo's server HTTP
API, one ``batch`` request per 10 ms tick holding one ``publish`` per token (the batching
its API allows; ``parallel``: the tick's publications are independent), requests in
flight on a keep-alive pool while the next tick is built. Each token's data is
``{"text": "<19-digit ns>;"}``, stamped when made.

``python -m bench.peers.centrifugo_pub SPEC.json``; spec: ``port``, ``key``, ``channels``,
``ticks``, ``tick_s``. Prints one JSON line: ``sent``, ``acked``, ``failed``, ``seconds``,
``cpu_s``, ``publish_cpu_s``, ``first_errors``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import self_cpu_s
from bench.peers.llmshape import session_of

__all__ = ["main", "publish"]


async def publish(
    port: int, key: str, channels: list[str], plan: list[list[int]], tick: float
) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/batch"
    headers = {"X-API-Key": key, "Content-Type": "application/json"}
    acked = failed = sent = 0
    errors: list[str] = []
    inflight: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:

        async def post(body: bytes, n: int) -> None:
            nonlocal acked, failed
            try:
                async with http.post(url, data=body, headers=headers) as resp:
                    got = await resp.json()
                    bad = [r["error"] for r in got.get("replies", []) if "error" in r]
                    failed += len(bad)
                    acked += n - len(bad)
                    errors.extend(str(b)[:80] for b in bad[:1])
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failed += n
                errors.append(repr(exc)[:80])

        cpu0 = self_cpu_s()
        t0 = time.perf_counter()
        for t, due in enumerate(plan):
            if due:
                cmds = [{"publish": {"channel": channels[session_of(e)],
                                     "data": {"text": f"{time.time_ns():019d};"}}}
                        for e in due]  # fmt: skip
                body = json.dumps({"commands": cmds, "parallel": True}).encode()
                task = asyncio.create_task(post(body, len(cmds)))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                sent += len(cmds)
            delay = t0 + (t + 1) * tick - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        took = time.perf_counter() - t0
        if inflight:
            await asyncio.wait(inflight, timeout=30)
    return {
        "sent": sent, "acked": acked, "failed": failed, "seconds": took, "cpu_s": self_cpu_s(),
        "publish_cpu_s": self_cpu_s() - cpu0, "first_errors": sorted(set(errors))[:5],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m bench.peers.centrifugo_pub SPEC.json")
    spec = json.loads(Path(args[0]).read_text())
    got = asyncio.run(publish(int(spec["port"]), spec["key"], spec["channels"], spec["ticks"],
                              float(spec.get("tick_s", 0.01))))  # fmt: skip
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
