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

import asyncio
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench._util import ns_ms, percentile
from bench.harness import Bench, Common, Outcome, bench_stack, flag, markdown_table
from bench.harness.report import logger
from relay.client.stream import watch
from relay.producer.coalesce import DEFAULT_POLICY
from relay.protocol.sse_reader import SSEDecoder

__all__ = ["Workload", "add_arguments", "main", "run", "run_from_args", "summary"]

_STAMP = re.compile(r"\[(\d{19})\]")


log = logger("closed_loop")


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
    async with bench_stack("closed-loop-") as st:
        await st.cluster(masters=3, replicas=1)
        engine = await st.stamp_engine("engine", wl.tokens_per_s)
        worker = await st.worker(
            "w-bench", "--coalesce-tokens", str(wl.coalesce_tokens),
            "--coalesce-ms", str(wl.coalesce_ms), engines={"stamp": engine.url}, model="stamp",
        )  # fmt: skip
        relay = await st.relay("r-bench")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            log(f"{wl.sessions} sessions x {wl.turns} turns x {wl.tokens} tokens "
                f"at {wl.tokens_per_s:g}/s")  # fmt: skip
            t0 = time.monotonic()
            await asyncio.gather(
                *(_session(http, worker.url, relay.url, wl, samples) for _ in range(wl.sessions))
            )
            elapsed = time.monotonic() - t0
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
    table = markdown_table(
        ["path", "engine -> screen p50 ms", "p99 ms", "tokens seen", "missed"],
        [
            [name, str(p["p50_ms"]), str(p["p99_ms"]), p["tokens"], p["missed"]]
            for name, p in r["paths"].items()
        ],
    )
    wl = r["workload"]
    return (
        table + "\n" +
        f"\n{wl['sessions']} sessions x {wl['turns']} turns x {wl['tokens']} tokens at "
        f"{wl['tokens_per_s']:g} tokens/s per turn ({r['tokens_per_s']:,} tokens/s in all), "
        f"worker coalescing {wl['coalesce_tokens']} tokens / {wl['coalesce_ms']:g} ms; "
        f"the relay hop adds {r['relay_adds_p50_ms']} ms at p50, {r['relay_adds_p99_ms']} ms "
        "at p99.\n"
    )  # fmt: skip


@dataclass
class Flags(Common):
    sessions: int = flag(50, "concurrent sessions", quick=10, least=1)
    turns: int = flag(2, "turns per session", quick=1, least=1)
    tokens: int = flag(64, "tokens per turn", quick=32, least=1)
    coalesce_ms: float = flag(Workload.coalesce_ms, "the worker's coalescing delay (shipped)")
    coalesce_tokens: int = flag(Workload.coalesce_tokens, "the worker's batch size (1: no merging)")


def measure(f: Flags) -> Outcome:
    wl = Workload(sessions=f.sessions, turns=f.turns, tokens=f.tokens, coalesce_ms=f.coalesce_ms,
                  coalesce_tokens=f.coalesce_tokens)  # fmt: skip
    result = asyncio.run(run(wl))
    missed = {k: p["missed"] for k, p in result["paths"].items() if p["missed"]}
    if missed:
        log(f"tokens missed: {missed}")
    return Outcome(result, markdown(result), 1 if missed else 0)


BENCH = Bench(Flags, measure, prog="python -m bench.load.closed_loop",
              description="Engine token -> screen latency: closed loop vs relay, same tokens.",
              quick_help="10 sessions, 1 turn (< 30 s)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
