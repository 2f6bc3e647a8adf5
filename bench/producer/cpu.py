"""Producer CPU per token: the Python API, the Node package and the worker's publisher
layer, side by side in one run, at the worker's coalescing defaults and without
coalescing.

What it answers: what a producer of your own costs per token in each language, against
the layer the worker's turns are written with. Each producer is its own process
(:mod:`bench.producer.cpu_child` for ``python`` and ``publisher``,
``bench/producer/cpu_node.mjs`` for ``node``): ``streams`` turns at once, each
``tokens`` deltas paced at ``rate`` per second (as an engine decodes), on a local Redis
Cluster. Per setting and producer:

* ``cpu_us_per_token`` — the producer process's CPU (its own ``getrusage`` /
  ``process.cpuUsage``, over the turns: first start to last ``done``) per delta; the
  median of ``repeats`` runs, the producers interleaved within each repeat;
* ``redis_cpu_us_per_token`` — every Redis node's CPU (``INFO cpu``) over the child's
  whole run (connect included) per delta;
* ``frames_per_token`` — frames written (the sessions' last offsets) per delta;
* ``ratios`` — each producer's CPU per token over the publisher layer's, and Node's
  over Python's.

``python`` and ``node`` do what a library producer does (turn lock, fenced generation,
``meta`` frame, coalescing, a guard task refreshing the lock every second, ``done``
with the reply's sha256, lock release); ``publisher`` is the
:class:`~relay.broker.rediscluster.publisher.Generation` and
:class:`~relay.producer.coalesce.TokenPump` under them (no lock, no watch, no hash).
The pacing loop (a timer per delta) is in every figure alike.

Run: ``python -m bench.producer.cpu [--quick] [--json PATH] [--redis URL]``; node >= 18
with clients/producer's packages (``npm ci`` there), else the ``node`` rows are
skipped with the reason.
"""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import run_json
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.relay.harness import redis_cpu_s, slotmap
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.keys import meta_key
from relay.protocol.slotmap import Addr, SlotMap, slot_of

__all__ = ["IMPLS", "SETTINGS", "add_arguments", "main", "run_from_args"]

ROOT = Path(__file__).resolve().parents[2]
NODE_CHILD = ROOT / "bench" / "producer" / "cpu_node.mjs"
PACKAGE = ROOT / "clients" / "producer"
IMPLS = ("publisher", "python", "node")
# (name, max deltas per frame, max delay ms): the worker's defaults, and none
SETTINGS = (("coalesce 8/50ms", 8, 50.0), ("no coalescing", 1, 0.0))


