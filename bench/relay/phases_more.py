"""The newer phases of :mod:`bench.relay.throughput`, in a module of their own.

- :func:`raw_hiredis_phase`: the project's own per-node hiredis reader
  (:class:`relay.broker.rediscluster.subscriber.ShardedSubscriber`, nothing behind it: no hub,
  no sockets) in a child process, SSUBSCRIBEd to K sessions of one master, SIGSTOPped while a
  publisher writes F frames per session, then continued: messages / seconds from its first read to
  its last (the same drain as the redis-py ceiling).
- :func:`idle_ws_phase`: VmRSS of a fresh relay before and after N idle WebSocket
  connections (a raw-socket handshake each, one session each), per connection.
- :func:`replay_phase`: one session of 10,000 frames, replayed from offset 0 by 50 SSE
  clients at once: frames delivered / wall seconds, and the relay's peak VmRSS
  (``VmHWM`` of a relay process started for this phase).
- :func:`profiled` samples the relay with py-spy while a phase runs (``--profile DIR``)
  and :func:`summarize_profile` ranks functions by the share of samples in which they
  are on the CPU themselves (self) and on the stack (total).
- :func:`loop_lag` reads the relay's ``tokenrelay_relay_loop_lag_seconds`` histogram
  (how late a 10 ms timer fired) and, given the buckets before and after a phase, says
  the longest event-loop turn seen during it (as the bucket bound it falls under).

Each takes the relay's pid and port and the publisher runner of
:mod:`bench.relay.harness`. Child processes are started and stopped (by pid) with
:mod:`devstack.procs`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from bench._util import rss_kb
from devstack.procs import Proc, ProcError, log_line
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.auth import issue_token
from relay.protocol.keys import live_channel

__all__ = [
    "idle_ws_phase",
    "loop_lag",
    "main",
    "profiled",
    "raw_hiredis_phase",
    "relay_view",
    "replay_phase",
    "summarize_profile",
    "ws_open",
]

Publish = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
_LAG = re.compile(r'^tokenrelay_relay_loop_lag_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$')


# -- the hiredis reader alone ----------------------------------------------------------------


async def _hiredis_reader(url: str, sids: list[str], expected: int) -> None:
    """Child process: subscribe, say ``ready``, count messages until ``expected``."""
    redis = connect(url)
    await redis.initialize()
    got = 0
    first = last = 0.0
    done = asyncio.Event()

    def on_message(msgs: list[list[bytes]]) -> None:
        nonlocal got, first, last
        now = time.perf_counter()
        if got == 0:
            first = now
        got += len(msgs)
        last = now
        if got >= expected:
            done.set()

    sub = ShardedSubscriber(
        redis, on_message=on_message, on_resubscribed=lambda _: None, relay_id="bench-hiredis"
    )
    await sub.start()
    try:
        await sub.subscribe([live_channel(s) for s in sids])
        print("ready", flush=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(120):
                await done.wait()
        print(json.dumps({"received": got, "seconds": last - first}), flush=True)
    finally:
        await sub.close()
        await redis.aclose()


async def raw_hiredis_phase(
    url: str, sids: list[str], frames: int, publish: Publish
) -> dict[str, Any]:
    expected = len(sids) * frames
    with tempfile.TemporaryDirectory(prefix="relay-bench-hiredis-") as tmp:
        spec, log = Path(tmp) / "spec.json", Path(tmp) / "reader.log"
        spec.write_text(json.dumps({"url": url, "sids": sids, "expected": expected}))
        argv = [sys.executable, "-m", "bench.relay.phases_more", "--_hiredis", str(spec)]
        proc = Proc.start(argv, log=log, name="hiredis reader")
        try:
            await proc.ready(log_line("ready"), timeout_s=60)
            proc.send(signal.SIGSTOP)
            try:
                pub = await publish(
                    {"mode": "flood", "url": url, "sids": sids, "frames": frames, "batch": 50}
                )
            finally:
                proc.send(signal.SIGCONT)
            if await proc.wait(150) != 0:
                raise ProcError(proc.why())
            out = json.loads(log.read_text().strip().splitlines()[-1])
        finally:
            await proc.stop()
    took = float(out["seconds"])
    return {
        "sessions": len(sids),
        "sent": pub["sent"],
        "received": out["received"],
        "lost": pub["sent"] - out["received"],
        "seconds": round(took, 3),
        "msgs_per_s": round(out["received"] / took) if took > 0 else 0,
    }


# -- idle WebSocket connections ---------------------------------------------------------------


async def _answer_pings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the server's frames; answer each ping with a pong (masked, as a client's)."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            b0, b1 = await reader.readexactly(2)
            n = b1 & 0x7F
            if n >= 126:
                n = int.from_bytes(await reader.readexactly(2 if n == 126 else 8), "big")
            payload = await reader.readexactly(n)
            if b0 & 0x0F == 0x9 and n < 126:
                mask = os.urandom(4)
                body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                writer.write(bytes((0x8A, 0x80 | n)) + mask + body)


async def ws_open(
    port: int, sid: str, secret: str, pongs: set[asyncio.Task[None]] | None = None
) -> asyncio.StreamWriter:
    """A WebSocket stream past the relay's hello; with ``pongs``, a task (added to the
    set) keeps answering the relay's pings, as a browser does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    token = issue_token(secret, sid, 3600, time.time())
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /v1/sessions/{sid}/ws?token={token} HTTP/1.1\r\nHost: bench\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {key}\r\n\r\n".encode()
    )
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(head[:200].decode(errors="replace"))
        b0, b1 = await reader.readexactly(2)  # the hello: one unmasked text frame
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(await reader.readexactly(2), "big")
        hello = await reader.readexactly(n)
    if b0 != 0x81 or b'"hello"' not in hello:
        raise ConnectionError(f"no hello: {hello[:100]!r}")
    if pongs is not None:
        pongs.add(asyncio.create_task(_answer_pings(reader, writer)))
    return writer


