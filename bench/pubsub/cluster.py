"""PUBLISH vs SPUBLISH on Redis Cluster: cluster-bus and CPU cost against cluster size.

What it is for: show, on real local clusters, that classic PUBLISH is broadcast over
the cluster bus to every node (its cost grows with the cluster) while SPUBLISH reaches
only the owning shard (master + replicas), with the project's channel names
(``tr:{<sid>}:live``) and subscribers spread over the nodes.

For each cluster size (a fresh cluster per size, started by :mod:`devstack.cluster.launcher`,
stopped by pid after) and each mode (``publish``, ``spublish``), :func:`measure` runs
the same workload: C channels, one subscription per channel (SSUBSCRIBE: on a random
node of the shard that owns the channel, master or replica; SUBSCRIBE: on a random
node), then a fixed-rate phase (end-to-end latency from the timestamp in the payload)
and a maximum-rate phase (pipelined publishers in worker processes). Counters are read
on every node before and after each phase.

Call order: ``python -m bench.pubsub.cluster [--quick] [--masters 3,6,9] [--replicas 1]
[--json PATH] [--plot PATH] [--md PATH]`` -> :func:`main` -> :func:`run_all` (per size:
a cluster of the harness stack -> :func:`measure` x 2 -> stopped) -> :func:`markdown`,
:func:`plot`. Tests call :func:`measure` on an existing cluster.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._util import ns_ms, percentile
from bench.harness import Bench, Common, Outcome, bench_stack, cell, flag
from bench.harness.report import logger
from bench.pubsub.resp_load import (
    PAYLOAD_LEN,
    Counters,
    PublishSpec,
    SubscriberSet,
    command,
    links_created_since,
    publish,
    read_counters,
    redis_benchmark,
    run_publisher,
    warm_worker,
)
from devstack.cluster.launcher import ClusterInfo
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, SlotMap, parse_shards, parse_slots, slot_of

__all__ = [
    "MODES",
    "RUN_KEYS",
    "Workload",
    "add_arguments",
    "main",
    "markdown",
    "measure",
    "plot",
    "run_all",
    "run_from_args",
]

MODES = ("publish", "spublish")
RUN_KEYS = (
    "masters",
    "mode",
    "bus_sends_per_msg",
    "cpu_s_per_100k",
    "max_msgs_per_s",
    "delivered_msgs_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
)
# Subscribers may fall behind during the max-rate phase: a bounded, larger pubsub output
# buffer than the default (32mb hard) keeps them connected for a few seconds of backlog.
PUBSUB_BUFFER = "pubsub 256mb 0 0"
CLIENT_NOTE = (
    "client and servers share the same {cpus} CPU cores: the Python publishers and the "
    "subscriber reader compete with the Redis nodes, so max msg/s is a floor, not the "
    "server's ceiling"
)


log = logger("pubsub")


@dataclass
class Workload:
    channels: int = 64
    fixed_rate: float = 5000.0  # messages/s over all channels
    fixed_s: float = 2.0
    max_s: float = 2.0
    pipeline: int = 64
    conns_per_node: int = 2  # per publisher process, per master
    publisher_procs: int = 2  # 0: publish from this process (tests)
    seed: int = 1
    redis_benchmark: bool = False  # also cross-check the max rate with redis-benchmark
    repeats: int = 3  # max-rate phases per mode; the median rate is reported


def _verbs(mode: str) -> tuple[str, str]:
    return ("PUBLISH", "SUBSCRIBE") if mode == "publish" else ("SPUBLISH", "SSUBSCRIBE")


async def slot_map(info: ClusterInfo) -> SlotMap:
    node = info.masters[0]
    m = parse_shards(await command(node.host, node.port, "CLUSTER", "SHARDS"))
    if not m.complete():
        m = parse_slots(await command(node.host, node.port, "CLUSTER", "SLOTS"))
    return m


def _plan(
    channels: list[str], smap: SlotMap, nodes: list[Addr], mode: str, rng: random.Random
) -> tuple[dict[tuple[str, int], list[str]], list[tuple[str, int, list[str]]]]:
    """Subscriptions per node, and publish targets (each channel to its slot's master:
    the same routing for both modes, so only the command differs)."""
    subs: dict[tuple[str, int], list[str]] = {}
    pubs: dict[tuple[str, int], list[str]] = {}
    for ch in channels:
        shard = smap.shard(slot_of(ch))
        if shard is None:
            raise RuntimeError(f"no shard serves {ch}")
        where = (
            rng.choice(nodes) if mode == "publish" else rng.choice([shard.master, *shard.replicas])
        )
        subs.setdefault((where.host, where.port), []).append(ch)
        pubs.setdefault((shard.master.host, shard.master.port), []).append(ch)
    return subs, [(h, p, chs) for (h, p), chs in pubs.items()]


async def _run_publishers(specs: list[PublishSpec], pool: Executor | None) -> dict[str, float]:
    if pool is None:
        results = await asyncio.gather(*(publish(s) for s in specs))
    else:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(pool, run_publisher, s) for s in specs)
        )
    return {
        "published": sum(r["published"] for r in results),
        "t_start": min(r["t_start"] for r in results),
        "t_end": max(r["t_end"] for r in results),
    }


async def _drain(subs: SubscriberSet, expected: float, timeout_s: float = 15.0) -> None:
    """Wait until every published message arrived, or no progress for 1 s."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while subs.received < expected and time.monotonic() < deadline:
        if subs.received != last:
            last, since = subs.received, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        await asyncio.sleep(0.02)


