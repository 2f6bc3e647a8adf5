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

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import free_port, percentile, write_json
from devstack.cluster.launcher import LocalCluster
from devstack.procs import Proc, http_ok, launched
from relay.client.stream import watch
from relay.producer.coalesce import DEFAULT_POLICY
from relay.service import runtime

__all__ = ["Workload", "add_arguments", "main", "run", "run_from_args", "summary"]


def log(msg: str) -> None:
    print(f"[stop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def _serve(argv: list[str], url: str, logs: Path, name: str) -> AbstractAsyncContextManager[Proc]:
    return launched(argv, log=logs / f"{name}.log", ready=http_ok(url), name=name)


async def run(wl: Workload) -> dict[str, Any]:
    res = Result()
    rng = random.Random(wl.seed)
    with tempfile.TemporaryDirectory(prefix="stop-bench-") as tmp:
        logs = Path(tmp)
        cluster = LocalCluster(masters=3, replicas=1)
        info = await cluster.start()
        try:
            ep, ap, bp, rp = free_port(), free_port(), free_port(), free_port()
            py = [sys.executable, "-m", "tokenrelay"]
            engine = [sys.executable, "-m", "devstack", "engine", "--port", str(ep),
                      "--id", "mock-1",
                      "--decode-tok-per-s", str(wl.decode_tok_per_s), "--max-concurrency", "1000",
                      "--reply-mean-tokens", "3000", "--reply-min-tokens", "2000",
                      "--reply-max-tokens", "4000"]  # fmt: skip

            def worker(port: int, wid: str) -> list[str]:
                return [*py, "worker", "--port", str(port), "--redis", info.url,
                        "--insecure-no-auth", "--engine", f"mock-1=http://127.0.0.1:{ep}",
                        "--engine-cap", "10000", "--worker-id", wid,
                        "--coalesce-ms", str(wl.coalesce_ms),
                        "--session-rate", "0", "--turns-per-minute", "0",
                        "--max-sessions-per-address", "0",
                        "--max-connections-per-address", "0"]  # fmt: skip

            relay = [*py, "relay", "--port", str(rp), "--redis", info.url, "--insecure-no-auth",
                     "--relay-id", "r-stop", "--log-level", "WARNING",
                     "--max-streams-per-address", "0"]  # fmt: skip
            a, b = f"http://127.0.0.1:{ap}", f"http://127.0.0.1:{bp}"
            eng = f"http://127.0.0.1:{ep}"
            async with (
                _serve(engine, f"{eng}/health", logs, "engine"),
                _serve(worker(ap, "w-generates"), f"{a}/readyz", logs, "worker-a"),
                _serve(worker(bp, "w-stops"), f"{b}/readyz", logs, "worker-b"),
                _serve(relay, f"http://127.0.0.1:{rp}/readyz", logs, "relay"),
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
            ):
                log(f"{wl.sessions} sessions, {wl.concurrency} at once; stops go to worker B")
                gate = asyncio.Semaphore(wl.concurrency)

                async def bounded() -> None:
                    async with gate:
                        await _one(http, a, b, f"http://127.0.0.1:{rp}", wl, rng, res)

                t0 = time.monotonic()
                await asyncio.gather(*(bounded() for _ in range(wl.sessions)))
                elapsed = time.monotonic() - t0
                await asyncio.sleep(0.5)  # the engine counts the last aborts
                aborted = await _aborted(http, eng)
        finally:
            await cluster.stop()
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="40 sessions, 10 at once (< 40 s)")
    ap.add_argument("--sessions", type=int, help="stops measured (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="the jitter of when each stop comes")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")


def run_from_args(args: argparse.Namespace) -> int:
    runtime.exit_on_sigterm()
    wl = Workload(sessions=40, concurrency=10) if args.quick else Workload()
    wl.seed = args.seed
    if args.sessions is not None:
        if args.sessions < 1:
            print("error: --sessions must be >= 1", file=sys.stderr)
            return 2
        wl.sessions = args.sessions
    result = asyncio.run(run(wl))
    print(markdown(result))
    if args.json:
        write_json(args.json, result)
    if result["refused"] or result["stopped"] != result["stops"]:
        log(f"not every stop took: {result['refused'][:5]}, stopped {result['stopped']}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.load.stop",
        description="Stop: the cancel's acknowledgement -> the terminal frame on a screen.",
    )
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
