"""Token streaming through a message queue vs Redis sharded Pub/Sub, side by side.

What it is for: the claim that a message queue is the wrong tool for token streaming
(a message per token, a queue per viewer connection, consumers that pull) measured on
real brokers on this machine: the project's SPUBLISH path on a local Redis Cluster, and
RabbitMQ (the broker the machine runs) in the two shapes a team would try.

Modes (one run measures all three with the same workload, one after the other):

- ``spublish``: K session channels ``tr:{<sid>}:live`` on a 3-master cluster, each
  SSUBSCRIBEd by one of ``--relays`` relay-like subscribers (one connection per shard);
- ``rabbitmq_queue_per_conn``: each viewer connection has its own exclusive auto-delete
  queue bound to its session on a direct exchange (see :mod:`bench.pubsub.amqp_load`);
- ``rabbitmq_topic``: one topic exchange, one queue per relay bound to its sessions.

Per mode: a paced phase (K sessions x R tokens/s, one viewer per session) gives the
token latency p50/p99 (publish timestamp in the payload to consumer arrival) and the
broker CPU per token (broker processes' CPU from /proc over the phase, less the same
broker's idle CPU measured just before, divided by tokens delivered); a saturation phase
(one publisher process as fast as it goes) gives ``max_tokens_per_s`` delivered. For
the queue-per-connection mode, ``queue_churn_per_s``: viewer connects and leaves per
second (declare, bind, consume, cancel, delete) the broker sustains.

Call order: ``python -m bench.pubsub.mq_vs_pubsub [--quick] [--sessions K] [--rate R]
[--json PATH] [--amqp URL]`` -> :func:`run_all` -> :func:`markdown`. Needs a RabbitMQ
broker (default ``amqp://guest:guest@127.0.0.1:5672/``); without one the RabbitMQ
modes are skipped with the reason. The Redis Cluster is started and stopped (by pid)
by the benchmark.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import platform
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from bench._util import ns_ms, percentile
from bench.harness import Bench, Common, Outcome, bench_stack, cell, flag
from bench.harness.report import logger
from bench.pubsub import amqp_load as amqp_io
from bench.pubsub.resp_load import PublishSpec, SubscriberSet, publish, run_publisher, warm_worker
from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.connect import mask_url
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import slot_of

__all__ = ["MODES", "Workload", "add_arguments", "main", "markdown", "run_all", "run_from_args"]

MODES = ("spublish", "rabbitmq_queue_per_conn", "rabbitmq_topic")
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
_TICKS = os.sysconf("SC_CLK_TCK")


log = logger("mq_vs_pubsub")


@dataclass
class Workload:
    sessions: int = 1000
    rate: float = 5.0  # tokens/s per session
    paced_s: float = 8.0
    max_s: float = 4.0
    relays: int = 2
    churn_s: float = 3.0
    churn_parallel: int = 8
    idle_s: float = 1.0  # the broker's idle CPU is measured this long before each phase


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (and their threads) so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


async def _drain(get: Callable[[], int], expected: int, timeout_s: float = 20.0) -> None:
    """Wait until ``expected`` arrived, or no progress for 1 s."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while get() < expected and time.monotonic() < deadline:
        now = get()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        await asyncio.sleep(0.02)


async def _idle_rate(pids: list[int], seconds: float) -> float:
    """CPU seconds per second the broker burns doing nothing (Erlang schedulers spin)."""
    c0, t0 = cpu_seconds(pids), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pids) - c0) / (time.monotonic() - t0)


async def _paced(
    pids: list[int],
    wl: Workload,
    publish_fn: Callable[[], Awaitable[int]],
    received: Callable[[], int],
    record: Callable[[bool], None],
) -> dict[str, Any]:
    idle = await _idle_rate(pids, wl.idle_s)
    c0, t0 = cpu_seconds(pids), time.monotonic()
    record(True)
    published = await publish_fn()
    await _drain(received, published)
    record(False)
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(pids) - c0
    got = received()
    net = max(0.0, cpu - idle * elapsed)
    return {
        "offered_tokens_per_s": wl.sessions * wl.rate,
        "published": published,
        "delivered": got,
        "delivered_ratio": round(got / max(1, published), 4),
        "broker_cpu_us_per_token": round(net / max(1, got) * 1e6, 2),
        "broker_cpu_us_per_token_raw": round(cpu / max(1, got) * 1e6, 2),
        "broker_idle_cpu_pct": round(idle * 100, 1),
    }