def _deltas(before: list[Counters], after: list[Counters]) -> tuple[int, int, float]:
    pub = sum(a.publish_sent - b.publish_sent for a, b in zip(after, before, strict=True))
    shard = sum(
        a.publishshard_sent - b.publishshard_sent for a, b in zip(after, before, strict=True)
    )
    cpu = sum(a.cpu_s - b.cpu_s for a, b in zip(after, before, strict=True))
    return pub, shard, cpu


def _received(before: list[Counters], after: list[Counters], mode: str) -> int:
    if mode == "publish":
        return sum(
            a.publish_received - b.publish_received for a, b in zip(after, before, strict=True)
        )
    return sum(
        a.publishshard_received - b.publishshard_received
        for a, b in zip(after, before, strict=True)
    )


async def measure(
    info: ClusterInfo, mode: str, wl: Workload, pool: Executor | None = None
) -> dict[str, Any]:
    """One mode on one running cluster: fixed-rate phase then max-rate phase."""
    pub_verb, sub_verb = _verbs(mode)
    rng = random.Random(wl.seed)
    addrs = [(n.host, n.port) for n in info.nodes]
    smap = await slot_map(info)
    nodes = sorted(smap.nodes())
    channels = [live_channel(f"bench{i:05d}") for i in range(wl.channels)]
    sub_plan, targets = _plan(channels, smap, nodes, mode, rng)
    local = {(h, p): set(chs) for h, p, chs in targets}
    subs = SubscriberSet()
    await subs.start(sub_plan, sub_verb, local)
    run_start_ms = int(time.time() * 1000)
    try:
        # Fixed rate: latency. One paced publisher.
        c0 = await read_counters(addrs)
        subs.record = True
        fixed = await _run_publishers(
            [
                PublishSpec(
                    pub_verb, targets, wl.fixed_s, rate=wl.fixed_rate, start_at=time.time() + 0.1
                )
            ],
            pool,
        )
        await _drain(subs, fixed["published"])
        subs.record = False
        c1 = await read_counters(addrs)
        fixed_received, local_ns, bus_ns = subs.received, subs.local_ns, subs.bus_ns
        latencies = local_ns + bus_ns
        subs.reset()
        # Max rate, ``repeats`` times (median rate): throughput, bus sends, CPU.
        procs = max(1, wl.publisher_procs)
        rates: list[float] = []
        delivered: list[float] = []
        published = received = 0.0
        for _ in range(max(1, wl.repeats)):
            subs.reset()
            specs = [
                PublishSpec(pub_verb, targets, wl.max_s, pipeline=wl.pipeline,
                            conns_per_node=wl.conns_per_node, start_at=time.time() + 0.3)
                for _ in range(procs)
            ]  # fmt: skip
            top = await _run_publishers(specs, pool)
            await _drain(subs, top["published"])
            rates.append(top["published"] / max(1e-9, top["t_end"] - top["t_start"]))
            span = subs.last_ns / 1e9 - top["t_start"] if subs.last_ns else 0.0
            delivered.append(subs.received / span if span > 0 else 0.0)
            published += top["published"]
            received += subs.received
        c2 = await read_counters(addrs)
    finally:
        await subs.close()
    relinked = await links_created_since(addrs, run_start_ms)
    rb: dict[str, Any] = {}
    if wl.redis_benchmark:
        rb = await _cross_check(info, pub_verb, statistics.median(rates), wl)
    f_pub, f_shard, f_cpu = _deltas(c0, c1)
    m_pub, m_shard, m_cpu = _deltas(c1, c2)
    n_max = published or 1.0
    n_fixed = fixed["published"] or 1.0
    bus = m_pub if mode == "publish" else m_shard
    return {
        "masters": len(info.masters),
        "replicas": len(info.replicas),
        "nodes": len(info.nodes),
        "mode": mode,
        "channels": wl.channels,
        "subscriptions": wl.channels,
        "subscriber_connections": len(sub_plan),
        "bus_sends_per_msg": round(bus / n_max, 3),
        "bus_received_per_msg": round(_received(c1, c2, mode) / n_max, 3),
        "cpu_s_per_100k": round(m_cpu / n_max * 1e5, 3),
        "cpu_us_per_msg": round(m_cpu / n_max * 1e6, 2),
        "max_msgs_per_s": round(statistics.median(rates)),
        "max_msgs_per_s_samples": [round(r) for r in rates],
        "max_published": int(published),
        "delivered_msgs_per_s": round(statistics.median(delivered)),
        "delivered_ratio": round(received / n_max, 4),
        "latency_p50_ms": ns_ms(percentile(latencies, 0.50)),
        "latency_p99_ms": ns_ms(percentile(latencies, 0.99)),
        "latency_samples": len(latencies),
        # Subscribers on the node the message was published to vs. reached over the bus.
        "latency_local_p50_ms": ns_ms(percentile(local_ns, 0.50)),
        "latency_local_p99_ms": ns_ms(percentile(local_ns, 0.99)),
        "latency_bus_p50_ms": ns_ms(percentile(bus_ns, 0.50)),
        "latency_bus_p99_ms": ns_ms(percentile(bus_ns, 0.99)),
        "latency_bus_share": round(len(bus_ns) / max(1, len(latencies)), 3),
        "fixed_rate": wl.fixed_rate,
        "fixed_published": int(fixed["published"]),
        "fixed_delivered_ratio": round(fixed_received / n_fixed, 4),
        "fixed_bus_sends_per_msg": round((f_pub if mode == "publish" else f_shard) / n_fixed, 3),
        "fixed_cpu_s_per_100k": round(f_cpu / n_fixed * 1e5, 3),
        "publish_sent_delta": m_pub,
        "publishshard_sent_delta": m_shard,
        "subscriber_disconnects": subs.disconnects,
        "bus_links_recreated": relinked,
        "unsolicited_pushes": subs.unsolicited,
        "publisher_procs": procs if pool is not None else 0,
        "payload_bytes": PAYLOAD_LEN,
        **rb,
    }


