"""Token coalescing: Redis operations per token against the delay it adds.

What it is for: choose the worker's default (N tokens, T ms) flush policy from numbers.
For each setting, ``streams`` concurrent turns stream from a mock engine (run as a child
process, so the CPU figure is the worker side only) decoding at ``rate`` tokens/s per
stream, through :class:`relay.producer.coalesce.TokenPump` into the real fenced publisher
(:class:`relay.broker.rediscluster.publisher.Generation`, one Lua round trip per flush) on a
local Redis
Cluster. Per setting it reports:

* ``ops_per_token`` — publish round trips per engine token (1.0 without coalescing);
* ``frames_per_token`` — frames written (backlog entries and SPUBLISH messages);
* ``delay_ms`` — per token, from its arrival at the worker to the end of the publish
  round trip that carried it (buffer wait + Redis latency): mean, p50, p99, max;
* ``cpu_us_per_token`` — this process's CPU time per token (engine client + pump +
  publish), a proxy for the worker's Redis overhead.

Call order: ``main()`` is the CLI, ``python -m bench.pubsub.coalesce [--json PATH] [--quick]
[--redis URL]``; :func:`run_setting` measures one policy.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio.cluster import RedisCluster

from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.producer.coalesce import Batch, CoalescePolicy, TokenPump
from relay.protocol.keys import new_session_id
from worker.engines.client import EngineClient

__all__ = ["SETTINGS", "add_arguments", "main", "run_from_args", "run_setting"]

SETTINGS: list[tuple[int, float]] = [
    (1, 0.0),
    (2, 0.025),
    (4, 0.025),
    (4, 0.05),
    (8, 0.05),
    (8, 0.1),
    (16, 0.1),
    (16, 0.2),
]


def _engine_argv(port: int, rate: float, concurrency: int, reply: int) -> list[str]:
    code = (
        "import asyncio; from devstack.mockengine.server import EngineConfig, run_engine; "
        "from devstack.mockengine.reply_length import ReplyLength; "
        f"asyncio.run(run_engine(EngineConfig(port={port}, decode_tok_per_s={rate}, "
        f"max_concurrency={concurrency}, "
        f"reply=ReplyLength(max_tokens={reply}, min_tokens={min(8, reply)}), "
        "prefill_tok_per_s=0.0, engine_id='bench')))"
    )
    return [sys.executable, "-c", code]


async def _one_stream(
    client: EngineClient,
    pub: Publisher,
    url: str,
    policy: CoalescePolicy,
    reply: int,
    delays: list[float],
) -> tuple[int, int, int]:
    gen = await pub.open_generation(new_session_id())
    pushed: list[float] = []
    frames = 0

    async def publish(b: Batch) -> None:
        nonlocal frames
        await gen.publish([Draft(kind="token", text=b.text)])
        frames += 1
        now = time.monotonic()
        start = pushed_at[0]
        delays.extend(now - pushed[i] for i in range(start, start + b.count))
        pushed_at[0] = start + b.count

    pushed_at = [0]
    pump = TokenPump(publish, policy)
    task = asyncio.create_task(pump.run())
    messages = [{"role": "user", "content": f"bench {new_session_id()}"}]
    async for d in client.stream_chat(url, "bench", messages, reply):
        if d.text:
            pushed.append(time.monotonic())
            pump.push(d.text)
    pump.close()
    await task
    await gen.done()
    return len(pushed), pump.published_batches, frames


async def run_setting(
    redis: RedisCluster,
    url: str,
    policy: CoalescePolicy,
    streams: int,
    reply: int,
) -> dict[str, Any]:
    """Run ``streams`` concurrent turns under ``policy``; return the figures."""
    pub = Publisher(redis, maxlen=1000, ttl_s=60)
    delays: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        client = EngineClient(http)
        cpu0, t0 = time.process_time(), time.monotonic()
        results = await asyncio.gather(
            *(_one_stream(client, pub, url, policy, reply, delays) for _ in range(streams))
        )
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    tokens = sum(r[0] for r in results)
    ops = sum(r[1] for r in results)
    frames = sum(r[2] for r in results)
    ms = sorted(d * 1000 for d in delays)
    return {
        "max_tokens": policy.max_tokens,
        "max_delay_ms": round(policy.max_delay_s * 1000, 1),
        "streams": streams,
        "tokens": tokens,
        "ops_per_token": round(ops / tokens, 3),
        "frames_per_token": round(frames / tokens, 3),
        "delay_ms": {
            "mean": round(statistics.fmean(ms), 2),
            "p50": round(ms[len(ms) // 2], 2),
            "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
            "max": round(ms[-1], 2),
        },
        "cpu_us_per_token": round(cpu / tokens * 1e6, 1),
        "wall_s": round(wall, 2),
    }


async def _main(args: Flags) -> dict[str, Any]:
    async with bench_stack("coalesce-") as st:
        url = await st.cluster(masters=3, replicas=0, url=args.redis)
        engine = await st.serve("mock engine", lambda port: _engine_argv(
            port, args.rate, args.streams, args.reply), "/health")  # fmt: skip
        redis = RedisCluster.from_url(url)
        st.on_exit(redis.aclose)
        await redis.initialize()
        rows = []
        for n, t in SETTINGS:
            policy = CoalescePolicy(max_tokens=n, max_delay_s=t)
            best: dict[str, Any] | None = None
            for _ in range(args.repeats):
                row = await run_setting(redis, engine.url, policy, args.streams, args.reply)
                if best is None or row["delay_ms"]["p99"] < best["delay_ms"]["p99"]:
                    best = row
            assert best is not None
            rows.append(best)
            d = best["delay_ms"]
            print(
                f"N={n:>2} T={t * 1000:>5.0f}ms  ops/token {best['ops_per_token']:.3f}  "
                f"delay mean {d['mean']:6.2f} p50 {d['p50']:6.2f} p99 {d['p99']:6.2f} ms  "
                f"cpu {best['cpu_us_per_token']:6.1f} us/token",
                flush=True,
            )
    return {
        "bench": "coalesce",
        "rate_tok_per_s": args.rate,
        "streams": args.streams,
        "reply_tokens_max": args.reply,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "settings": rows,
    }


@dataclass
class Flags(OnCluster):
    rate: float = flag(40.0, "decode tokens/s per stream", above=0)
    streams: int = flag(32, "streams at once", quick=8, least=1)
    reply: int = flag(128, "max reply tokens", quick=48, least=1)
    repeats: int = flag(2, "runs per setting (the best p99 kept)", quick=1, least=1)


def _run(f: Flags) -> Outcome:
    return Outcome(asyncio.run(_main(f)))


BENCH = Bench(Flags, _run, prog="python -m bench.pubsub.coalesce", description=__doc__,
              quick_help="fewer streams, shorter replies")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    sys.exit(main())
