"""The Responses API's cost and its resume latency, beside chat completions and the relay's SSE.

What it is for: a response is a turn of a session, its events the turn's frames
translated (on the worker's POST, or on a relay's ``GET ?stream=true``), so it costs
what the session path costs plus the translation. This measures, on the same tokens,
events/s and the processes' CPU per event and per token through four paths, one after
the other:

- ``chat_completions``: ``POST /v1/chat/completions`` streamed, no session (the engine's
  chunks straight through the worker: no Redis);
- ``responses_worker``: ``POST /v1/responses`` streamed (the turn's frames from the
  closed loop, translated on the worker);
- ``relay_sse``: ``POST /v1/sessions/{sid}/turns``, the turn watched through a relay's
  SSE (``/events``: the frames as they are);
- ``responses_relay``: ``POST /v1/responses`` in background, its events from a relay's
  ``GET /v1/responses/{id}?stream=true``.

Then the resume: ``--resumes`` background responses run at once, and each is resumed
with ``starting_after`` by one client at the same instant, on the relay, on a worker,
and (the same sessions' frames) through the relay's own SSE resume: request -> first
resumed event, p50 and p99; two rounds in alternating order, the better one in the
table.

Participants, each its own process: a local Redis Cluster (3 masters + 3 replicas),
:mod:`bench.load.stamp_engine`, one ``tokenrelay worker``, one ``tokenrelay relay``; the
clients run here. CPU is the worker's and the relay's (``/proc``), not the engine's or
the clients'. The machine may be shared: read the paths' ratios, measured in one run.

Call order: ``python -m bench.load.responses [--quick] [--json PATH]`` -> :func:`run`.
JSON: ``paths.<name>`` with ``events``, ``tokens``, ``events_per_s``, ``cpu_us_per_event``,
``cpu_us_per_token``; ``resume.<relay|worker>`` with ``p50_ms``, ``p99_ms``, ``n``; exit 1
when a path lost a token or a resume failed.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench._util import cpu_s, ns_ms, percentile
from bench.harness import Bench, Common, Outcome, bench_stack, flag, markdown_table
from bench.harness.report import logger
from relay.fronts.responses.wire import parse_response_id
from relay.protocol.sse_reader import SSEDecoder

__all__ = ["Workload", "add_arguments", "main", "run", "run_from_args"]

MODEL = "stamp"
_STAMP = re.compile(r"\[\d{19}\]")  # one token of the stamp engine


log = logger("responses")


@dataclass
class Workload:
    sessions: int = 20  # concurrent, per path
    turns: int = 3  # per session, per path
    tokens: int = 128  # per turn
    tokens_per_s: float = 4000.0  # the engine's pace: well above what the paths carry
    resumes: int = 100
    resume_tokens: int = 200
    resume_tokens_per_s: float = 50.0  # the resumed responses still run when resumed


Stream = Callable[[aiohttp.ClientSession, str, str, int], Awaitable[tuple[int, int]]]


async def _events(resp: aiohttp.ClientResponse) -> tuple[int, int, str]:
    """(events, tokens, last event's data) of an SSE response read to its end."""
    dec, events, tokens, last = SSEDecoder(), 0, 0, ""
    async for chunk in resp.content.iter_any():
        for ev in dec.feed(chunk):
            events += 1
            tokens += len(_STAMP.findall(ev.data))
            last = ev.data
    return events, tokens, last


async def _chat(http: aiohttp.ClientSession, worker: str, _relay: str, n: int) -> tuple[int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": n}  # fmt: skip
    async with http.post(f"{worker}/v1/chat/completions", json=body) as r:
        events, tokens, _ = await _events(r)
    return events, tokens


async def _resp_worker(http: aiohttp.ClientSession, worker: str, _relay: str,
                       n: int) -> tuple[int, int]:  # fmt: skip
    body = {"model": MODEL, "input": "go", "stream": True, "max_output_tokens": n}
    async with http.post(f"{worker}/v1/responses", json=body) as r:
        events, tokens, last = await _events(r)
    # the deltas' stamps, without those the closing events repeat (text.done, ...)
    return events, _delta_tokens(tokens, last)


def _delta_tokens(tokens: int, last: str) -> int:
    """Stamps counted in every event include the closing events' copies of the text
    (``output_text.done``, ``content_part.done``, ``output_item.done``, the final
    response): subtract them (the final event holds the text once)."""
    return tokens - 4 * len(_STAMP.findall(last)) if last else tokens


async def _relay_sse(http: aiohttp.ClientSession, worker: str, relay: str,
                     n: int) -> tuple[int, int]:  # fmt: skip
    async with http.post(f"{worker}/v1/sessions") as r:
        sid = (await r.json())["session"]
    async with http.post(f"{worker}/v1/sessions/{sid}/turns",
                         json={"message": "go", "max_tokens": n}) as r:  # fmt: skip
        if r.status != 202:
            raise RuntimeError(f"turn refused: {r.status} {await r.text()}")
    events = tokens = 0
    async with http.get(f"{relay}/v1/sessions/{sid}/events?last_event_id=0") as r:
        dec = SSEDecoder()
        async for chunk in r.content.iter_any():
            for ev in dec.feed(chunk):
                if ev.event in ("token", "meta", "done", "error"):
                    events += 1
                    tokens += len(_STAMP.findall(ev.data)) if ev.event == "token" else 0
                if ev.event in ("done", "error"):
                    return events, tokens
    return events, tokens


async def _background(http: aiohttp.ClientSession, worker: str, n: int) -> str:
    body = {"model": MODEL, "input": "go", "background": True, "max_output_tokens": n}
    async with http.post(f"{worker}/v1/responses", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"response refused: {r.status} {await r.text()}")
        rid: str = (await r.json())["id"]
    return rid


async def _resp_relay(http: aiohttp.ClientSession, worker: str, relay: str,
                      n: int) -> tuple[int, int]:  # fmt: skip
    rid = await _background(http, worker, n)
    async with http.get(f"{relay}/v1/responses/{rid}?stream=true") as r:
        events, tokens, last = await _events(r)
    return events, _delta_tokens(tokens, last)


PATHS: dict[str, Stream] = {
    "chat_completions": _chat,
    "responses_worker": _resp_worker,
    "relay_sse": _relay_sse,
    "responses_relay": _resp_relay,
}


async def _path(http: aiohttp.ClientSession, worker: str, relay: str, pids: list[int],
                wl: Workload, stream: Stream) -> dict[str, Any]:  # fmt: skip
    async def one() -> tuple[int, int]:
        events = tokens = 0
        for _ in range(wl.turns):
            e, t = await stream(http, worker, relay, wl.tokens)
            events, tokens = events + e, tokens + t
        return events, tokens

    cpu0 = sum(cpu_s(p) for p in pids)
    t0 = time.monotonic()
    got = await asyncio.gather(*(one() for _ in range(wl.sessions)))
    elapsed = time.monotonic() - t0
    cpu = sum(cpu_s(p) for p in pids) - cpu0
    events, tokens = sum(e for e, _ in got), sum(t for _, t in got)
    return {
        "events": events,
        "tokens": tokens,
        "missed": wl.sessions * wl.turns * wl.tokens - tokens,
        "elapsed_s": round(elapsed, 3),
        "events_per_s": round(events / max(elapsed, 1e-9)),
        "cpu_s": round(cpu, 3),
        "cpu_us_per_event": round(cpu * 1e6 / max(events, 1), 1),
        "cpu_us_per_token": round(cpu * 1e6 / max(tokens, 1), 1),
    }


async def _first_event(http: aiohttp.ClientSession, url: str) -> int | None:
    """ns from the request to the first resumed event (None: none came)."""
    t0 = time.perf_counter_ns()
    async with http.get(url) as r:
        if r.status != 200:
            return None
        dec = SSEDecoder()
        async for chunk in r.content.iter_any():
            # a Responses event, or a frame of the relay's SSE (not its hello)
            if any(ev.event != "hello" for ev in dec.feed(chunk)):
                return time.perf_counter_ns() - t0
    return None


async def _resumes(http: aiohttp.ClientSession, worker: str, base: str, wl: Workload,
                   sse: bool = False) -> dict[str, Any]:  # fmt: skip
    """``wl.resumes`` background responses, then one resume of each at once: after
    event 10 (``sse``: the relay's own SSE resume of the same sessions, after the turn's
    8th frame, which event 10 is)."""
    rids = await asyncio.gather(*(_background(http, worker, wl.resume_tokens)
                                  for _ in range(wl.resumes)))  # fmt: skip
    await asyncio.sleep(1.0)  # each is some way in: a resume replays, then goes on live
    urls = []
    for rid in map(parse_response_id, rids):
        sse_url = f"{base}/v1/sessions/{rid.session}/events?last_event_id={rid.first + 7}"
        urls.append(sse_url if sse else f"{base}/v1/responses/{rid}?stream=true&starting_after=10")
    got = await asyncio.gather(*(_first_event(http, u) for u in urls))
    ns = [g for g in got if g is not None]
    # the next phase starts once these responses ended: its resumes share no CPU with them
    await asyncio.sleep(wl.resume_tokens / wl.resume_tokens_per_s)
    return {"n": len(ns), "failed": len(got) - len(ns), "p50_ms": ns_ms(percentile(ns, 0.5)),
            "p99_ms": ns_ms(percentile(ns, 0.99))}  # fmt: skip


async def run(wl: Workload) -> dict[str, Any]:
    async with bench_stack("responses-bench-") as st:
        await st.cluster(masters=3, replicas=1)
        fast = await st.stamp_engine("engine", wl.tokens_per_s)
        slow = await st.stamp_engine("engine2", wl.resume_tokens_per_s)
        worker = await st.worker("w-bench", "--max-tokens-limit", "4096",
                                 engines={"fast": fast.url}, model=MODEL)  # fmt: skip
        relay = await st.relay("r-bench")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            pids = [worker.pid, relay.pid]
            paths: dict[str, Any] = {}
            for name, stream in PATHS.items():
                log(f"{name}: {wl.sessions} sessions x {wl.turns} turns x {wl.tokens} tokens")
                paths[name] = await _path(http, worker.url, relay.url, pids, wl, stream)
            # the resumes, on a second worker routed to the slow engine (the responses
            # must still run), through the relay and then the first worker
            worker2 = await st.worker("w-bench-2", engines={"slow": slow.url}, model=MODEL)
            resume = await _resume_phase(http, worker2.url, worker.url, relay.url, wl)
    return {"benchmark": "responses", "cpus": os.cpu_count(), "workload": asdict(wl),
            "paths": paths, "resume": resume}  # fmt: skip


async def _resume_phase(http: aiohttp.ClientSession, w2: str, wurl: str, rurl: str,
                        wl: Workload) -> dict[str, Any]:  # fmt: skip
    """Twice each, in alternating order (the machine's load moves between phases): the
    JSON has each round, the table the better of the two."""
    out: dict[str, Any] = {}
    order = [("relay", rurl, False), ("relay_sse", rurl, True), ("worker", wurl, False)]
    for rnd, phases in enumerate((order, order[::-1])):
        for name, base, sse in phases:
            log(f"resume round {rnd + 1}: {wl.resumes} at once on the {name}")
            got = await _resumes(http, w2, base, wl, sse)
            out.setdefault(name, {"rounds": []})["rounds"].append(got)
    for r in out.values():
        best = min(r["rounds"], key=lambda g: g["p50_ms"] or float("inf"))
        r.update({k: best[k] for k in ("n", "p50_ms", "p99_ms")})
        r["failed"] = sum(g["failed"] for g in r["rounds"])
    return out


def markdown(r: dict[str, Any]) -> str:
    paths = markdown_table(
        ["path", "events", "tokens", "events/s", "CPU µs/event", "CPU µs/token"],
        [[n, p["events"], p["tokens"], p["events_per_s"], str(p["cpu_us_per_event"]),
          str(p["cpu_us_per_token"])] for n, p in r["paths"].items()],
    )  # fmt: skip
    resumes = markdown_table(
        ["resume on", "resumes", "request -> first event p50 ms", "p99 ms"],
        [[n, str(p["n"]), str(p["p50_ms"]), str(p["p99_ms"])] for n, p in r["resume"].items()],
    )
    wl = r["workload"]
    return (
        f"{paths}\n\n{wl['sessions']} sessions x {wl['turns']} turns x {wl['tokens']} tokens "
        f"per path (CPU: the worker's + the relay's)\n\n{resumes}\n"
    )


@dataclass
class Flags(Common):
    sessions: int = flag(20, "concurrent sessions per path", quick=5, least=1)
    turns: int = flag(3, "turns per session, per path", quick=1, least=1)
    tokens: int = flag(128, "tokens per turn", quick=64, least=1)
    resumes: int = flag(100, "concurrent resumes", quick=20, least=1)


def measure(f: Flags) -> Outcome:
    wl = Workload(sessions=f.sessions, turns=f.turns, tokens=f.tokens, resumes=f.resumes)
    result = asyncio.run(run(wl))
    missed = {k: p["missed"] for k, p in result["paths"].items() if p["missed"]}
    failed = {k: p["failed"] for k, p in result["resume"].items() if p["failed"]}
    if missed or failed:
        log(f"tokens missed: {missed}; resumes failed: {failed}")
    return Outcome(result, markdown(result), 1 if missed or failed else 0)


BENCH = Bench(Flags, measure, prog="python -m bench.load.responses",
              description="The Responses API beside chat completions and relay SSE; resumes.",
              quick_help="5 sessions, 1 turn, 20 resumes")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