async def _cross_check(info: ClusterInfo, verb: str, rate: float, wl: Workload) -> dict[str, Any]:
    """redis-benchmark (C, pipelined, no subscribers) for about as long as the max phase."""
    addrs = [(n.host, n.port) for n in info.nodes]
    requests = max(20_000, int(rate * wl.max_s))
    m = info.masters[0]
    before = await read_counters(addrs)
    rps = await redis_benchmark(m.host, m.port, verb, requests)
    after = await read_counters(addrs)
    if rps is None:
        return {"rb_msgs_per_s": None}
    pub, shard, cpu = _deltas(before, after)
    return {
        "rb_msgs_per_s": round(rps),
        "rb_bus_sends_per_msg": round((pub if verb == "PUBLISH" else shard) / requests, 3),
        "rb_cpu_s_per_100k": round(cpu / requests * 1e5, 3),
    }


async def _server_version(info: ClusterInfo) -> str:
    n = info.nodes[0]
    fields = dict(
        ln.split(":", 1)
        for ln in (await command(n.host, n.port, "INFO", "server")).decode().splitlines()
        if ":" in ln
    )
    return str(fields.get("valkey_version") or fields.get("redis_version", "?"))


def _summary(r: dict[str, Any]) -> str:
    return (
        f"  bus/msg {r['bus_sends_per_msg']}  cpu s/100k {r['cpu_s_per_100k']}  "
        f"max {r['max_msgs_per_s']}/s  delivered {r['delivered_msgs_per_s']}/s "
        f"({r['delivered_ratio']:.0%})  p50 {r['latency_p50_ms']} ms  p99 {r['latency_p99_ms']} ms"
    )