def _latency(ns: list[int]) -> dict[str, Any]:
    return {
        "latency_p50_ms": ns_ms(percentile(ns, 0.5)),
        "latency_p99_ms": ns_ms(percentile(ns, 0.99)),
        "samples": len(ns),
    }


async def run_spublish(wl: Workload, sids: list[str], pool: ProcessPoolExecutor) -> dict[str, Any]:
    relays = [SubscriberSet() for _ in range(wl.relays)]
    async with bench_stack("mq-vs-pubsub-") as st:
        await st.cluster(masters=3, replicas=0)
        assert st.cluster_info is not None
        info = st.cluster_info
        st.on_exit(*(s.close for s in relays))  # the subscribers, before the cluster
        masters = sorted(info.masters, key=lambda n: n.port)
        owner = await _owners(info)
        channels = [live_channel(s) for s in sids]
        targets: dict[tuple[str, int], list[str]] = {}
        for ch in channels:
            targets.setdefault(owner(slot_of(ch)), []).append(ch)
        # one connection per shard per relay, each relay with its share of the sessions
        for r, subs in enumerate(relays):
            plan: dict[tuple[str, int], list[str]] = {}
            for i, ch in enumerate(channels):
                if i % wl.relays == r:
                    plan.setdefault(owner(slot_of(ch)), []).append(ch)
            await subs.start(plan, "SSUBSCRIBE")
        pids = [n.pid for n in masters]
        tlist = [(h, p, chs) for (h, p), chs in targets.items()]

        def received() -> int:
            return sum(s.received for s in relays)

        def record(on: bool) -> None:
            for s in relays:
                s.record = on

        async def paced() -> int:
            spec = PublishSpec("SPUBLISH", tlist, wl.paced_s, rate=wl.sessions * wl.rate)
            return int((await publish(spec))["published"])

        out = await _paced(pids, wl, paced, received, record)
        out.update(_latency([x for s in relays for x in s.local_ns + s.bus_ns]))
        for s in relays:
            s.reset()
        spec = PublishSpec(
            "SPUBLISH", tlist, wl.max_s, pipeline=64, conns_per_node=1, start_at=time.time() + 0.3
        )
        top = await asyncio.get_running_loop().run_in_executor(pool, run_publisher, spec)
        await _drain(received, int(top["published"]))
        out.update(_saturation(top, received(), max(s.last_ns for s in relays)))
        out["shards"] = len(masters)
        return out


async def _owners(info: ClusterInfo) -> Callable[[int], tuple[str, int]]:
    from bench.pubsub.cluster import slot_map

    smap = await slot_map(info)

    def owner(slot: int) -> tuple[str, int]:
        shard = smap.shard(slot)
        if shard is None:
            raise RuntimeError(f"no shard serves slot {slot}")
        return (shard.master.host, shard.master.port)

    return owner


def _saturation(top: dict[str, float], got: int, last_ns: int) -> dict[str, Any]:
    span = last_ns / 1e9 - top["t_start"] if last_ns else 0.0
    return {
        "max_published_per_s": round(top["published"] / max(1e-9, top["t_end"] - top["t_start"])),
        "max_tokens_per_s": round(got / span) if span > 0 else 0,
        "max_delivered_ratio": round(got / max(1.0, top["published"]), 4),
    }


class _Viewers:
    """The consumer side of a RabbitMQ mode: one AMQP connection per relay; per viewer
    a channel and its own queue (``queue_per_conn``), or per relay one queue bound to
    its sessions (``topic``)."""

    def __init__(self) -> None:
        self.conns: list[amqp_io.Amqp] = []
        self.queues = 0

    async def start(self, url: str, mode: str, sids: list[str], relays: int) -> None:
        kind = "topic" if mode == "rabbitmq_topic" else "direct"
        exchange = amqp_io.TOPIC_EXCHANGE if kind == "topic" else amqp_io.DIRECT_EXCHANGE
        for r in range(relays):
            c = await amqp_io.Amqp.connect(url)
            self.conns.append(c)
            ch = await c.open_channel()
            await c.declare_exchange(ch, exchange, kind)
            mine = sids[r::relays]
            if kind == "topic":
                q = await c.declare_queue(ch)
                for s in mine:
                    await c.bind(ch, q, exchange, amqp_io.routing_key(s))
                await c.consume(ch, q)
                self.queues += 1
            else:
                for s in mine:
                    vch = await c.open_channel()
                    q = await c.declare_queue(vch)
                    await c.bind(vch, q, exchange, amqp_io.routing_key(s))
                    await c.consume(vch, q)
                    self.queues += 1
            c.start_counting()

    @property
    def received(self) -> int:
        return sum(c.received for c in self.conns)

    def record(self, on: bool) -> None:
        for c in self.conns:
            c.record = on

    async def close(self) -> None:
        for c in self.conns:
            await c.close()


