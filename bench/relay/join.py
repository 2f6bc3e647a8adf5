"""A late joiner of a long session: frames, bytes and time to join, compacted against full.

A session of ``--turns`` finished turns (each a ``meta`` frame with the user's message,
``--tokens`` token frames of coalesced text, a ``done`` frame with the reply's integrity)
and one running turn is written to a local Redis Cluster (started here unless
``--redis``); one relay process (``tokenrelay relay``, :mod:`bench.relay.harness`) serves
it. A client joins from offset 0, over SSE (``Last-Event-ID: 0``) and over WebSocket
(``?from=0``), with ``?compact=1`` and without, ``--repeats`` times each in alternating
order, and reads until the session's last offset has arrived. Per join:

- **frames**: the session's frames received (the hello and presence frames not counted);
- **bytes**: what the client read from the stream's body (SSE: the events as written,
  after HTTP's chunk framing; WebSocket: the messages' payloads);
- **time**: from the request to the last frame received (the median of the repeats);
- **relay CPU**: the relay process's CPU seconds during the join (``/proc``).

Every join is checked: its text is the session's, its offsets continuous (a merged
frame from ``meta.from``), a compacted one has three frames per finished turn.

``python -m bench.relay.join [--quick] [--turns N] [--tokens N] [--repeats N]
[--redis URL] [--seed N] [--json PATH]`` (``--quick``: 100 turns, 3 repeats).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench._util import cpu_s
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.relay.harness import SECRET, relay_process
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from relay.protocol.sse_reader import SSEDecoder

__all__ = ["add_arguments", "main", "measure", "run_from_args"]

_WORDS = ("the ", "relay ", "streams ", "tokens ", "to ", "every ", "screen ", "and ",
          "resumes ", "after ", "a ", "drop ", "of ", "its ", "socket ", "quickly ")  # fmt: skip


async def _write_session(url: str, turns: int, tokens: int, seed: int) -> tuple[str, int, str]:
    """The session: ``turns`` finished turns and a running one (its meta and 3 tokens).
    Its id, its last offset and its whole reply text."""
    rng = random.Random(seed)
    redis = connect(url)
    await redis.initialize()
    try:
        sid = new_session_id()
        pub = Publisher(redis, maxlen=turns * (tokens + 2) + 100)
        text: list[str] = []
        last = 0
        for t in range(turns + 1):
            gen = await pub.open_generation(sid)
            message = "".join(rng.choice(_WORDS) for _ in range(24))
            drafts = [Draft(kind="meta", meta={"role": "user", "message": message})]
            n = tokens if t < turns else 3
            for _ in range(n):  # a coalesced frame: about 8 engine deltas
                delta = "".join(rng.choice(_WORDS) for _ in range(6))
                drafts.append(Draft(kind="token", text=delta, meta={"n": 8}))
                text.append(delta)
            if t < turns:
                done = {"tokens": 8 * tokens, "finish_reason": "stop", "chars": 0,
                        "sha256": "0" * 64}  # fmt: skip
                drafts.append(Draft(kind="done", meta=done))
            last = (await gen.publish(drafts))[-1]
    finally:
        await redis.aclose()
    return sid, last, "".join(text)


def _check(frames: list[dict[str, Any]], last: int, text: str, compact: bool, turns: int) -> None:
    """A join's frames: continuous, the session's text, three per finished turn compacted."""
    prev = 0
    for f in frames:
        meta = f.get("meta") or {}
        first = meta["from"] if f["kind"] == "token" and "merged" in meta else f["offset"]
        if first != prev + 1:
            raise AssertionError(f"offset {first} after {prev}")
        prev = f["offset"]
    if prev != last:
        raise AssertionError(f"ended at {prev}, not {last}")
    if "".join(f["text"] for f in frames if f["kind"] == "token") != text:
        raise AssertionError("the text differs from the session's")
    if compact and len(frames) != 3 * turns + 4:
        raise AssertionError(f"{len(frames)} frames, not 3 per finished turn + the running one")


async def _join_sse(
    http: aiohttp.ClientSession, base: str, sid: str, token: str, last: int, compact: bool
) -> tuple[float, int, list[dict[str, Any]]]:
    """One SSE join from 0: seconds to the last frame, body bytes, the frames."""
    params = {"compact": "1"} if compact else {}
    headers = {"Authorization": f"Bearer {token}", "Last-Event-ID": "0"}
    end = b"id: %d\n" % last
    body = bytearray()
    started = time.perf_counter()
    async with http.get(f"{base}/v1/sessions/{sid}/events", params=params,
                        headers=headers) as resp:  # fmt: skip
        if resp.status != 200:
            raise RuntimeError(f"SSE join refused: {resp.status} {await resp.text()}")
        while end not in body[-(len(end) + 65536) :]:
            chunk = await resp.content.readany()
            if not chunk:
                raise RuntimeError("the SSE stream ended before the last frame")
            body += chunk
        while not body.endswith(b"\n\n"):  # the last event's data line
            body += await resp.content.readany()
        took = time.perf_counter() - started
    events = SSEDecoder().feed(bytes(body))
    frames = [orjson.loads(e.data) for e in events if e.event not in ("hello", "presence")]
    return took, len(body), frames


async def _join_ws(
    http: aiohttp.ClientSession, base: str, sid: str, token: str, last: int, compact: bool
) -> tuple[float, int, list[dict[str, Any]]]:
    """One WebSocket join from 0: seconds to the last frame, message bytes, the frames."""
    params = {"from": "0", "token": token, **({"compact": "1"} if compact else {})}
    frames: list[dict[str, Any]] = []
    size = 0
    started = time.perf_counter()
    async with http.ws_connect(f"{base}/v1/sessions/{sid}/ws", params=params,
                               max_msg_size=0) as ws:  # fmt: skip
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"the WebSocket ended before the last frame: {msg.type}")
            size += len(msg.data)
            f = orjson.loads(msg.data)
            if "kind" not in f or f["kind"] == "presence":
                continue
            frames.append(f)
            if f["offset"] == last:
                break
        took = time.perf_counter() - started
    return took, size, frames


async def measure(url: str, *, turns: int, tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    """Every (transport, mode) joined ``repeats`` times; medians and the checks' counts."""
    sid, last, text = await _write_session(url, turns, tokens, seed)
    token = issue_token(SECRET, sid, 3600, time.time())
    runs: dict[tuple[str, bool], list[tuple[float, int, int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmp:
        async with (
            relay_process(url, Path(tmp), "bench-join", 100) as relay,
            aiohttp.ClientSession() as http,
        ):
            for i in range(repeats + 1):  # the first round warms the relay up, not counted
                for transport in ("sse", "ws"):
                    modes = (True, False) if i % 2 == 0 else (False, True)
                    for compact in modes:
                        join = _join_sse if transport == "sse" else _join_ws
                        cpu0 = cpu_s(relay.pid)
                        took, size, frames = await join(http, relay.base, sid, token, last, compact)
                        cpu = cpu_s(relay.pid) - cpu0
                        _check(frames, last, text, compact, turns)
                        if i:
                            runs.setdefault((transport, compact), []).append(
                                (took, size, len(frames), cpu)
                            )
    rows: list[dict[str, Any]] = []
    for (transport, compact), samples in sorted(
        runs.items(), key=lambda kv: (kv[0][0], not kv[0][1])
    ):
        rows.append({
            "transport": transport,
            "mode": "compact" if compact else "full",
            "frames": samples[0][2],
            "bytes": samples[0][1],
            "join_ms_median": round(statistics.median(s[0] for s in samples) * 1000, 1),
            "join_ms_samples": [round(s[0] * 1000, 1) for s in samples],
            "relay_cpu_ms_median": round(statistics.median(s[3] for s in samples) * 1000),
        })  # fmt: skip
    for r in rows:
        full = next(x for x in rows if x["transport"] == r["transport"] and x["mode"] == "full")
        r["frames_vs_full"] = round(r["frames"] / full["frames"], 3)
        r["bytes_vs_full"] = round(r["bytes"] / full["bytes"], 3)
        r["time_vs_full"] = round(r["join_ms_median"] / full["join_ms_median"], 3)
    return {
        "session": {
            "turns": turns,
            "tokens_per_turn": tokens,
            "offsets": last,
            "seed": seed,
            "running_turn": "meta + 3 token frames",
        },
        "repeats": repeats,
        "rows": rows,
    }


def table(res: dict[str, Any]) -> str:
    """The results as the Markdown table of bench/README.md."""
    out = [
        "| transport | join | frames | bytes | time to join (median ms) | relay CPU (ms) "
        "| frames / bytes / time vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        out.append(
            f"| {r['transport']} | {r['mode']} | {r['frames']:,} | {r['bytes']:,} "
            f"| {r['join_ms_median']:,} | {r['relay_cpu_ms_median']:,} "
            f"| {r['frames_vs_full']} / {r['bytes_vs_full']} / {r['time_vs_full']} |"
        )
    return "\n".join(out)


@dataclass
class Flags(OnCluster):
    turns: int = flag(1000, "finished turns in the session", quick=100, least=1)
    tokens: int = flag(30, "token frames per turn", least=1)
    repeats: int = flag(5, "joins per transport and mode", quick=3, least=1)
    seed: int = flag(0, "the session's text")


def _run(f: Flags) -> Outcome:
    async def run() -> dict[str, Any]:
        async with bench_stack("join-") as st:
            url = await st.cluster(masters=3, replicas=0, url=f.redis)
            return await measure(url, turns=f.turns, tokens=f.tokens, repeats=f.repeats,
                                 seed=f.seed)  # fmt: skip

    res = asyncio.run(run())
    s = res["session"]
    head = (
        f"session: {s['turns']} finished turns x {s['tokens_per_turn']} token frames "
        f"+ a running turn = {s['offsets']:,} offsets; {res['repeats']} joins each"
    )
    return Outcome(res, f"{head}\n{table(res)}")


BENCH = Bench(Flags, _run, prog="python -m bench.relay.join", description=__doc__,
              quick_help="100 turns, 3 repeats")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
