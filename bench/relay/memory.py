"""Where an idle SSE or WebSocket connection's memory goes, inside a relay process.

``python -m bench.relay.memory [--transport sse|ws] [--n 2000] [--json PATH]`` runs the
relay (:func:`relay.edge.cli.serve`, the code ``tokenrelay relay`` runs, on uvloop) in
this process with :mod:`tracemalloc` on, opens one warm-up connection and then ``n``
idle ones (each on its own session, as the ``idle`` phases of
:mod:`bench.relay.throughput`) from a client child process, and diffs what the relay
holds before and after the ``n`` connections, divided by ``n``:

- ``rss_kb_per_conn``: VmRSS (inflated by tracemalloc's own bookkeeping: the figure to
  compare with the targets is :mod:`bench.relay.throughput`'s, without tracemalloc);
- ``traced_bytes_per_conn``: what the Python allocators hold more (tracemalloc);
- ``by_line``: the allocation sites that grew most (file:line, bytes and blocks per
  connection);
- ``by_file``: the same summed per source file (aiohttp, asyncio, ours...);
- ``by_type``: live objects per connection by type (``gc.get_objects``), with the size
  of each object itself (``sys.getsizeof``, not what it refers to).

Clients: :class:`bench.relay.sse_clients.StampCounter` (SSE) or
:func:`bench.relay.phases.ws_open` (WebSocket) in ``python -m bench.relay.memory
--_clients SPEC``, which prints ``ready`` once every connection saw the relay's hello
and holds them until stopped by pid (:mod:`devstack.procs`). A cluster is started
here unless ``--redis``. Loopback only.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import free_port, raise_nofile, rss_kb
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.relay.harness import SECRET, sessions, slotmap
from devstack.procs import Proc, http_ok, log_line
from relay.edge.cli import serve
from relay.edge.config import RelayConfig
from relay.protocol.slotmap import Addr

__all__ = ["add_arguments", "main", "measure", "run_from_args"]


async def _clients(spec: dict[str, Any]) -> None:
    """Child: open the connections, say ``ready``, hold them until stopped."""
    from bench.relay.phases import ws_open
    from bench.relay.sse_clients import Tally, open_clients

    raise_nofile(len(spec["sids"]) + 100)
    port, sids = int(spec["port"]), list(spec["sids"])
    held: list[Any] = []
    if spec["transport"] == "ws":
        sem = asyncio.Semaphore(200)
        pongs: set[asyncio.Task[None]] = set()  # a slow opening outlives the heartbeat

        async def one(sid: str) -> asyncio.StreamWriter:
            async with sem:
                return await ws_open(port, sid, SECRET, pongs)

        held = list(await asyncio.gather(*(one(s) for s in sids)))
    else:
        held = await open_clients(port, sids, Tally(), 200)
    print(f"ready {len(held)}", flush=True)
    await asyncio.Event().wait()


async def _open_clients(port: int, transport: str, sids: list[str], log: Path) -> Proc:
    spec = log.with_suffix(".json")
    spec.write_text(json.dumps({"port": port, "transport": transport, "sids": sids}))
    argv = [sys.executable, "-m", "bench.relay.memory", "--_clients", str(spec)]
    proc = Proc.start(argv, log=log, name=f"{len(sids)} {transport} clients")
    await proc.ready(log_line("ready"), timeout_s=120)
    return proc


async def _connections(port: int) -> int:
    """Open streams by the relay's own count (its ``/metrics``)."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        text = await r.text()
    return int(
        sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln.startswith("tokenrelay_relay_connections{")
        )
    )


def _settle() -> None:
    gc.collect()
    gc.collect()


def _type_counts() -> tuple[Counter[str], Counter[str]]:
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for o in gc.get_objects():
        t = type(o)
        name = f"{t.__module__}.{t.__qualname__}"
        count[name] += 1
        size[name] += sys.getsizeof(o)
    return count, size


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/lib/python3", "/relay/", "/bench/"):
        i = filename.find(marker)
        if i >= 0:
            tail = filename[i + len(marker) :]
            if marker == "/lib/python3":
                tail = tail.split("/", 1)[-1]
            return ("relay/" if marker == "/relay/" else "") + tail
    return filename


