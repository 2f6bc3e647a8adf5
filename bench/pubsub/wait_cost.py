"""What waiting for a replica would cost a publish, and what the failover skip costs.

A frame is SPUBLISHed in the script that appends it, before any replica has it; a master
that dies then can lose frames screens hold. The product closes that by a skip (the next
writer after a failover jumps the offsets the lost writes may have used, with a ``gap``
frame: ``relay/broker/rediscluster/lua/failover.lua``), which costs one ``INFO
replication`` in each ``OPEN`` (once a turn) and nothing a frame. The other way is to
wait: ``WAIT 1 <timeout>`` after each publish call, on the same connection, so that a
frame is on a replica before the next batch (it would still be SPUBLISHed before: only
a script that does not publish, then a WAIT, then a publish would keep it from screens).

On a local 3 + 3 Redis Cluster, one writer, one session, call after call as a turn
writes (batches of ``--batch`` frames): the latency of each call (p50, p99, ms) and the
calls a second, for

- ``publish``: the product's publish script (EVALSHA) alone;
- ``publish+wait``: the same call and ``WAIT 1 <timeout>`` in one round trip;
- ``publish+wait, no replica``: the same with the session's replica killed: every WAIT
  runs out its timeout (a shard whose replica is down or rejoining);
- ``open``: the product's OPEN script on a new session (a turn's start, its INFO
  included; through the cluster client).

Call order: ``python -m bench.pubsub.wait_cost [--quick] [--json PATH]`` -> :func:`run`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from bench._util import percentile
from bench.harness import Bench, Common, Outcome, flag
from devstack.cluster.launcher import HOST, LocalCluster
from relay.broker.port import Draft, encode_drafts
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.broker.rediscluster.scripts import OPEN, PUBLISH
from relay.protocol.frame import now_ms
from relay.protocol.keys import live_channel, log_key, meta_key, new_session_id
from relay.protocol.slotmap import slot_of

__all__ = ["Config", "run"]


@dataclass
class Config:
    calls: int = 2000  # publish calls per variant
    batch: int = 4  # frames per call
    timeout_ms: int = 100  # WAIT's timeout
    opens: int = 500

    @classmethod
    def quick(cls) -> Config:
        return cls(calls=300, opens=100)


def _stats(lat_s: list[float], took_s: float) -> dict[str, float]:
    ms = [x * 1000 for x in lat_s]
    return {
        "calls": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(percentile(ms, 0.99, float("nan")), 3),
        "calls_per_s": round(len(ms) / took_s, 1),
    }


async def _publishes(
    conn: aioredis.Redis, g: Generation, cfg: Config, wait: bool
) -> dict[str, Any]:
    """``cfg.calls`` publish calls of ``cfg.batch`` frames, each alone or with its WAIT
    in one round trip; the latencies, and how many WAITs a replica acknowledged."""
    lat: list[float] = []
    acked = 0
    start = time.perf_counter()
    for _ in range(cfg.calls):
        drafts = [Draft(kind="token", text="x" * 8) for _ in range(cfg.batch)]
        payload = encode_drafts(drafts, session=g.session, turn=g.turn, epoch=g.epoch,
                                gen=g.gen, base=g.offset, ts=now_ms())  # fmt: skip
        keys, args = g.script_call(g.offset, payload)
        t = time.perf_counter()
        async with conn.pipeline(transaction=False) as p:
            p.execute_command("EVALSHA", PUBLISH.sha, len(keys), *keys, *args)
            if wait:
                p.execute_command("WAIT", 1, cfg.timeout_ms)
            out = await p.execute()
        lat.append(time.perf_counter() - t)
        g.offset = int(out[0])
        acked += int(out[1]) if wait else 0
    return {**_stats(lat, time.perf_counter() - start), "acked": acked}


async def run(cfg: Config) -> dict[str, Any]:
    local = LocalCluster(masters=3, replicas=1)
    await local.start()
    redis = RedisCluster(host=HOST, port=local.info.nodes[0].port if local.info else 0)
    try:
        shards = await local.shards_now()
        masters = await local.masters_now()
        sid = new_session_id()
        master = next(p for p, ss in masters.items() if slot_of(live_channel(sid)) in ss)
        pub = Publisher(redis)
        g = await pub.open_generation(sid)
        conn = aioredis.Redis(host=HOST, port=master)
        await conn.execute_command("SCRIPT", "LOAD", PUBLISH.source)
        out: dict[str, Any] = {"config": vars(cfg), "cpus": os.cpu_count()}
        out["loadavg_start"] = os.getloadavg()
        await _publishes(conn, g, Config(calls=50, batch=cfg.batch), False)  # warm
        out["publish"] = await _publishes(conn, g, cfg, False)
        out["publish+wait"] = await _publishes(conn, g, cfg, True)
        lat: list[float] = []
        start = time.perf_counter()
        for _ in range(cfg.opens):
            s = new_session_id()
            keys = (meta_key(s), log_key(s), live_channel(s))
            t = time.perf_counter()
            await OPEN(redis, keys, (3600, "x", s, now_ms(), 10000, 0))
            lat.append(time.perf_counter() - t)
        out["open"] = _stats(lat, time.perf_counter() - start)
        g = await pub.open_generation(sid)
        local.kill_node(shards[master][0])
        await local.process(shards[master][0]).wait(5)
        short = Config(calls=max(20, cfg.calls // 20), batch=cfg.batch, timeout_ms=cfg.timeout_ms)
        out["publish+wait, no replica"] = await _publishes(conn, g, short, True)
        out["loadavg_end"] = os.getloadavg()
        await conn.aclose()
        return out
    finally:
        await redis.aclose()
        await local.stop()


VARIANTS = ("publish", "publish+wait", "publish+wait, no replica", "open")


def table(r: dict[str, Any]) -> str:
    rows = ["| call | calls | p50 ms | p99 ms | calls/s | WAITs acknowledged |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for v in VARIANTS:
        s = r[v]
        acked = s.get("acked", "") if "wait" in v else ""
        rows.append(f"| {v} | {s['calls']} | {s['p50_ms']} | {s['p99_ms']} "
                    f"| {s['calls_per_s']} | {acked} |")  # fmt: skip
    return "\n".join(rows)


@dataclass
class Flags(Common):
    calls: int = flag(Config.calls, "publish calls per variant", quick=Config.quick().calls,
                      least=10)  # fmt: skip
    batch: int = flag(Config.batch, "frames per publish call", least=1)
    timeout_ms: int = flag(Config.timeout_ms, "WAIT's timeout (ms)", least=1)


def _run(f: Flags) -> Outcome:
    cfg = Config(calls=f.calls, batch=f.batch, timeout_ms=f.timeout_ms,
                 opens=Config.quick().opens if f.quick else Config.opens)  # fmt: skip
    r = asyncio.run(run(cfg))
    load = f"load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}"
    return Outcome(r, f"{table(r)}\n{load} on {r['cpus']} CPUs (a shared machine)")


BENCH = Bench(Flags, _run, prog="python -m bench.pubsub.wait_cost",
              description=__doc__.split("\n\n")[0], markdown=table,
              quick_help="300 calls a variant")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