async def idle_ws_phase(
    pid: int, port: int, sids: Sequence[str], secret: str, window: int
) -> dict[str, Any]:
    warm = await ws_open(port, sids[0], secret)
    await asyncio.sleep(1.5)
    before = rss_kb(pid)
    sem = asyncio.Semaphore(window)

    async def one(sid: str) -> asyncio.StreamWriter:
        async with sem:
            return await ws_open(port, sid, secret)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in sids[1:]), return_exceptions=True)
    took = time.perf_counter() - t0
    writers = [r for r in results if isinstance(r, asyncio.StreamWriter)]
    try:
        bad = [r for r in results if isinstance(r, BaseException)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(results)} WebSockets failed: {bad[0]!r}")
        await asyncio.sleep(2.0)
        after = rss_kb(pid)
    finally:
        for w in [warm, *writers]:
            w.transport.abort()
    n = len(writers)
    return {
        "connections": n,
        "open_seconds": round(took, 2),
        "rss_before_kb": before,
        "rss_after_kb": after,
        "kb_per_conn": round((after - before) / n, 2) if n else 0.0,
    }


# -- replay --------------------------------------------------------------------------------------


async def _publish_session(url: str, sid: str, frames: int) -> int:
    redis = connect(url)
    await redis.initialize()
    try:
        gen = await Publisher(redis).open_generation(sid)
        last = 0
        for i in range(0, frames, 100):
            drafts = [
                Draft(kind="token", text=f"token {j} ") for j in range(i, min(i + 100, frames))
            ]
            last = (await gen.publish(drafts))[-1]
        return last
    finally:
        await redis.aclose()