async def run_all(masters: list[int], replicas: int, wl: Workload) -> dict[str, Any]:
    """Every size x mode; one fresh cluster per size, stopped by pid after."""
    runs: list[dict[str, Any]] = []
    server = ""
    ctx = multiprocessing.get_context("spawn")
    procs = max(1, wl.publisher_procs)
    pool = ProcessPoolExecutor(max_workers=procs, mp_context=ctx)
    try:
        # Start every worker process now, not in the middle of a measured phase.
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(pool, warm_worker, 0.5) for _ in range(procs)))
        for m in masters:
            log(f"starting {m} masters x {replicas} replica(s)")
            async with bench_stack("pubsub-cluster-") as st:
                buffers = ["--client-output-buffer-limit", PUBSUB_BUFFER]
                await st.cluster(masters=m, replicas=replicas, extra_args=buffers)
                info = st.cluster_info
                assert info is not None
                server = server or f"{info.flavor} {await _server_version(info)}"
                for mode in MODES:
                    log(f"{m} masters / {len(info.nodes)} nodes: {mode}")
                    run = await asyncio.wait_for(measure(info, mode, wl, pool), 120)
                    log(_summary(run))
                    runs.append(run)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    cpus = os.cpu_count() or 1
    return {
        "benchmark": "pubsub_cluster",
        "server": server,
        "cpus": cpus,
        "python": platform.python_version(),
        "replicas_per_master": replicas,
        "workload": asdict(wl),
        "pubsub_output_buffer": PUBSUB_BUFFER,
        "note": CLIENT_NOTE.format(cpus=cpus),
        "runs": runs,
    }


def _fmt(v: Any) -> str:
    return cell(v, grouped=False)


