"""The Durable Streams front's hostile batch against one relay, and the longest time
its event loop was held meanwhile: a hostile benchmark.

What it answers: does any one write hold the relay? A 2 MB JSON array of a million
tiny elements held a relay's event loop about 15 s (its ``/healthz`` answered after
14.8 s, a chat on it went 12.85 s without a token): every request of the batch must
leave the loop free, the aim is no ``/healthz`` round trip above 100 ms.

Participants: a local Redis Cluster (3 masters), one ``tokenrelay relay`` process
(``--insecure-no-auth``: every stream open; every Durable Streams flag at its default,
so a body up to 4 MiB), and, in this process, a prober that sends ``GET /healthz`` on
one keep-alive connection every ``PROBE_EVERY_S`` and keeps each round trip, and the
attacker, one request at a time, ``--rounds`` times over:

- ``million_zeros``: ``POST`` of ``[0,0,...]``, 1,000,000 elements (2 MB);
- ``max_body_dicts``: ``POST`` of ``[{},{},...]`` filling the 4 MiB body limit
  (1.4 M elements, the costliest JSON per byte to parse we found);
- ``nesting``: ``POST`` of 100,000 nested arrays;
- ``surrogate_nan``: ``POST`` of ``["\\ud800", NaN]``;
- ``max_messages``: ``POST`` of 10,000 small objects (the most one write takes: 204);
- ``big_records``: ``POST`` of 10,000 records of ~400 bytes (~4 MB: 204, parsed off the
  loop);
- ``fork``: a ``PUT`` fork of a source of 100,000 messages (the documented bound:
  201), copied in pages.

The relay runs under :mod:`bench.hostile.lagged_relay`, which notes every gap of its
loop's 10 ms timer past 20 ms with the CPU time the loop's thread spent in it.
The bodies are built before the prober starts. Measured: the longest CPU time the
relay's loop spent between two ticks of that timer during the batch (its own work, the
figure against the aim: a loaded machine does not inflate it) and the longest such gap
by the clock (which a loaded machine does); the relay's
``tokenrelay_relay_loop_lag_seconds`` histogram over the batch (from ``/metrics``
before and after: its longest sample as a bucket bound, samples past 1 ms); the
prober's round trips before the batch (the baseline) and during it (max, p99, p50,
count: they add this process's and the machine's scheduling to the relay's); each
request kind's statuses and time; and, for each body, how long
:func:`relay.durable.core.body_messages` takes in this process (what the relay's loop
would hold if it parsed the body there). Exit 1 when a request got a 5xx, the relay
logged a traceback, or the loop's longest work between two ticks passed ``AIM_MS``.

Order of use: ``python -m bench.hostile.durable [--quick] [--rounds N] [--json PATH]
[--seed N]`` (``run_from_args``), or ``await run(rounds)`` -> dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from bench._util import percentile
from bench.harness import Bench, Common, Outcome, bench_stack, flag
from bench.harness.stack import RELAY_OPEN
from bench.relay.instruments import loop_lag
from relay.durable import core, fork

__all__ = ["AIM_MS", "add_arguments", "main", "run", "run_from_args"]

AIM_MS: Final = 100.0
PROBE_EVERY_S: Final = 0.005
JSON: Final = {"Content-Type": "application/json"}
MAX_BODY: Final = 4 << 20  # the relay's default --durable-max-body-bytes


def _bodies(rng: random.Random) -> dict[str, bytes]:
    dicts = (MAX_BODY - 2) // 3
    record = {"id": 0, "text": "x" * 360, "ok": True}
    records = []
    for i in range(core.MAX_WRITE_MESSAGES):
        record["id"] = rng.randrange(1 << 40)
        records.append(json.dumps({**record, "n": i}))
    return {
        "million_zeros": b"[" + b"0," * 999_999 + b"0]",
        "max_body_dicts": b"[" + b"{}," * (dicts - 1) + b"{}]",
        "nesting": b"[" * 100_000 + b"]" * 100_000,
        "surrogate_nan": b'["\\ud800", NaN]',
        "max_messages": json.dumps([{"i": i} for i in range(core.MAX_WRITE_MESSAGES)]).encode(),
        "big_records": ("[" + ",".join(records) + "]").encode(),
    }


def _on_loop_ms(body: bytes) -> float:
    """What parsing ``body`` costs where it is called (the loop, if the relay did it there)."""
    t = time.perf_counter()
    with contextlib.suppress(core.BadRequest):
        core.body_messages(body, True, allow_empty_array=False)
    return round((time.perf_counter() - t) * 1000, 1)


@dataclass
class Probe:
    """``GET /healthz`` round trips, in ms, while ``on``."""

    http: aiohttp.ClientSession
    base: str
    rtts: list[float]
    stop: asyncio.Event

    async def loop(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            async with self.http.get(f"{self.base}/healthz") as r:
                await r.read()
            self.rtts.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(PROBE_EVERY_S)


def _gaps(path: Any, start: float, end: float) -> list[dict[str, float]]:
    """The monitor's gaps noted between ``start`` and ``end`` (unix time)."""
    if not path.exists():
        return []
    lines = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return [g for g in lines if start <= g["t"] <= end]


