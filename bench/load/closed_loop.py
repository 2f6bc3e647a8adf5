"""Engine token -> screen latency: the worker's closed loop vs the relay path, side by side.

What it is for: the source article's first choice for a single screen is the closed loop
(the pod that generates streams straight to the client that asked); the relay path
(SPUBLISH -> shard -> relay -> screen) is what multi-screen and resume cost. This
measures what the relay hop adds, on the same tokens: every turn is POSTed with
``Accept: text/event-stream`` (the closed loop) while a second screen watches the same
session through a relay, so each token reaches both clients and both latencies come
from one stamp.

Participants, each its own process: a local Redis Cluster (3 masters + 3 replicas),
:mod:`bench.load.stamp_engine` (every token is the ``time.time_ns()`` it was sent at), one
``tokenrelay worker`` and one ``tokenrelay relay``; the clients run here.

Call order: ``python -m bench.load.closed_loop [--quick] [--sessions K] [--json PATH]`` ->
:func:`run` -> :func:`summary`. JSON: ``paths.<closed_loop|relay>`` with ``p50_ms``,
``p99_ms``, ``tokens``; ``relay_adds_p50_ms`` / ``relay_adds_p99_ms``; exit 1 when
either path missed a token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import free_port, ns_ms, percentile
from devstack.cluster.launcher import LocalCluster
from devstack.procs import Proc, http_ok, launched
from relay.client.stream import watch
from relay.producer.coalesce import DEFAULT_POLICY
from relay.protocol.sse_reader import SSEDecoder
from relay.service import runtime

__all__ = ["Workload", "add_arguments", "main", "run", "run_from_args", "summary"]

_STAMP = re.compile(r"\[(\d{19})\]")


def log(msg: str) -> None:
    print(f"[closed_loop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    sessions: int = 50
    turns: int = 2
    tokens: int = 64  # per turn
    tokens_per_s: float = 20.0  # per turn, from the engine
    coalesce_tokens: int = DEFAULT_POLICY.max_tokens  # the worker's, as shipped
    coalesce_ms: float = DEFAULT_POLICY.max_delay_s * 1000


@dataclass
class Samples:
    closed_loop: list[int] = field(default_factory=list)
    relay: list[int] = field(default_factory=list)
    sent: int = 0


def _stamps(frame_json: str) -> list[int]:
    frame = json.loads(frame_json)
    if frame.get("kind") != "token":
        return []
    return [int(s) for s in _STAMP.findall(frame.get("text", ""))]


def _serve(argv: list[str], ready_url: str, log_path: Path) -> AbstractAsyncContextManager[Proc]:
    return launched(argv, log=log_path, ready=http_ok(ready_url), name=argv[3])


async def _watch(http: aiohttp.ClientSession, relay: str, sid: str, out: list[int],
                 turns: int) -> None:  # fmt: skip
    """A second screen on a relay (the Python client), from the start of the session,
    until ``turns`` end."""
    ended = 0
    async for frame in watch(relay, sid, None, from_offset=0, http=http, max_reconnects=0):
        now = time.time_ns()
        if frame.kind == "token":
            out.extend(now - int(s) for s in _STAMP.findall(frame.text))
        ended += frame.kind in ("done", "error")
        if ended >= turns:
            return


async def _session(http: aiohttp.ClientSession, worker: str, relay: str, wl: Workload,
                   s: Samples) -> None:  # fmt: skip
    async with http.post(f"{worker}/v1/sessions") as r:
        if r.status != 201:
            raise RuntimeError(f"session refused: {r.status} {await r.text()}")
        sid = (await r.json())["session"]
    watcher = asyncio.create_task(_watch(http, relay, sid, s.relay, wl.turns))
    await asyncio.sleep(0.2)  # the second screen is subscribed before the first token
    for i in range(wl.turns):
        body = {"message": f"turn {i}", "max_tokens": wl.tokens}
        async with http.post(f"{worker}/v1/sessions/{sid}/turns", json=body,
                             headers={"Accept": "text/event-stream"}) as r:  # fmt: skip
            if r.status != 200:
                raise RuntimeError(f"turn refused: {r.status} {await r.text()}")
            dec = SSEDecoder()
            async for chunk in r.content.iter_any():
                now = time.time_ns()
                for ev in dec.feed(chunk):
                    s.closed_loop.extend(now - st for st in _stamps(ev.data))
        s.sent += wl.tokens
    await asyncio.wait_for(watcher, 30)


async def run(wl: Workload) -> dict[str, Any]:
    samples = Samples()
    with tempfile.TemporaryDirectory(prefix="closed-loop-") as tmp:
        logs = Path(tmp)
        cluster = LocalCluster(masters=3, replicas=1)
        info = await cluster.start()
        try:
            ep, wp, rp = free_port(), free_port(), free_port()
            py = [sys.executable, "-m"]
            engine = [*py, "bench.load.stamp_engine", "--port", str(ep),
                      "--tokens-per-s", str(wl.tokens_per_s)]  # fmt: skip
            worker = [
                *py, "tokenrelay", "worker", "--port", str(wp), "--redis", info.url,
                "--insecure-no-auth", "--model", "stamp", "--engine-cap", "10000",
                "--engine", f"stamp=http://127.0.0.1:{ep}", "--worker-id", "w-bench",
                "--coalesce-tokens", str(wl.coalesce_tokens), "--coalesce-ms", str(wl.coalesce_ms),
                # every client of the benchmark is 127.0.0.1: no per-address limits
                "--session-rate", "0", "--turns-per-minute", "0", "--max-sessions-per-address", "0",
                "--max-connections-per-address", "0",
            ]  # fmt: skip
            relay = [
                *py, "tokenrelay", "relay", "--port", str(rp), "--redis", info.url,
                "--insecure-no-auth", "--relay-id", "r-bench", "--log-level", "WARNING",
                "--max-streams-per-address", "0", "--max-connections-per-address", "0",
            ]  # fmt: skip
            async with (
                _serve(engine, f"http://127.0.0.1:{ep}/health", logs / "engine.log"),
                _serve(worker, f"http://127.0.0.1:{wp}/readyz", logs / "worker.log"),
                _serve(relay, f"http://127.0.0.1:{rp}/readyz", logs / "relay.log"),
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
            ):
                log(f"{wl.sessions} sessions x {wl.turns} turns x {wl.tokens} tokens "
                    f"at {wl.tokens_per_s:g}/s")  # fmt: skip
                t0 = time.monotonic()
                await asyncio.gather(*(
                    _session(http, f"http://127.0.0.1:{wp}", f"http://127.0.0.1:{rp}", wl, samples)
                    for _ in range(wl.sessions)
                ))  # fmt: skip
                elapsed = time.monotonic() - t0
        finally:
            await cluster.stop()
    return summary(wl, samples, elapsed)


def summary(wl: Workload, s: Samples, elapsed: float) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for name, ns in (("closed_loop", s.closed_loop), ("relay", s.relay)):
        paths[name] = {
            "p50_ms": ns_ms(percentile(ns, 0.5)),
            "p99_ms": ns_ms(percentile(ns, 0.99)),
            "tokens": len(ns),
            "missed": s.sent - len(ns),
        }
    adds: dict[str, float | None] = {}
    for q in ("p50", "p99"):
        a, b = paths["relay"][f"{q}_ms"], paths["closed_loop"][f"{q}_ms"]
        adds[f"relay_adds_{q}_ms"] = round(a - b, 3) if a is not None and b is not None else None
    return {
        "benchmark": "closed_loop",
        "cpus": os.cpu_count(),
        "workload": asdict(wl),
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(wl.sessions * wl.turns * wl.tokens / max(elapsed, 1e-9)),
        "paths": paths,
        **adds,
    }


def markdown(r: dict[str, Any]) -> str:
    rows = "".join(
        f"| {name} | {p['p50_ms']} | {p['p99_ms']} | {p['tokens']:,} | {p['missed']} |\n"
        for name, p in r["paths"].items()
    )
    wl = r["workload"]
    return (
        "| path | engine -> screen p50 ms | p99 ms | tokens seen | missed |\n"
        "|---|---|---|---|---|\n" + rows +
        f"\n{wl['sessions']} sessions x {wl['turns']} turns x {wl['tokens']} tokens at "
        f"{wl['tokens_per_s']:g} tokens/s per turn ({r['tokens_per_s']:,} tokens/s in all), "
        f"worker coalescing {wl['coalesce_tokens']} tokens / {wl['coalesce_ms']:g} ms; "
        f"the relay hop adds {r['relay_adds_p50_ms']} ms at p50, {r['relay_adds_p99_ms']} ms "
        "at p99.\n"
    )  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="10 sessions, 1 turn (< 30 s)")
    ap.add_argument("--sessions", type=int, help="concurrent sessions (default 50)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--seed", type=int, default=0, help="accepted for symmetry; no randomness")
    ap.add_argument("--coalesce-ms", type=float, help="the worker's coalescing delay (shipped: 50)")
    ap.add_argument("--coalesce-tokens", type=int, help="the worker's batch size (1: no merging)")


def run_from_args(args: argparse.Namespace) -> int:
    runtime.exit_on_sigterm()
    wl = Workload(sessions=10, turns=1, tokens=32) if args.quick else Workload()
    if args.sessions is not None:
        if args.sessions < 1:
            print("error: --sessions must be >= 1", file=sys.stderr)
            return 2
        wl.sessions = args.sessions
    if args.coalesce_ms is not None:
        wl.coalesce_ms = args.coalesce_ms
    if args.coalesce_tokens is not None:
        wl.coalesce_tokens = args.coalesce_tokens
    result = asyncio.run(run(wl))
    print(markdown(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    missed = {k: p["missed"] for k, p in result["paths"].items() if p["missed"]}
    if missed:
        log(f"tokens missed: {missed}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.load.closed_loop",
        description="Engine token -> screen latency: closed loop vs relay, same tokens.",
    )
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
