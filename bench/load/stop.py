"""Stop: from the cancel's acknowledgement to the terminal frame on a screen.

What it answers: how soon a Stop pressed on one screen ends the reply on every screen,
when the worker that takes the stop is not the one that generates (the stop crosses
from one worker process to the other through the generating worker's control channel),
and how many of the engine's tokens still reach the screens after the stop was
acknowledged (the aim: at most one coalescing flush).

Participants, each its own process: a local Redis Cluster (3 masters + 3 replicas), a
mock engine (``python -m devstack engine``, long replies), two ``tokenrelay worker`` processes
(A generates, B takes the stops) and one ``tokenrelay relay``; the screens (the Python
client, SSE) run here. Per session: a screen watches through the relay, a turn is
posted to A, and once the screen has ``--tokens-before`` tokens a stop is posted to B.
``ack`` is when B's 202 arrives; ``terminal`` when the screen gets the turn's ``done``
frame (``finish_reason`` ``cancelled``).

Figures: ``ack_to_terminal_ms`` p50 / p99 / max (negative: the frame reached the screen
before the acknowledgement reached the client); ``frames_after_ack`` (token frames the
screen got after the ack: coalescing flushes, some of them published before it) max and
mean; ``frames_published_after_ack`` (of those, the ones the worker published after the
ack, by the frames' ``ts``: the producer's clock, this host's); ``tokens_after_ack``
(engine deltas in them); ``stopped`` (turns whose done says ``cancelled``: every one, or
the benchmark fails), and the engine's aborted-request counter against the stops.

Call order: ``python -m bench.load.stop [--quick] [--sessions K] [--seed S] [--json PATH]``
-> :func:`run` -> :func:`summary`.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench._util import percentile
from bench.harness import Bench, Common, Outcome, bench_stack, flag
from bench.harness.report import logger
from relay.client.stream import watch
from relay.producer.coalesce import DEFAULT_POLICY

__all__ = ["Workload", "add_arguments", "main", "run", "run_from_args", "summary"]


log = logger("stop")


@dataclass
class Workload:
    sessions: int = 200
    concurrency: int = 20  # sessions stopping at once
    tokens_before: int = 10  # tokens on the screen before the stop (then a jitter)
    decode_tok_per_s: float = 40.0  # the engine's, per reply
    seed: int = 0
    coalesce_ms: float = DEFAULT_POLICY.max_delay_s * 1000  # the worker's, as shipped


@dataclass
class Sample:
    ack_to_terminal_ms: float
    frames_after_ack: int
    tokens_after_ack: int
    frames_published_after_ack: int
    finish_reason: str


@dataclass
class Result:
    samples: list[Sample] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


async def _one(http: aiohttp.ClientSession, a: str, b: str, relay: str, wl: Workload,
               rng: random.Random, out: Result) -> None:  # fmt: skip
    async with http.post(f"{a}/v1/sessions") as r:
        sid = (await r.json())["session"]
    tokens = 0
    ack: float | None = None
    ack_wall_ms = 0.0
    after_frames = after_tokens = published_after = 0
    enough = asyncio.Event()
    want = wl.tokens_before + rng.randrange(0, 5)
    finish = ""
    terminal_at = 0.0

    async def screen() -> None:
        nonlocal tokens, after_frames, after_tokens, published_after, finish, terminal_at
        async for f in watch(relay, sid, None, 0, http=http, max_reconnects=0):
            now = time.monotonic()
            if f.kind == "token":
                n = int((f.meta or {}).get("n", 1))
                tokens += n
                if ack is not None:
                    after_frames += 1
                    after_tokens += n
                    published_after += f.ts > ack_wall_ms  # the producer's clock: this host
                if tokens >= want:
                    enough.set()
            elif f.kind in ("done", "error"):
                terminal_at = now
                finish = str((f.meta or {}).get("finish_reason") or f.kind)
                enough.set()
                return

    task = asyncio.create_task(screen())
    await asyncio.sleep(0.1)  # the screen is subscribed before the first frame
    async with http.post(f"{a}/v1/sessions/{sid}/turns",
                         json={"message": "a long story", "max_tokens": 4000}) as r:  # fmt: skip
        if r.status != 202:
            out.refused.append(f"turn {r.status}")
            task.cancel()
            return
    await asyncio.wait_for(enough.wait(), 30)
    async with http.post(f"{b}/v1/sessions/{sid}/cancel") as r:
        ack, ack_wall_ms = time.monotonic(), time.time() * 1000
        if r.status != 202:
            out.refused.append(f"cancel {r.status} {await r.text()}")
    await asyncio.wait_for(task, 30)
    assert ack is not None
    ms = round((terminal_at - ack) * 1000, 2)
    out.samples.append(Sample(ms, after_frames, after_tokens, published_after, finish))


async def _aborted(http: aiohttp.ClientSession, engine: str) -> float:
    async with http.get(f"{engine}/metrics") as r:
        text = await r.text()
    m = re.search(r"^tokenrelay_engine_aborted_requests_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def run(wl: Workload) -> dict[str, Any]:
    res = Result()
    rng = random.Random(wl.seed)
    async with bench_stack("stop-bench-") as st:
        await st.cluster(masters=3, replicas=1)
        engine = await st.mock_engine(
            "mock-1", "--decode-tok-per-s", str(wl.decode_tok_per_s), "--max-concurrency", "1000",
            "--reply-mean-tokens", "3000", "--reply-min-tokens", "2000",
            "--reply-max-tokens", "4000",
        )  # fmt: skip
        coalesce = ("--coalesce-ms", str(wl.coalesce_ms))
        a = await st.worker("w-generates", *coalesce, engines={"mock-1": engine.url})
        b = await st.worker("w-stops", *coalesce, engines={"mock-1": engine.url})
        relay = await st.relay("r-stop")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            log(f"{wl.sessions} sessions, {wl.concurrency} at once; stops go to worker B")
            gate = asyncio.Semaphore(wl.concurrency)

            async def bounded() -> None:
                async with gate:
                    await _one(http, a.url, b.url, relay.url, wl, rng, res)

            t0 = time.monotonic()
            await asyncio.gather(*(bounded() for _ in range(wl.sessions)))
            elapsed = time.monotonic() - t0
            await asyncio.sleep(0.5)  # the engine counts the last aborts
            aborted = await _aborted(http, engine.url)
    return summary(wl, res, elapsed, aborted)


def summary(wl: Workload, res: Result, elapsed: float, aborted: float) -> dict[str, Any]:
    lat = [s.ack_to_terminal_ms for s in res.samples]
    frames = [s.frames_after_ack for s in res.samples]
    tokens = [s.tokens_after_ack for s in res.samples]
    published = [s.frames_published_after_ack for s in res.samples]
    return {
        "benchmark": "stop",
        "cpus": os.cpu_count(),
        "workload": asdict(wl),
        "elapsed_s": round(elapsed, 2),
        "stops": len(res.samples),
        "stopped": sum(s.finish_reason == "cancelled" for s in res.samples),
        "refused": res.refused,
        "engine_aborted_requests": aborted,
        "ack_to_terminal_ms": {
            "p50": percentile(lat, 0.5),
            "p99": percentile(lat, 0.99),
            "max": max(lat, default=None),
        },
        "frames_after_ack": {"max": max(frames, default=None),
                             "mean": round(sum(frames) / max(len(frames), 1), 3)},
        "tokens_after_ack": {"max": max(tokens, default=None),
                             "mean": round(sum(tokens) / max(len(tokens), 1), 3)},
        "frames_published_after_ack": {"max": max(published, default=None),
                                       "mean": round(sum(published) / max(len(published), 1), 3)},
    }  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    lat, fr, tk = r["ack_to_terminal_ms"], r["frames_after_ack"], r["tokens_after_ack"]
    pub = r["frames_published_after_ack"]
    return (
        "| stops | stopped (done: cancelled) | engine aborts | ack -> terminal p50 ms | p99 ms "
        "| max ms | token frames received after ack (max / mean) | of them published after "
        "ack (max / mean) | tokens received after ack (max / mean) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {r['stops']} | {r['stopped']} | {r['engine_aborted_requests']:g} | {lat['p50']} "
        f"| {lat['p99']} | {lat['max']} | {fr['max']} / {fr['mean']} "
        f"| {pub['max']} / {pub['mean']} | {tk['max']} / {tk['mean']} |\n"
    )


@dataclass
class Flags(Common):
    sessions: int = flag(200, "stops measured", quick=40, least=1)
    concurrency: int = flag(20, "sessions stopping at once", quick=10, least=1)
    seed: int = flag(0, "the jitter of when each stop comes")


def measure(f: Flags) -> Outcome:
    result = asyncio.run(run(Workload(sessions=f.sessions, concurrency=f.concurrency, seed=f.seed)))
    ok = not result["refused"] and result["stopped"] == result["stops"]
    if not ok:
        log(f"not every stop took: {result['refused'][:5]}, stopped {result['stopped']}")
    return Outcome(result, markdown(result), 0 if ok else 1)


BENCH = Bench(Flags, measure, prog="python -m bench.load.stop",
              description="Stop: the cancel's acknowledgement -> the terminal frame on a screen.",
              quick_help="40 sessions, 10 at once (< 40 s)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
