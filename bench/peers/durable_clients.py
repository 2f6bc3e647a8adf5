"""The Durable Streams side of :mod:`bench.peers.durable`'s load: writers and readers
speaking the protocol over HTTP (aiohttp, this process), the same for every system.

- :func:`create`: ``PUT`` a stream (its content type), returning its tail offset;
- :func:`append_loop`: appends back to back on one stream until a deadline (throughput);
- :func:`paced_writer`: ``rate`` appends/s spread over streams, each a JSON message
  ``{"t": time.time_ns(), "p": padding}`` (the stamp the readers' latency is taken from);
- :func:`catch_up`: ``GET ?offset=`` from ``-1`` following ``Stream-Next-Offset`` until
  ``Stream-Up-To-Date``, the bytes counted;
- :func:`sse_reader` / :func:`longpoll_reader`: live readers from a given offset,
  counting every message they receive into a :class:`Tally`; the SSE reader reconnects
  from the last control event's ``streamNextOffset`` when the server closes it.

Every request sends ``Accept-Encoding: identity``, so no side spends CPU compressing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = [
    "Tally",
    "append_loop",
    "catch_up",
    "create",
    "held",
    "longpoll_reader",
    "paced_writer",
    "send",
    "sse_reader",
    "stop_readers",
]

JSON = "application/json"
IDENTITY = {"Accept-Encoding": "identity"}
# below Node's 5 s keep-alive timeout: a pooled connection the server is closing is
# never reused for a POST (aiohttp does not retry a POST that met a reset)
KEEPALIVE_S = 2.0


@dataclass
class Tally:
    """What the readers received: messages, one-way latencies (ns, with send time), errors."""

    received: int = 0
    latencies: list[tuple[int, int]] = field(default_factory=list)  # (sent ns, latency ns)
    errors: list[str] = field(default_factory=list)
    first: float = 0.0  # perf_counter of the first and last delivery
    last: float = 0.0
    requests: int = 0  # HTTP requests the readers made (long-poll: one per answer)

    def got(self, messages: Sequence[Any]) -> None:
        now_ns, now = time.time_ns(), time.perf_counter()
        if not self.received:
            self.first = now
        self.last = now
        for m in messages:
            self.received += 1
            if isinstance(m, dict) and isinstance(m.get("t"), int):
                self.latencies.append((m["t"], now_ns - m["t"]))

    def latencies_ms(self, after_ns: int) -> list[float]:
        return [lat / 1e6 for sent, lat in self.latencies if sent >= after_ns]


async def create(http: aiohttp.ClientSession, url: str, content_type: str = JSON) -> str:
    """``PUT`` the stream at ``url``; its tail offset (``Stream-Next-Offset``)."""
    async with http.put(url, headers={"Content-Type": content_type, **IDENTITY}) as r:
        await r.read()
        if r.status not in (200, 201):
            raise RuntimeError(f"PUT {url}: {r.status} {await r.text()}")
        return r.headers.get("Stream-Next-Offset", "-1")


async def send(
    http: aiohttp.ClientSession, url: str, body: bytes, content_type: str = JSON
) -> None:
    async with http.post(url, data=body, headers={"Content-Type": content_type, **IDENTITY}) as r:
        await r.read()
        if r.status not in (200, 204):
            raise RuntimeError(f"POST {url}: {r.status} {await r.text()}")


async def append_loop(
    http: aiohttp.ClientSession, url: str, body: bytes, until: float, content_type: str = JSON
) -> tuple[int, list[str]]:
    """Append ``body`` to ``url`` back to back until ``until`` (perf_counter): acks, errors."""
    acks, errors = 0, []
    while time.perf_counter() < until:
        try:
            await send(http, url, body, content_type)
            acks += 1
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as e:
            errors.append(str(e)[:200])
            await asyncio.sleep(0.01)
    return acks, errors


async def paced_writer(
    http: aiohttp.ClientSession, urls: Sequence[str], rate: float, seconds: float, pad: int
) -> dict[str, Any]:
    """``rate`` JSON messages/s over ``urls`` (round robin, a 10 ms tick) for ``seconds``:
    sent, acked (the appends the server acknowledged), failed, errors, seconds."""
    tick, sent, errors, due = 0.01, 0, [], 0.0
    padding = "x" * pad
    pending: set[asyncio.Task[None]] = set()
    done: list[asyncio.Task[None]] = []

    def finished(task: asyncio.Task[None]) -> None:
        pending.discard(task)
        if not task.cancelled():
            done.append(task)

    t0 = time.perf_counter()
    i = 0
    while (now := time.perf_counter()) - t0 < seconds:
        due = min(rate * (now - t0), rate * seconds)
        while sent < due:
            body = json.dumps({"t": time.time_ns(), "p": padding}).encode()
            task = asyncio.create_task(send(http, urls[i % len(urls)], body))
            pending.add(task)
            task.add_done_callback(finished)
            sent += 1
            i += 1
        await asyncio.sleep(tick)
    results = await asyncio.gather(*pending, return_exceptions=True)
    errors = [str(e)[:200] for e in results if isinstance(e, BaseException)]
    failed = sum(1 for t in done if t.exception() is not None)
    return {"sent": sent, "acked": sent - failed, "failed": failed, "errors": errors,
            "seconds": time.perf_counter() - t0}  # fmt: skip


async def catch_up(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """Read ``url`` from ``-1`` to its tail: (bytes, requests)."""
    offset, total, requests = "-1", 0, 0
    while True:
        async with http.get(url, params={"offset": offset}, headers=IDENTITY) as r:
            body = await r.read()
            requests += 1
            if r.status != 200:
                raise RuntimeError(f"GET {url}?offset={offset}: {r.status} {body[:200]!r}")
            total += len(body)
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return total, requests


async def held(http: aiohttp.ClientSession, url: str) -> int:
    """How many messages the JSON stream at ``url`` holds (catch-up reads from ``-1``)."""
    offset, count = "-1", 0
    while True:
        async with http.get(url, params={"offset": offset}, headers=IDENTITY) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {url}?offset={offset}: {r.status} {body[:200]!r}")
            count += len(_messages(body))
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return count


def _messages(payload: bytes) -> list[Any]:
    got = json.loads(payload) if payload.strip() else []
    return got if isinstance(got, list) else [got]


async def sse_reader(
    http: aiohttp.ClientSession, url: str, offset: str, tally: Tally, ready: asyncio.Event
) -> None:
    """Follow ``url`` live over SSE from ``offset`` until cancelled; ``ready`` is set once
    the first response's headers came."""
    while True:
        try:
            params = {"offset": offset, "live": "sse"}
            async with http.get(url, params=params, headers=IDENTITY) as r:
                tally.requests += 1
                if r.status != 200:
                    raise RuntimeError(f"SSE {url}: {r.status} {(await r.read())[:200]!r}")
                ready.set()
                event, data = "", []
                async for raw in r.content:
                    line = raw.rstrip(b"\r\n")
                    if line.startswith(b"event:"):
                        event = line[6:].strip().decode()
                    elif line.startswith(b"data:"):
                        data.append(line[5:].removeprefix(b" "))
                    elif not line and (event or data):
                        payload = b"\n".join(data)
                        if event == "data":
                            tally.got(_messages(payload))
                        elif event == "control":
                            ctl = json.loads(payload)
                            offset = ctl.get("streamNextOffset", offset)
                            if ctl.get("streamClosed"):
                                return
                        event, data = "", []
        except (aiohttp.ClientError, RuntimeError, ValueError) as e:
            tally.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(0.1)