async def _paced_amqp(url: str, exchange: str, sids: list[str], rate: float, secs: float) -> int:
    """``rate`` tokens/s round-robin over the sessions for ``secs``, paced in 1 ms steps."""
    c = await amqp_io.Amqp.connect(url)
    keys = [amqp_io.routing_key(s) for s in sids]
    total, sent = int(rate * secs), 0
    try:
        ch = await c.open_channel()
        t0 = time.monotonic()
        while sent < total:
            due = min(total, int((time.monotonic() - t0) * rate) + 1)
            while sent < due:
                c.publish(ch, exchange, keys[sent % len(keys)])
                sent += 1
            await c.drain()
            await asyncio.sleep(0.001)
    finally:
        await c.close()
    return sent


def run_amqp_max(
    url: str, exchange: str, sids: list[str], seconds: float, start_at: float
) -> dict[str, float]:
    """Process-pool entry point: publish as fast as the broker takes it (TCP
    backpressure: RabbitMQ's credit flow stops reading the socket) for ``seconds``."""

    async def go() -> dict[str, float]:
        c = await amqp_io.Amqp.connect(url)
        keys = [amqp_io.routing_key(s) for s in sids]
        sent = 0
        try:
            ch = await c.open_channel()
            delay = start_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t_start = time.time()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                c.writer.write(amqp_io.Amqp.batch(ch, exchange, keys, 256, sent))
                sent += 256
                await c.drain()
            t_end = time.time()
        finally:
            await c.close()
        return {"published": float(sent), "t_start": t_start, "t_end": t_end}

    return asyncio.run(asyncio.wait_for(go(), seconds + 30))


async def queue_churn(url: str, seconds: float, parallel: int) -> float:
    """Viewer connects and leaves per second with a queue per connection: declare an
    exclusive auto-delete queue, bind it, consume, cancel, delete; ``parallel``
    connections at once."""

    async def one(deadline: float) -> int:
        c = await amqp_io.Amqp.connect(url)
        n = 0
        try:
            ch = await c.open_channel()
            await c.declare_exchange(ch, amqp_io.DIRECT_EXCHANGE, "direct")
            while time.monotonic() < deadline:
                q = await c.declare_queue(ch)
                await c.bind(ch, q, amqp_io.DIRECT_EXCHANGE, f"s.churn{n}")
                tag = await c.consume(ch, q)
                await c.cancel(ch, tag)
                await c.delete_queue(ch, q)
                n += 1
        finally:
            await c.close()
        return n

    t0 = time.monotonic()
    counts = await asyncio.gather(*(one(t0 + seconds) for _ in range(parallel)))
    return sum(counts) / (time.monotonic() - t0)


async def _delete_exchanges(url: str) -> None:
    c = await amqp_io.Amqp.connect(url)
    try:
        ch = await c.open_channel()
        for name in (amqp_io.DIRECT_EXCHANGE, amqp_io.TOPIC_EXCHANGE):
            await c.delete_exchange(ch, name)
    finally:
        await c.close()


async def _reachable(url: str) -> str | None:
    try:
        c = await amqp_io.Amqp.connect(url, timeout_s=3.0)
    except (OSError, TimeoutError, amqp_io.AmqpError) as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    await c.close()
    return None


async def run_rabbit(
    mode: str, wl: Workload, sids: list[str], url: str, pid: int, pool: ProcessPoolExecutor
) -> dict[str, Any]:
    exchange = amqp_io.TOPIC_EXCHANGE if mode == "rabbitmq_topic" else amqp_io.DIRECT_EXCHANGE
    viewers = _Viewers()
    t_setup = time.monotonic()
    try:
        await viewers.start(url, mode, sids, wl.relays)
        setup_s = time.monotonic() - t_setup

        async def paced() -> int:
            return await _paced_amqp(url, exchange, sids, wl.sessions * wl.rate, wl.paced_s)

        out = await _paced([pid], wl, paced, lambda: viewers.received, viewers.record)
        out.update(_latency([x for c in viewers.conns for x in c.latencies_ns]))
        out["queues"] = viewers.queues
        out["setup_s"] = round(setup_s, 3)
        for c in viewers.conns:
            c.reset()
        top = await asyncio.get_running_loop().run_in_executor(
            pool, run_amqp_max, url, exchange, sids, wl.max_s, time.time() + 0.3
        )
        await _drain(lambda: viewers.received, int(top["published"]))
        last = max(c.last_ns for c in viewers.conns)
        out.update(_saturation(top, viewers.received, last))
    finally:
        await viewers.close()
    if mode == "rabbitmq_queue_per_conn":
        out["queue_churn_per_s"] = round(await queue_churn(url, wl.churn_s, wl.churn_parallel))
    return out