def node_missing() -> str | None:
    """Why the Node producer cannot run here, or None."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (PACKAGE / "node_modules" / "ioredis" / "package.json").exists():
        return "clients/producer's packages are not installed (npm ci there)"
    return None


async def _frames(smap: SlotMap, prefix: str, streams: int) -> int:
    total = 0
    for i in range(streams):
        k = meta_key(f"{prefix}-{i}")
        node = smap.node_for(slot_of(k))
        assert node is not None
        raw = await raw_command(node, "HGET", k, "offset")
        total += int(raw or 0)
    return total


async def run_one(url: str, smap: SlotMap, impl: str, n: int, t_ms: float,
                  args: Flags) -> dict[str, Any]:  # fmt: skip
    prefix = f"bcpu-{impl}-{secrets.token_hex(4)}"
    spec = {"url": url, "impl": impl, "streams": args.streams, "tokens": args.tokens,
            "rate": args.rate, "max_tokens": n, "max_delay_ms": t_ms, "prefix": prefix}  # fmt: skip
    if impl == "node":
        argv = [shutil.which("node") or "node", str(NODE_CHILD)]
    else:
        argv = [sys.executable, "-m", "bench.producer.cpu_child"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r0 = await redis_cpu_s(smap)
    out = await run_json(argv, spec, name=f"producer-{impl}", timeout_s=600, env=env)
    red = await redis_cpu_s(smap) - r0
    tokens = args.streams * args.tokens
    frames = await _frames(smap, prefix, args.streams)
    return {
        "cpu_us_per_token": out["cpu_s"] * 1e6 / tokens,
        "redis_cpu_us_per_token": red * 1e6 / tokens,
        "frames_per_token": frames / tokens,
        "wall_s": out["wall_s"],
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("cpu_us_per_token", "redis_cpu_us_per_token", "frames_per_token", "wall_s")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys} | {
        "cpu_us_per_token_runs": [round(r["cpu_us_per_token"], 2) for r in runs]
    }


async def _main(args: Flags) -> dict[str, Any]:
    skipped = node_missing()
    impls = [i for i in IMPLS if i != "node" or skipped is None]
    async with bench_stack("producer-cpu-") as st:
        url = await st.cluster(masters=3, replicas=0, url=args.redis)
        host, port = url.split("://", 1)[1].split(",")[0].rsplit(":", 1)
        smap = await slotmap(Addr(host, int(port)))
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for name, n, t_ms in SETTINGS:
                for impl in impls:
                    r = await run_one(url, smap, impl, n, t_ms, args)
                    runs.setdefault((name, impl), []).append(r)
                    print(f"{name:<16} {impl:<10} {r['cpu_us_per_token']:8.1f} us/token "
                          f"(redis {r['redis_cpu_us_per_token']:6.1f}) frames/token "
                          f"{r['frames_per_token']:.3f}", flush=True)  # fmt: skip
    settings: list[dict[str, Any]] = []
    for name, n, t_ms in SETTINGS:
        rows = {impl: _summary(runs[(name, impl)]) for impl in impls}
        base = rows["publisher"]["cpu_us_per_token"]
        ratios = {f"{impl}/publisher": round(rows[impl]["cpu_us_per_token"] / base, 2)
                  for impl in impls if impl != "publisher"}  # fmt: skip
        if "node" in rows:
            ratios["node/python"] = round(
                rows["node"]["cpu_us_per_token"] / rows["python"]["cpu_us_per_token"], 2
            )
        settings.append({"setting": name, "max_tokens": n, "max_delay_ms": t_ms,
                         "producers": rows, "ratios": ratios})  # fmt: skip
    return {
        "bench": "producer_cpu",
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rate_tok_per_s": args.rate,
        "repeats": args.repeats,
        "node_skipped": skipped,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "settings": settings,
    }


def report(result: dict[str, Any]) -> str:
    """The markdown table of a result (bench/README.md's, from its JSON)."""
    lines = [
        "| setting | producer | CPU µs/token | Redis CPU µs/token | frames/token | × publisher |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in result["settings"]:
        for impl, row in s["producers"].items():
            ratio = s["ratios"].get(f"{impl}/publisher", 1.0)
            lines.append(f"| {s['setting']} | {impl} | {row['cpu_us_per_token']:.1f} | "
                         f"{row['redis_cpu_us_per_token']:.1f} | {row['frames_per_token']:.3f} "
                         f"| {ratio:.2f} |")  # fmt: skip
    ratios = ", ".join(f"{s['setting']}: {s['ratios'].get('node/python', '-')}"
                       for s in result["settings"])  # fmt: skip
    lines.append("")
    lines.append(f"Node / Python CPU per token: {ratios}.")
    return "\n".join(lines)


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "unused: the workload is fixed")
    streams: int = flag(32, "turns at once per producer", quick=8, least=1)
    tokens: int = flag(300, "deltas per turn", quick=40, least=1)
    rate: float = flag(50.0, "deltas/s per turn", quick=100.0, above=0)
    repeats: int = flag(3, "runs of each setting (the median kept)", quick=1, least=1)


def _run(f: Flags) -> Outcome:
    out = asyncio.run(_main(f))
    return Outcome(out, report(out))


BENCH = Bench(Flags, _run, prog="python -m bench.producer.cpu", description=__doc__,
              quick_help="fewer streams and tokens, one repeat", markdown=report)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    sys.exit(main())
