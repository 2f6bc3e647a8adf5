"""One producer process of :mod:`bench.producer.cpu`, in Python: ``streams`` turns at
once, each writing ``tokens`` deltas paced at ``rate`` per second, through either

* ``python`` — the producer API (:mod:`relay.producer`: turn lock, fenced generation,
  meta frame, coalescing pump, the guard task, ``done`` with its hash), or
* ``publisher`` — the worker's publisher layer under it
  (:class:`relay.broker.rediscluster.publisher.Generation` with the coalescing
  :class:`relay.producer.coalesce.TokenPump`: no lock, no watch, no hash).

Its own CPU (``getrusage``) over the turns, from the first turn's start to the last
turn's end, is its answer (one line of JSON). Run: ``python -m bench.producer.cpu_child
SPEC.json``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from typing import Any

from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.producer import CoalescePolicy, Producer
from relay.producer.coalesce import Batch, TokenPump

__all__ = ["main"]


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _paced(write: Any, tokens: int, rate: float) -> None:
    """``write(text)`` ``tokens`` times, on a schedule of ``rate`` per second."""
    t0 = time.monotonic()
    for k in range(tokens):
        write(f"tok{k} ")
        delay = t0 + (k + 1) / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def _api(spec: dict[str, Any], policy: CoalescePolicy) -> tuple[float, float, int]:
    p = await Producer.connect(spec["url"], producer_id="bench-py", coalesce=policy)
    try:
        sessions = [p.session(f"{spec['prefix']}-{i}") for i in range(spec["streams"])]

        async def one(i: int) -> None:
            turn = await sessions[i].start_turn("bench")
            await _paced(turn.write, spec["tokens"], spec["rate"])
            await turn.done()

        c0, t0 = _cpu(), time.monotonic()
        await asyncio.gather(*(one(i) for i in range(spec["streams"])))
        return _cpu() - c0, time.monotonic() - t0, 0
    finally:
        await p.aclose()


async def _publisher(spec: dict[str, Any], policy: CoalescePolicy) -> tuple[float, float, int]:
    redis = RedisCluster.from_url(spec["url"])
    await redis.initialize()
    pub = Publisher(redis)
    batches = 0
    try:

        async def one(i: int) -> None:
            nonlocal batches
            gen = await pub.open_generation(f"{spec['prefix']}-{i}")
            await gen.meta({"role": "user", "message": "bench"})

            async def flush(b: Batch) -> None:
                nonlocal batches
                batches += 1
                meta = {"n": b.count} if b.count > 1 else None
                await gen.publish([Draft(kind="token", text=b.text, meta=meta)])

            pump = TokenPump(flush, policy)
            task = asyncio.create_task(pump.run())
            await _paced(pump.push, spec["tokens"], spec["rate"])
            pump.close()
            await task
            await gen.done({"tokens": spec["tokens"], "finish_reason": "stop"})

        c0, t0 = _cpu(), time.monotonic()
        await asyncio.gather(*(one(i) for i in range(spec["streams"])))
        return _cpu() - c0, time.monotonic() - t0, batches
    finally:
        await redis.aclose()


async def _main(spec: dict[str, Any]) -> dict[str, Any]:
    delay = spec["max_delay_ms"] / 1000
    policy = CoalescePolicy(max_tokens=spec["max_tokens"], max_delay_s=delay)
    run = _api if spec["impl"] == "python" else _publisher
    cpu, wall, batches = await run(spec, policy)
    return {"cpu_s": cpu, "wall_s": wall, "batches": batches}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        spec = json.load(f)
    print(json.dumps(asyncio.run(_main(spec))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