async def measure(url: str, transport: str, n: int, top: int = 25) -> dict[str, Any]:
    """Run the relay here, ``n`` idle connections from a child; the per-connection diff."""
    host, port_s = url.split("//", 1)[1].rsplit(":", 1)
    smap = await slotmap(Addr(host, int(port_s)))
    sids = sessions(n + 1, smap, None)
    port = free_port()
    cfg = RelayConfig(
        port=port, redis_url=url, secret=SECRET, relay_id="bench-memory", reap_after_s=0,
        max_connections=n + 100, max_streams_per_address=0, max_streams_per_token=0,
    )  # fmt: skip
    stop = asyncio.Event()
    relay = asyncio.create_task(serve(cfg, stop))
    procs: list[Proc] = []
    try:
        probe = http_ok(f"http://127.0.0.1:{port}/readyz")
        async with asyncio.timeout(30):
            while not await probe(None):  # type: ignore[arg-type]
                if relay.done():
                    raise RuntimeError(f"the relay stopped: {relay.result()}")
                await asyncio.sleep(0.1)
        with tempfile.TemporaryDirectory(prefix="relay-memory-") as tmp:
            procs.append(await _open_clients(port, transport, sids[:1], Path(tmp) / "warm.log"))
            await asyncio.sleep(1.5)
            _settle()
            rss0, snap0 = rss_kb(os.getpid()), tracemalloc.take_snapshot()
            count0, size0 = _type_counts()
            t0 = time.perf_counter()
            procs.append(await _open_clients(port, transport, sids[1:], Path(tmp) / "n.log"))
            opened_s = time.perf_counter() - t0
            await asyncio.sleep(2.0)
            _settle()
            rss1, snap1 = rss_kb(os.getpid()), tracemalloc.take_snapshot()
            count1, size1 = _type_counts()
            seen = await _connections(port)
            for p in procs:
                await p.stop()
            procs.clear()
    finally:
        for p in procs:
            await p.stop()
        stop.set()
        await relay
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snap0, snap1 = snap0.filter_traces(ignore), snap1.filter_traces(ignore)
    by_line = snap1.compare_to(snap0, "lineno")
    by_file = snap1.compare_to(snap0, "filename")
    traced = sum(s.size_diff for s in by_line)
    stacks = (
        snap1.compare_to(snap0, "traceback")[:top] if tracemalloc.get_traceback_limit() > 1 else []
    )
    types = sorted(count1, key=lambda k: -(size1[k] - size0[k]))[:top]
    return {
        "transport": transport,
        "connections": n,
        "connections_seen_by_relay": seen,
        "open_seconds": round(opened_s, 2),
        "rss_kb_per_conn": round((rss1 - rss0) / n, 2),
        "traced_bytes_per_conn": round(traced / n),
        "by_line": [
            {
                "site": f"{_short(s.traceback[0].filename)}:{s.traceback[0].lineno}",
                "bytes_per_conn": round(s.size_diff / n),
                "blocks_per_conn": round(s.count_diff / n, 2),
            }
            for s in by_line[:top]
        ],
        "by_file": [
            {"file": _short(s.traceback[0].filename), "bytes_per_conn": round(s.size_diff / n)}
            for s in by_file[:top]
        ],
        "by_stack": [
            {
                "bytes_per_conn": round(s.size_diff / n),
                "blocks_per_conn": round(s.count_diff / n, 2),
                "stack": [f"{_short(f.filename)}:{f.lineno}" for f in s.traceback],
            }
            for s in stacks
        ],
        "by_type": [
            {
                "type": k,
                "objects_per_conn": round((count1[k] - count0[k]) / n, 2),
                "bytes_per_conn": round((size1[k] - size0[k]) / n),
            }
            for k in types
        ],
    }


def _report(res: dict[str, Any]) -> str:
    lines = [
        f"{res['connections']:,} idle {res['transport']} connections"
        f" ({res['connections_seen_by_relay']:,} streams open in the relay): RSS"
        f" {res['rss_kb_per_conn']} KB/conn (with tracemalloc), traced"
        f" {res['traced_bytes_per_conn']:,} B/conn",
        "",
        "by allocation site                                          B/conn  blocks/conn",
    ]
    lines += [
        f"  {r['site'][:56]:56} {r['bytes_per_conn']:>7,} {r['blocks_per_conn']:>8}"
        for r in res["by_line"]
    ]
    lines += ["", "by file                                                     B/conn"]
    lines += [f"  {r['file'][:56]:56} {r['bytes_per_conn']:>7,}" for r in res["by_file"]]
    lines += ["", "by type (objects' own size)                         objects/conn  B/conn"]
    lines += [
        f"  {r['type'][:50]:50} {r['objects_per_conn']:>12} {r['bytes_per_conn']:>7,}"
        for r in res["by_type"]
    ]
    for r in res["by_stack"]:
        lines += ["", f"{r['bytes_per_conn']:,} B/conn, {r['blocks_per_conn']} blocks/conn, from:"]
        lines += [f"    {frame}" for frame in r["stack"]]
    return "\n".join(lines)


@dataclass
class Flags(OnCluster):
    transport: str = flag("sse", "the idle connections' transport", choices=("sse", "ws"))
    n: int = flag(2_000, "idle connections", least=1)
    frames: int = flag(1, "tracemalloc frames per trace; past 1 the top stacks are shown too",
                       least=1)  # fmt: skip
    top: int = flag(25, "rows per table", least=1)


async def _run(args: Flags) -> dict[str, Any]:
    raise_nofile(args.n + 1_000)
    async with bench_stack("relay-memory-") as st:
        url = await st.cluster(masters=3, replicas=1, url=args.redis)
        tracemalloc.start(args.frames)
        try:
            return await measure(url, args.transport, args.n, args.top)
        finally:
            tracemalloc.stop()


def _measure(f: Flags) -> Outcome:
    import uvloop

    res = uvloop.run(_run(f))
    return Outcome(res, _report(res))


BENCH = Bench(Flags, _measure, prog="python -m bench.relay.memory", description=__doc__)
add_arguments, run_from_args = BENCH.add_arguments, BENCH.run_from_args


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--_clients":  # the client child
        import uvloop

        uvloop.run(_clients(json.loads(Path(args[1]).read_text())))
        return 0
    return BENCH.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