async def run_all(wl: Workload, url: str) -> dict[str, Any]:
    sids = [f"mq{i:05d}" for i in range(wl.sessions)]
    modes: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
    try:
        await asyncio.get_running_loop().run_in_executor(pool, warm_worker, 0.1)
        log(f"spublish: {wl.sessions} sessions x {wl.rate} tokens/s")
        modes["spublish"] = await run_spublish(wl, sids, pool)
        reason = await _reachable(url)
        pid = amqp_io.find_broker_pid(urlsplit(url).port)
        if reason is None and pid is None:
            reason = "the broker answers but its process is not on this machine (no CPU figures)"
        for mode in MODES[1:]:
            if reason is not None or pid is None:
                skipped[mode] = f"RabbitMQ not usable at {mask_url(url)}: {reason}"
                log(f"{mode}: skipped: {skipped[mode]}")
                continue
            log(f"{mode}: {wl.sessions} sessions x {wl.rate} tokens/s")
            await _delete_exchanges(url)
            try:
                modes[mode] = await run_rabbit(mode, wl, sids, url, pid, pool)
            finally:
                await _delete_exchanges(url)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {
        "benchmark": "mq_vs_pubsub",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "workload": asdict(wl),
        "modes": modes,
        "skipped": skipped,
        "note": "clients, publishers and brokers share this machine's cores; one publisher "
        "process per mode, raw protocol on both sides (RESP; AMQP 0-9-1 without confirms)",
    }


def markdown(result: dict[str, Any]) -> str:
    head = (
        "| mode | latency p50 ms | p99 ms | broker CPU µs/token | max tokens/s | "
        "delivered | queues | queue churn/s |\n|---|---|---|---|---|---|---|---|\n"
    )
    rows = ""
    for mode in MODES:
        r = result["modes"].get(mode)
        if r is None:
            rows += f"| {mode} | skipped: {result['skipped'].get(mode, '')} |||||||\n"
            continue
        rows += (
            f"| {mode} | {cell(r['latency_p50_ms'])} | {cell(r['latency_p99_ms'])} | "
            f"{cell(r['broker_cpu_us_per_token'])} | {cell(r['max_tokens_per_s'])} | "
            f"{r['delivered_ratio']:.2%} | {cell(r.get('queues', r.get('shards')))} | "
            f"{cell(r.get('queue_churn_per_s'))} |\n"
        )
    wl = result["workload"]
    return (
        head
        + rows
        + (
            f"\n{wl['sessions']} sessions x {wl['rate']:g} tokens/s, one viewer each, "
            f"{wl['relays']} relays; paced {wl['paced_s']:g} s, saturation {wl['max_s']:g} s. "
            f"Note: {result['note']}.\n"
        )
    )


@dataclass
class Flags(Common):
    sessions: int = flag(1000, "concurrent sessions K", quick=200, least=1)
    rate: float = flag(5.0, "tokens/s per session R", above=0)
    amqp: str = flag(DEFAULT_AMQP, "RabbitMQ URL")


def measure(f: Flags) -> Outcome:
    wl = Workload(sessions=200, paced_s=3.0, max_s=2.0, churn_s=1.5) if f.quick else Workload()
    wl.sessions, wl.rate = f.sessions, f.rate
    result = asyncio.run(run_all(wl, f.amqp))
    lost = [m for m, r in result["modes"].items() if r["delivered_ratio"] < 1.0]
    if lost:
        log(f"tokens lost at the paced rate in: {', '.join(lost)}")
    return Outcome(result, markdown(result), 1 if lost else 0)


BENCH = Bench(Flags, measure, prog="python -m bench.pubsub.mq_vs_pubsub",
              description="Token streaming: Redis sharded Pub/Sub vs RabbitMQ, side by side.",
              quick_help="200 sessions, short phases (< 60 s)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