async def _metrics(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/metrics") as r:
        return await r.text()


def _stats(rtts: list[float]) -> dict[str, float | int]:
    s = sorted(rtts)
    return {
        "count": len(s),
        "p50_ms": round(percentile(s, 0.5, 0.0), 1),
        "p99_ms": round(percentile(s, 0.99, 0.0), 1),
        "max_ms": round(s[-1], 1) if s else 0.0,
    }


async def _source(http: aiohttp.ClientSession, url: str) -> None:
    """A stream of :data:`relay.durable.fork.MAX_FORK_MESSAGES` messages at ``url``."""
    async with http.put(url, headers=JSON) as r:
        assert r.status == 201, await r.text()
    batch = json.dumps([1] * core.MAX_WRITE_MESSAGES).encode()
    for _ in range(fork.MAX_FORK_MESSAGES // core.MAX_WRITE_MESSAGES):
        async with http.post(url, headers=JSON, data=batch) as r:
            assert r.status == 204, await r.text()


async def _attack(
    http: aiohttp.ClientSession, base: str, bodies: dict[str, bytes], rounds: int, source: str
) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}

    def note(kind: str, status: int, took_s: float) -> None:
        k = kinds.setdefault(kind, {"statuses": {}, "max_s": 0.0})
        k["statuses"][str(status)] = k["statuses"].get(str(status), 0) + 1
        k["max_s"] = round(max(k["max_s"], took_s), 3)

    async def request(kind: str, method: str, url: str, h: dict[str, str], body: bytes) -> None:
        t = time.perf_counter()
        async with http.request(method, url, headers=h, data=body) as r:
            await r.read()
            note(kind, r.status, time.perf_counter() - t)

    for i in range(rounds):
        url = f"{base}/v1/stream/hostile/{i}-{time.monotonic_ns()}"
        async with http.put(url, headers=JSON) as r:
            assert r.status == 201, await r.text()
        for kind, body in bodies.items():
            await request(kind, "POST", url, JSON, body)
        h = {**JSON, "Stream-Forked-From": source}
        await request("fork", "PUT", f"{url}-fork", h, b"")
    return kinds


async def run(rounds: int, seed: int = 0) -> dict[str, Any]:
    bodies = _bodies(random.Random(seed))
    on_loop = {k: _on_loop_ms(b) for k, b in bodies.items()}
    async with bench_stack("durable-hostile-") as st:
        await st.cluster(masters=3, replicas=0)
        lag_file = st.log_dir / "loop-work.jsonl"
        relay = await st.serve("durable-hostile", lambda port: [
            sys.executable, "-m", "bench.hostile.lagged_relay", "relay", "--port", str(port),
            "--redis", st.redis_url, "--relay-id", "durable-hostile", *RELAY_OPEN],
            "/readyz", env={"LAGGED_RELAY_OUT": str(lag_file)})  # fmt: skip
        base = f"http://127.0.0.1:{relay.port}"
        timeout = aiohttp.ClientTimeout(total=300)
        async with (
            aiohttp.ClientSession(timeout=timeout) as attacker,
            aiohttp.ClientSession(timeout=timeout) as prober,
        ):
            source = "/v1/stream/hostile/source"
            await _source(attacker, base + source)
            before = Probe(prober, base, [], asyncio.Event())
            task = asyncio.create_task(before.loop())
            await asyncio.sleep(2.0)
            before.stop.set()
            await task
            during = Probe(prober, base, [], asyncio.Event())
            metrics_before = await _metrics(prober, base)
            task = asyncio.create_task(during.loop())
            t0, unix0 = time.perf_counter(), time.time()
            try:
                kinds = await _attack(attacker, base, bodies, rounds, source)
            finally:
                during.stop.set()
                await task
            seconds = round(time.perf_counter() - t0, 1)
            lag = loop_lag(metrics_before, await _metrics(prober, base))
            gaps = _gaps(lag_file, unix0, time.time())
        tracebacks = relay.log_path.read_bytes().count(b"Traceback")
    return {
        "rounds": rounds,
        "seed": seed,
        "batch_seconds": seconds,
        "healthz_before": _stats(before.rtts),
        "healthz_during": _stats(during.rtts),
        "loop_lag": lag,
        "longest_stall_ms_at_most": lag["max_ms_at_most"],
        "loop_work_ms_max": max((g["cpu_ms"] for g in gaps), default=0.0),
        "loop_gap_ms_max": max((g["wall_ms"] for g in gaps), default=0.0),
        "loop_gaps_over_20ms": len(gaps),
        "aim_ms": AIM_MS,
        "kinds": kinds,
        "body_bytes": {k: len(b) for k, b in bodies.items()},
        "parse_on_this_loop_ms": on_loop,
        "relay_log_tracebacks": tracebacks,
    }


def _table(res: dict[str, Any]) -> str:
    b, d = res["healthz_before"], res["healthz_during"]
    lines = [
        f"hostile batch: {res['rounds']} rounds in {res['batch_seconds']} s",
        f"relay event loop: longest work between two 10 ms ticks {res['loop_work_ms_max']} ms "
        f"of CPU (aim < {res['aim_ms']:.0f} ms); longest gap by the clock "
        f"{res['loop_gap_ms_max']} ms ({res['loop_gaps_over_20ms']} gaps over 20 ms)",
        f"relay loop-lag histogram: longest sample <= {res['longest_stall_ms_at_most']} ms; "
        f"{res['loop_lag']['over_1ms']} of {res['loop_lag']['samples']} samples over 1 ms",
        f"/healthz before: p50 {b['p50_ms']} ms, p99 {b['p99_ms']} ms, max {b['max_ms']} ms "
        f"({b['count']} probes)",
        f"/healthz during: p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, max {d['max_ms']} ms "
        f"({d['count']} probes)",
        "| request | bytes | statuses | slowest answer s | parse on a loop ms |",
        "|---|---|---|---|---|",
    ]
    for kind, k in res["kinds"].items():
        size = res["body_bytes"].get(kind, "-")
        on_loop = res["parse_on_this_loop_ms"].get(kind, "-")
        statuses = ", ".join(f"{s} x{n}" for s, n in sorted(k["statuses"].items()))
        lines.append(f"| {kind} | {size} | {statuses} | {k['max_s']} | {on_loop} |")
    lines.append(f"relay log tracebacks: {res['relay_log_tracebacks']}")
    return "\n".join(lines)


def _failed(res: dict[str, Any]) -> bool:
    fives = any(s.startswith("5") for k in res["kinds"].values() for s in k["statuses"])
    work = res["loop_work_ms_max"]
    return fives or res["relay_log_tracebacks"] > 0 or work > AIM_MS


@dataclass
class Flags(Common):
    rounds: int = flag(5, "times the batch is sent", quick=2, least=1)
    seed: int = flag(0, "the records' ids")


def _run(f: Flags) -> Outcome:
    res = asyncio.run(run(f.rounds, f.seed))
    return Outcome(res, _table(res), 1 if _failed(res) else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.hostile.durable", description=__doc__,
              quick_help="2 rounds of the batch (~1 minute)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