async def _replay_client(port: int, sid: str, secret: str, last: int) -> tuple[int, str]:
    """Read an SSE replay from 0 until ``id: last``; (events seen, how it ended).

    A raw socket counting ``id:`` lines, not :class:`relay.protocol.sse_reader.SSEDecoder`:
    it measures how fast the relay writes a backlog, so the reader must cost next to
    nothing next to it (50 of them share a core with the relay)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    token = issue_token(secret, sid, 3600, time.time())
    writer.write(
        f"GET /v1/sessions/{sid}/events?token={token} HTTP/1.1\r\nHost: bench\r\n"
        "Last-Event-ID: 0\r\n\r\n".encode()
    )
    end = f"id: {last}\n".encode()
    events = 0
    tail = b""
    try:
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return events, "closed by the relay"
            buf = tail + chunk
            events += buf.count(b"\nid: ") - tail.count(b"\nid: ")
            if end in buf:
                return events, "complete"
            if b": close " in buf:
                return events, buf[buf.index(b": close ") :].split(b"\n", 1)[0].decode()
            tail = buf[-64:]
    finally:
        writer.transport.abort()


async def replay_phase(
    url: str, pid: int, port: int, sid: str, secret: str, frames: int, clients: int
) -> dict[str, Any]:
    last = await _publish_session(url, sid, frames)
    before = rss_kb(pid)
    t0 = time.perf_counter()
    async with asyncio.timeout(180):
        results = await asyncio.gather(
            *(_replay_client(port, sid, secret, last) for _ in range(clients))
        )
    took = time.perf_counter() - t0
    delivered = sum(n for n, _ in results)
    ends: dict[str, int] = {}
    for _, how in results:
        ends[how] = ends.get(how, 0) + 1
    return {
        "frames": last,
        "clients": clients,
        "complete": ends.get("complete", 0),
        "endings": ends,
        "delivered": delivered,
        "seconds": round(took, 3),
        "frames_per_s": round(delivered / took) if took > 0 else 0,
        "rss_before_kb": before,
        "rss_peak_kb": rss_kb(pid, "VmHWM"),
    }


# -- the relay's event-loop lag ----------------------------------------------------------------------  # noqa: E501


def loop_lag(before: str, after: str) -> dict[str, Any]:
    """From two ``/metrics`` texts: timer samples during the phase, how many were more than
    1 ms late, and the bucket bound (ms) under which the latest one fell."""

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for line in text.splitlines():
            m = _LAG.match(line)
            if m:
                out[float(m.group(1))] = float(m.group(2))
        return out

    b, a = buckets(before), buckets(after)
    if not a:
        return {"samples": 0, "over_1ms": 0, "max_ms_at_most": None}
    bounds = sorted(a)
    diff = {le: a[le] - b.get(le, 0.0) for le in bounds}
    total = diff[bounds[-1]]
    over_1ms = total - diff.get(0.001, 0.0)
    top = next((le for le in bounds if diff[le] >= total), bounds[-1])
    return {
        "samples": int(total),
        "over_1ms": int(over_1ms),
        "max_ms_at_most": None if top == float("inf") else top * 1000,
    }


_SAMPLE = re.compile(r"^(tokenrelay_relay_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$")
_VIEW_HISTOGRAMS = {
    "publish_to_edge": ("tokenrelay_relay_publish_to_edge_seconds", ""),
    "edge_to_socket": ("tokenrelay_relay_edge_to_socket_seconds", 'transport="sse"'),
    "hop_latency": ("tokenrelay_relay_hop_latency_seconds", 'transport="sse"'),
}


def relay_view(before: str, after: str) -> dict[str, Any]:
    """What the relay saw during a phase, from two ``/metrics`` texts: live frames per
    read of a shard connection, frames per socket write, and the bucket bounds (ms)
    under which the median and the 99th percentile of its own latency histograms fell
    (producer -> read by the relay, read -> written, producer -> written; SSE)."""

    def samples(text: str) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
        return out

    b, a = samples(before), samples(after)

    def diff(name: str, labels: str = "") -> float:
        return a.get((name, labels), 0.0) - b.get((name, labels), 0.0)

    frames = diff("tokenrelay_relay_hub_frames_in_total")
    reads = diff("tokenrelay_relay_hub_reads_total")
    writes = diff("tokenrelay_relay_hub_writes_direct_total") + diff(
        "tokenrelay_relay_hub_writes_queued_total"
    )
    written = diff("tokenrelay_relay_frames_out_total", '{transport="sse"}') + diff(
        "tokenrelay_relay_frames_out_total", '{transport="ws"}'
    )
    view: dict[str, Any] = {
        "frames_in": int(frames),
        "reads": int(reads),
        "frames_per_read": round(frames / reads, 2) if reads else None,
        "frames_written": int(written),
        "socket_writes": int(writes),
        "frames_per_write": round(written / writes, 2) if writes else None,
    }
    for key, (name, label) in _VIEW_HISTOGRAMS.items():
        buckets: list[tuple[float, float]] = []
        for (n, labels), value in a.items():
            if n != name + "_bucket" or (label and label not in labels):
                continue
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                buckets.append((float(le.group(1)), value - b.get((n, labels), 0.0)))
        buckets.sort()
        total = buckets[-1][1] if buckets else 0.0
        view[key] = {
            "count": int(total),
            "p50_ms_at_most": _bucket_at(buckets, 0.5 * total),
            "p99_ms_at_most": _bucket_at(buckets, 0.99 * total),
        }
    return view


def _bucket_at(buckets: list[tuple[float, float]], n: float) -> float | None:
    """The first bucket bound (ms) whose cumulative count reaches ``n``."""
    bound = next((le for le, count in buckets if count >= n), None)
    return None if bound is None or bound == float("inf") else bound * 1000


@contextlib.asynccontextmanager
async def profiled(pid: int, path: Path | None, seconds: float, *, native: bool = False) -> Any:
    """Sample ``pid`` with py-spy (raw collapsed stacks to ``path``) while the body runs;
    ``native``: with C frames (py-spy then pauses the process for each sample)."""
    if path is None:
        yield
        return
    spy = Path(sys.executable).with_name("py-spy")
    how = ["--native"] if native else ["--nonblocking"]
    proc = Proc.start(
        [str(spy), "record", "--format", "raw", "--rate", "250",
         "--duration", str(int(seconds)), *how, "--pid", str(pid),
         "--output", str(path)],
        log=None, name="py-spy",
    )  # fmt: skip
    try:
        yield
        await proc.wait(seconds + 15)
    finally:
        await proc.stop()


_IDLE = ("epoll_wait", "epoll_pwait", "select", "poll")  # a loop waiting: not CPU


def _function(frame: str) -> str:
    """``name (path/file.py:line)`` -> ``name file.py`` (lines of one function merged)."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1].split(":")[0]
    return f"{name} {where}" if where else name