async def longpoll_reader(
    http: aiohttp.ClientSession, url: str, offset: str, tally: Tally, ready: asyncio.Event
) -> None:
    """Follow ``url`` with long-polls from ``offset`` until cancelled; ``ready`` is set
    once the first request is on its way."""
    cursor: str | None = None
    while True:
        params = {"offset": offset, "live": "long-poll"}
        if cursor:
            params["cursor"] = cursor
        try:
            ready.set()
            async with http.get(url, params=params, headers=IDENTITY) as r:
                body = await r.read()
                tally.requests += 1
                if r.status not in (200, 204):
                    raise RuntimeError(f"long-poll {url}: {r.status} {body[:200]!r}")
                offset = r.headers.get("Stream-Next-Offset", offset)
                cursor = r.headers.get("Stream-Cursor", cursor)
                if r.status == 200:
                    tally.got(_messages(body))
                if r.headers.get("Stream-Closed") == "true":
                    return
        except (aiohttp.ClientError, RuntimeError, ValueError) as e:
            tally.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(0.1)


async def stop_readers(tasks: Sequence[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


# -- the writer child: python -m bench.peers.durable_clients SPEC.json --------------------


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """``append``: ``concurrency`` loops over ``urls`` for ``seconds``; ``paced``:
    :func:`paced_writer`. One JSON result: acks or sent, errors, seconds, cpu_s."""
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=120)
    cpu0 = _self_cpu()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        if spec["mode"] == "append":
            body = json.dumps({"p": "x" * int(spec["pad"])}).encode()
            urls = spec["urls"]
            t0 = time.perf_counter()
            until = t0 + float(spec["seconds"])
            loops = [append_loop(http, urls[i % len(urls)], body, until)
                     for i in range(int(spec["concurrency"]))]  # fmt: skip
            done = await asyncio.gather(*loops)
            out: dict[str, Any] = {
                "acks": sum(a for a, _ in done),
                "errors": [e for _, errs in done for e in errs][:20],
                "seconds": time.perf_counter() - t0,
            }
        else:
            out = await paced_writer(
                http, spec["urls"], float(spec["rate"]), float(spec["seconds"]), int(spec["pad"])
            )
            out["errors"] = out["errors"][:20]
    out["cpu_s"] = _self_cpu() - cpu0
    return out


def _self_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str] | None = None) -> None:
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    print(json.dumps(asyncio.run(_child(spec))), flush=True)


if __name__ == "__main__":
    main()
