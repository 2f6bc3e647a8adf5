"""Our per-node sharded subscriber vs redis-py's asyncio ``ClusterPubSub``.

What it measures: N SPUBLISHed messages over K shard channels spread on the 3 shards of a
local Redis Cluster, received by one subscriber in this process:

- ``flood``: a publisher in a *separate process* (so it does not share our event loop)
  pipelines SPUBLISH as fast as it can; we report messages received per second (first to
  last receive), how many arrived, and the publisher's own rate (to see which side is the
  limit);
- ``paced``: the publisher sends at a fixed rate; we report publish -> receive latency
  (p50/p99/max; the payload starts with the send time in ns, same host clock).
  ``received`` counts what arrived before a deadline (5 s + N/20k s after the
  publishers finished): a slow contender shows fewer, which is lag, not loss.
  Everything (6 servers, publishers, subscriber) shares this machine's cores: the
  flood figure is a lower bound of a reader's ceiling when it equals the publish rate.

Contenders: ``relay`` = :class:`relay.broker.rediscluster.subscriber.ShardedSubscriber` (one
connection and one blocking reader task per node, hiredis); ``redispy-t0`` = ``ClusterPubSub.
get_sharded_message(timeout=0)`` polled in a loop (yielding when idle);
``redispy-t10ms`` = the same with ``timeout=0.01`` (the per-node wait the docs suggest).

Call order: ``main()`` parses ``[--quick] [--json PATH] [--url redis://...]``; without
``--url`` it starts a 3-master/3-replica cluster with
:func:`devstack.cluster.launcher.local_cluster`
and stops it at the end. ``python -m bench.relay.subscriber_compare --quick``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hiredis
from redis.asyncio.cluster import RedisCluster

from bench._util import percentile, run_json
from bench.harness import Bench, Common, Outcome, bench_stack, flag
from relay.broker.rediscluster.nodeconn import pack_command, raw_command
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, parse_shards, slot_of

NAN = float("nan")

__all__ = ["add_arguments", "main", "run", "run_from_args"]

PAYLOAD = 100


# -- publisher (runs in a child process) ---------------------------------------------------


async def _publish(addr: Addr, channels: list[str], n: int, rate: float) -> None:
    reply = await raw_command(addr, "CLUSTER", "SHARDS")
    smap = parse_shards(reply)
    by_node: dict[Addr, list[str]] = {}
    for c in channels:
        node = smap.node_for(slot_of(c))
        assert node is not None
        by_node.setdefault(node, []).append(c)
    conns = {}
    for node in by_node:
        r, w = await asyncio.open_connection(node.host, node.port)
        conns[node] = (r, w, hiredis.Reader())
    pad = b"x" * (PAYLOAD - 19)
    batch = 200 if rate <= 0 else max(1, int(rate / 200))
    interval = 0 if rate <= 0 else batch / rate
    sent = 0
    t0 = time.perf_counter()
    order = [(node, c) for node, cs in by_node.items() for c in cs]
    i = 0
    while sent < n:
        k = min(batch, n - sent)
        bufs: dict[Addr, list[bytes]] = {node: [] for node in conns}
        for _ in range(k):
            node, c = order[i % len(order)]
            i += 1
            bufs[node].append(pack_command("SPUBLISH", c, b"%019d" % time.time_ns() + pad))
        for node, cmds in bufs.items():
            if cmds:
                conns[node][1].write(b"".join(cmds))
        for node, cmds in bufs.items():
            r, _, parser = conns[node]
            left = len(cmds)
            while left:
                while left and parser.gets() is not False:
                    left -= 1
                if left:
                    parser.feed(await r.read(1 << 16))
        sent += k
        if interval:
            delay = t0 + sent / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
    elapsed = time.perf_counter() - t0
    for _, w, _ in conns.values():
        w.close()
    print(json.dumps({"sent": sent, "publish_rate": sent / elapsed}), flush=True)


# -- subscribers ---------------------------------------------------------------------------


class _Recorder:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.lat_ns: list[int] = []
        self.done = asyncio.Event()

    def __call__(self, msgs: list[list[bytes]]) -> None:
        for _, _channel, data in msgs:
            self.one(data)

    def one(self, data: bytes) -> None:
        now = time.time_ns()
        self.lat_ns.append(now - int(data[:19]))
        t = time.perf_counter()
        if self.count == 0:
            self.first = t
        self.last = t
        self.count += 1
        if self.count >= self.expected:
            self.done.set()


@contextlib.asynccontextmanager
async def _relay_sub(
    redis: RedisCluster, channels: list[str], rec: _Recorder
) -> AsyncIterator[None]:
    sub = ShardedSubscriber(redis, on_message=rec, on_resubscribed=lambda _: None, relay_id="bench")
    await sub.start()
    await sub.subscribe(channels)
    try:
        yield
    finally:
        await sub.close()


def _redispy_sub(timeout_s: float) -> Callable[..., Any]:
    @contextlib.asynccontextmanager
    async def ctx(redis: RedisCluster, channels: list[str], rec: _Recorder) -> AsyncIterator[None]:
        ps = redis.pubsub()
        for c in channels:
            await ps.ssubscribe(c)
        # drain the subscribe confirmations
        while await ps.get_sharded_message(timeout=0.05) is not None:
            pass

        async def loop() -> None:
            while True:
                msg = await ps.get_sharded_message(
                    ignore_subscribe_messages=True, timeout=timeout_s
                )
                if msg is None:
                    if timeout_s == 0:
                        await asyncio.sleep(0)
                    continue
                if msg["type"] in (b"smessage", "smessage"):
                    rec.one(msg["data"])

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await ps.aclose()

    return ctx


CONTENDERS: dict[str, Callable[..., Any]] = {
    "relay": _relay_sub,
    "redispy-t0": _redispy_sub(0.0),
    "redispy-t10ms": _redispy_sub(0.01),
}


async def _one(
    redis: RedisCluster,
    seed: Addr,
    name: str,
    channels: list[str],
    n: int,
    rate: float,
    publishers: int,
) -> dict[str, Any]:
    rec = _Recorder(n)
    async with CONTENDERS[name](redis, channels, rec):
        argv = [sys.executable, "-m", "bench.relay.subscriber_compare", "--_publish"]
        outs = await asyncio.gather(*(
            run_json(
                argv,
                [seed.host, seed.port, channels[i::publishers], n // publishers, rate / publishers],
                name=f"publisher {i}", timeout_s=600,
            )
            for i in range(publishers)
        ))  # fmt: skip
        pub = {
            "sent": sum(o["sent"] for o in outs),
            "publish_rate": sum(o["publish_rate"] for o in outs),
        }
        rec.expected = pub["sent"]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5 + n / 20_000):
                await rec.done.wait()
    lat = sorted(rec.lat_ns)
    span = rec.last - rec.first

    def pct(p: float) -> float:
        return percentile(lat, p, NAN) / 1e3

    return {
        "contender": name,
        "mode": "flood" if rate <= 0 else f"paced {int(rate)}/s",
        "sent": pub["sent"],
        "received": rec.count,
        "recv_msgs_per_s": round(rec.count / span) if span > 0 else 0,
        "publish_msgs_per_s": round(pub["publish_rate"]),
        "lat_p50_us": round(pct(0.50), 1),
        "lat_p99_us": round(pct(0.99), 1),
        "lat_max_us": round(lat[-1] / 1e3, 1) if lat else float("nan"),
        "lat_mean_us": round(statistics.fmean(lat) / 1e3, 1) if lat else float("nan"),
    }


async def run(url: str | None, *, quick: bool, publishers: int = 1) -> dict[str, Any]:
    n = 20_000 if quick else 200_000
    k = 60 if quick else 300
    rate = 5_000.0
    paced_n = 5_000 if quick else 25_000
    async with bench_stack("subscriber-compare-") as st:
        hp = (await st.cluster(masters=3, replicas=1, url=url)).split("//", 1)[-1]
        host, port = hp.rsplit(":", 1)[0], int(hp.rsplit(":", 1)[1])
        redis = RedisCluster(host=host, port=int(port))
        st.on_exit(redis.aclose)
        await redis.initialize()
        channels = [live_channel(f"bench-{i}") for i in range(k)]
        shards = {str(redis.get_node_from_key(c)) for c in channels}
        results = []
        for name in CONTENDERS:
            for mode_rate, count in ((0.0, n), (rate, paced_n)):
                pubs = publishers if mode_rate <= 0 else 1
                res = await _one(
                    redis, Addr(host, int(port)), name, channels, count, mode_rate, pubs
                )
                print(json.dumps(res), flush=True)
                results.append(res)
        return {
            "messages": n,
            "channels": k,
            "shards": len(shards),
            "payload_bytes": PAYLOAD,
            "flood_publishers": publishers,
            "results": results,
        }


@dataclass
class Flags(Common):
    url: str | None = flag(None, "use this cluster instead of starting one")
    publishers: int = flag(1, "publisher processes (flood)", least=1)
    publish: str | None = flag(None, "a publisher child's spec", name="--_publish", hidden=True)


def _run(f: Flags) -> Outcome:
    if f.publish:
        host, port, channels, n, rate = json.loads(Path(f.publish).read_text())
        asyncio.run(_publish(Addr(host, port), channels, n, rate))
        return Outcome({})
    report = asyncio.run(run(f.url, quick=f.quick, publishers=f.publishers))
    lines = [
        f"\n{report['messages']} msgs, {report['channels']} channels, {report['shards']} shards",
        f"{'contender':15} {'mode':13} {'recv/sent':>13} {'recv msg/s':>11} {'pub msg/s':>10}"
        f" {'p50 us':>9} {'p99 us':>9} {'max us':>9}",
    ]
    lines += [
        f"{r['contender']:15} {r['mode']:13} {r['received']:>6}/{r['sent']:<6} "
        f"{r['recv_msgs_per_s']:>11} {r['publish_msgs_per_s']:>10} {r['lat_p50_us']:>9} "
        f"{r['lat_p99_us']:>9} {r['lat_max_us']:>9}"
        for r in report["results"]
    ]
    return Outcome(report, "\n".join(lines))


BENCH = Bench(
    Flags,
    _run,
    uvloop=True,
    prog="python -m bench.relay.subscriber_compare",
    description=__doc__,
    quick_help="20k messages over 60 channels",
)
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