def summarize_profile(path: Path, top: int = 12) -> list[dict[str, Any]]:
    """Functions by self share of the samples in which the relay was busy (a sample
    whose innermost frame is a wait in ``epoll`` & co. is idle, shown apart as
    ``(idle)``), and by total share (the function on the stack)."""
    self_n: dict[str, int] = {}
    total_n: dict[str, int] = {}
    samples = idle = 0
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_function(f) for f in stack.split(";")]
        if frames[-1].split(" ")[0] in _IDLE:  # (a sample of the process waiting)
            idle += n
            continue
        samples += n
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            total_n[f] = total_n.get(f, 0) + n
    ranked = sorted(self_n, key=lambda f: -self_n[f])[:top]
    out = [
        {
            "function": f,
            "self_pct": round(100 * self_n[f] / samples, 1),
            "total_pct": round(100 * total_n[f] / samples, 1),
        }
        for f in ranked
    ]
    if idle:
        share = round(100 * idle / (idle + samples), 1)
        out.append({"function": "(idle)", "self_pct": share, "total_pct": share})
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_hiredis":
        spec = json.loads(Path(sys.argv[2]).read_text())
        asyncio.run(_hiredis_reader(spec["url"], spec["sids"], spec["expected"]))
        return
    raise SystemExit("usage: this module is run by bench.relay.throughput")


if __name__ == "__main__":
    main()