def markdown(result: dict[str, Any]) -> str:
    head = (
        "| masters | nodes | mode | bus sends/msg | CPU s/100k msg | max msg/s | "
        "delivered msg/s | p50 ms | p99 ms | p50 local / via bus ms | "
        "redis-benchmark msg/s (no subs) |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = "".join(
        f"| {r['masters']} | {r['nodes']} | {r['mode'].upper()} | {_fmt(r['bus_sends_per_msg'])} | "
        f"{_fmt(r['cpu_s_per_100k'])} | {_fmt(r['max_msgs_per_s'])} | "
        f"{_fmt(r['delivered_msgs_per_s'])} | {_fmt(r['latency_p50_ms'])} | "
        f"{_fmt(r['latency_p99_ms'])} | {_fmt(r.get('latency_local_p50_ms'))} / "
        f"{_fmt(r.get('latency_bus_p50_ms'))} | {_fmt(r.get('rb_msgs_per_s'))} |\n"
        for r in result["runs"]
    )
    wl = result["workload"]
    rb = ""
    if any(r.get("rb_msgs_per_s") for r in result["runs"]):
        rb = "redis-benchmark: `--cluster -P 32 -c 16`, no subscribers. "
    foot = (
        f"\n{result['server']}, {result['replicas_per_master']} replica(s) per master, "
        f"{wl['channels']} channels `tr:{{<sid>}}:live` with one subscriber each, "
        f"{PAYLOAD_LEN}-byte payload; latency at {wl['fixed_rate']:.0f} msg/s; max rate: "
        f"{wl['publisher_procs']} publisher processes x {wl['conns_per_node']} connections "
        f'per master, pipeline {wl["pipeline"]}. "local": subscriber on the node the '
        f'message was published to; "via bus": it crossed the cluster bus. '
        f"{rb}Note: {result['note']}.\n"
    )
    return head + rows + foot


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in zip(MODES, ("o-", "s--"), strict=True):
        rs = [r for r in result["runs"] if r["mode"] == mode]
        xs = [r["masters"] for r in rs]
        axes[0].plot(xs, [r["bus_sends_per_msg"] for r in rs], style, label=mode.upper())
        axes[1].plot(xs, [r["cpu_s_per_100k"] for r in rs], style, label=mode.upper())
    axes[0].set_title("cluster-bus sends per published message")
    axes[1].set_title("Redis CPU seconds per 100k messages (all nodes)")
    for ax in axes:
        ax.set_xlabel(f"masters ({result['replicas_per_master']} replica(s) each)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r["masters"] for r in result["runs"]}))
    fig.suptitle(f"PUBLISH vs SPUBLISH, {result['server']}, {result['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Flags(Common):
    masters: str = flag("3,6,9", "comma-separated cluster sizes", quick="3,6")
    replicas: int = flag(1, "replicas per master", least=0)
    seed: int = flag(1, "the channels' names and the publishers' order")
    plot: str | None = flag(None, "write a PNG of cost against masters", metavar="PATH")
    md: str | None = flag(None, "write the Markdown table", metavar="PATH")
    redis_benchmark: str = flag("auto", "cross-check the max rate with redis-benchmark, no "
                                "subscribers (auto: when it is on PATH)",
                                choices=("auto", "on", "off"))  # fmt: skip


def measure_all(f: Flags) -> Outcome | int:
    wl = Workload(fixed_s=1.0, max_s=1.5, repeats=1) if f.quick else Workload()
    wl.seed = f.seed
    sizes = [int(x) for x in f.masters.split(",") if x.strip()]
    if f.redis_benchmark == "on" and shutil.which("redis-benchmark") is None:
        log("redis-benchmark is not on PATH")
        return 2
    wl.redis_benchmark = f.redis_benchmark == "on" or (
        f.redis_benchmark == "auto" and shutil.which("redis-benchmark") is not None
    )
    t0 = time.monotonic()
    result = asyncio.run(run_all(sizes, f.replicas, wl))
    log(f"done in {time.monotonic() - t0:.0f} s")
    table = markdown(result)
    if f.md:
        Path(f.md).write_text(table, encoding="utf-8")
    if f.plot:
        plot(result, f.plot)
    return Outcome(result, table)


BENCH = Bench(Flags, measure_all, prog="python -m bench.pubsub.cluster",
              description="PUBLISH vs SPUBLISH cost on local Redis Clusters of growing size.",
              quick_help="3 and 6 masters, short phases (< 60 s)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
