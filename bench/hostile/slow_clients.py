"""Slow clients from one address against one relay while viewers stream.

What it answers: does a crowd of idle and trickling connections from one address
(slowloris on the head, a second head trickled after a request, a body trickled after
a request, a keep-alive connection left idle, a connection that sends nothing) take a
relay's file descriptors or memory, or slow its viewers? It is the hostile-input
table's slow-client rows (RELIABILITY.md) as a measurement, with the HTTP guard of
:mod:`relay.service.httpguard` set to short deadlines so that a run takes seconds.

Participants: a local Redis Cluster (3 masters), one ``tokenrelay relay`` process
(``--insecure-no-auth``, short deadlines, the default per-address cap, its descriptors
limited by ``prlimit`` where installed), and, in this process, ``viewers`` SSE viewers
from 127.0.0.2..127.0.0.9 (10 per session), one publisher per session (a token frame
every 100 ms whose text is its ``time.time_ns()``), and ``attackers`` connections from
127.0.0.1, each repeating one of the five slow kinds until the attack ends (a refused
one, 429, tries again after its ``Retry-After`` of 1 s).

Measured: the viewers' hop latency (publish -> read) before and during the attack
(p50, p99); frames lost, duplicated or out of order, counted against what Redis holds in
each session's backlog; for each attacker kind, attempts, admitted, refused, and how
late the relay closed an admitted one past its deadline (the deadline counted from the
moment it applies: the opening for the first head, the answer for the idle connection
and the second head, the head for the body); the relay's descriptors and RSS before,
at peak during, and after the attack; its ``tokenrelay_relay_http_guard_total``.

Call order: ``python -m bench.hostile.slow_clients [--quick] [--attackers N] [--viewers N]
[--seed S] [--json PATH]`` -> :func:`run` -> :func:`markdown`. Exit 1 when a viewer lost,
repeated or reordered a frame, an admitted attacker outlived its deadline by more than
``SLACK_S``, or the relay's descriptors passed ``viewers + cap + 256``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench._util import percentile, raise_nofile, rss_kb, run_json
from bench.harness import Bench, Common, Outcome, bench_stack, flag
from bench.harness.report import logger
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Publisher, read_backlog
from relay.protocol.frame import decode
from relay.protocol.keys import new_session_id
from relay.protocol.sse_reader import SSEDecoder

__all__ = ["KINDS", "Workload", "add_arguments", "main", "markdown", "run", "run_from_args"]

KINDS: Final = ("silent", "head_trickle", "idle", "second_head", "body_trickle")
SLACK_S: Final = 1.0  # how late past its deadline an admitted attacker may be closed
TICK_S: Final = 0.1  # a viewer's session gets a token frame this often
VIEWER_ADDRESSES: Final = tuple(f"127.0.0.{i}" for i in range(2, 10))
HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


log = logger("slow_clients")


@dataclass
class Workload:
    attackers: int = 5000
    viewers: int = 1000
    quiet_s: float = 4.0  # viewers alone, before the attack
    attack_s: float = 15.0
    head_timeout_s: float = 2.0
    body_timeout_s: float = 2.0
    keepalive_timeout_s: float = 3.0
    trickle_s: float = 0.5  # a trickling attacker sends one byte this often
    max_per_address: int = 512  # the relay's --max-connections-per-address (its default)
    seed: int = 0


@dataclass
class KindStats:
    attempts: int = 0
    admitted: int = 0
    refused: int = 0  # 429 too_many_connections
    reset: int = 0  # closed with no answer read (a reset, or refused before it read)
    late_s: list[float] = field(default_factory=list)  # close - (deadline start + deadline)


@dataclass
class Viewer:
    sid: str
    offsets: list[int] = field(default_factory=list)
    lat_ns: list[tuple[int, int]] = field(default_factory=list)  # (published ns, latency ns)
    error: str = ""


# -- the attackers ---------------------------------------------------------------------


async def _read_status(reader: asyncio.StreamReader) -> bytes:
    """The status code of the next response (b"" if the connection ends first)."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        line = await reader.readuntil(b"\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                       if h.lower().startswith(b"content-length:")), 0)  # fmt: skip
        await reader.readexactly(length)
        return line.split(b" ", 2)[1]
    return b""


async def _until_closed(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """When the relay closed the connection (monotonic), and the first bytes it sent."""
    first = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            first = first or chunk
    return time.monotonic(), first


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float,
                   closed: asyncio.Task[tuple[float, bytes]]) -> None:  # fmt: skip
    for i in range(len(data)):
        if closed.done():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(data[i : i + 1])
        await asyncio.sleep(every_s)


async def _attempt(kind: str, port: int, wl: Workload, stats: KindStats) -> float:
    """One connection of ``kind`` until the relay closes it; the seconds to wait before
    the next (1 after a 429, as its Retry-After says)."""
    stats.attempts += 1
    opened = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        stats.reset += 1
        return 1.0
    try:
        deadline, start = wl.head_timeout_s, opened
        if kind in ("idle", "second_head", "body_trickle"):
            first = HEAD
            if kind == "body_trickle":
                first = HEAD[:-2] + b"Content-Length: 60000\r\n\r\n"
                deadline = wl.body_timeout_s
            writer.write(first)
            status = await _read_status(reader)
            if kind != "body_trickle":
                start = time.monotonic()  # the answer's end: the idle gap starts
                deadline = wl.keepalive_timeout_s if kind == "idle" else wl.head_timeout_s
        else:
            status = b""
        closed = asyncio.create_task(_until_closed(reader))
        if status == b"429":
            stats.refused += 1
            await closed
            return 1.0
        if kind in ("head_trickle", "second_head"):
            await _trickle(writer, HEAD, wl.trickle_s, closed)
        elif kind == "body_trickle" and status == b"200":
            await _trickle(writer, b"a" * 1000, wl.trickle_s, closed)
        closed_at, sent = await closed
        if not status and sent.startswith(b"HTTP/1.1 429 "):  # refused before any request
            stats.refused += 1
            return 1.0
        if (kind in ("silent", "head_trickle") and sent.startswith(b"HTTP/1.1 408")) or (
            status == b"200"
        ):
            stats.admitted += 1
            stats.late_s.append(closed_at - start - deadline)
        else:
            stats.reset += 1
        return 0.0
    finally:
        writer.close()


async def _attacker(i: int, port: int, wl: Workload, stats: dict[str, KindStats],
                    until: float, rng: random.Random) -> None:  # fmt: skip
    kind = KINDS[i % len(KINDS)]
    await asyncio.sleep(rng.uniform(0, 1.0))  # about 1 s to open them all
    while time.monotonic() < until:
        pause = await _attempt(kind, port, wl, stats[kind])
        if pause:
            await asyncio.sleep(pause)


async def attack(port: int, wl: Workload) -> dict[str, Any]:
    """``wl.attackers`` slow connections for ``wl.attack_s``; the report of each kind.
    Runs in a child process (:func:`attack_child`), so that the viewers' loop here
    measures the relay, not the attackers' own event loop."""
    raise_nofile(wl.attackers + 256)
    rng = random.Random(wl.seed)
    stats = {k: KindStats() for k in KINDS}
    until = time.monotonic() + wl.attack_s
    await asyncio.gather(*(_attacker(i, port, wl, stats, until, rng) for i in range(wl.attackers)))
    return _attacker_report(stats)


def attack_child(spec_path: str) -> int:
    """``--attack-spec PATH``: run :func:`attack` from a JSON spec, print its report."""
    spec = json.loads(Path(spec_path).read_text())
    report = asyncio.run(attack(spec["port"], Workload(**spec["workload"])))
    print(json.dumps(report), flush=True)
    return 0


# -- the viewers and the publisher ----------------------------------------------------------


async def _viewer(v: Viewer, port: int, source: str, ready: asyncio.Event,
                  stop: asyncio.Event) -> None:  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(f"GET /v1/sessions/{v.sid}/events?last_event_id=0 HTTP/1.1\r\n"
                     "Host: x\r\n\r\n".encode())  # fmt: skip
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            v.error = head.split(b"\r\n", 1)[0].decode()
            return
        ready.set()
        decoder = SSEDecoder()
        while not stop.is_set():
            chunk = await reader.read(65536)
            if not chunk:
                v.error = v.error or "the stream ended"
                return
            now = time.time_ns()
            for ev in decoder.feed(chunk):
                if ev.event not in ("token", "done") or ev.id is None:
                    continue
                v.offsets.append(int(ev.id))
                if ev.event == "done":
                    return
                text = decode(ev.data.encode()).text
                # chunked framing may split a line of the event: the decoder reads the
                # chunk sizes as lines of no field, which it ignores
                if text.isdigit():
                    v.lat_ns.append((int(text), now - int(text)))
    except (OSError, asyncio.IncompleteReadError) as exc:
        v.error = v.error or repr(exc)
    finally:
        writer.close()


async def _publish(redis: Any, sids: list[str], stop: asyncio.Event) -> None:
    pub = Publisher(redis)
    gens = [await pub.open_generation(sid) for sid in sids]
    while not stop.is_set():
        await asyncio.gather(*(g.token(str(time.time_ns())) for g in gens))
        await asyncio.sleep(TICK_S)
    await asyncio.gather(*(g.done() for g in gens))


# -- the run -----------------------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def run(wl: Workload) -> dict[str, Any]:
    raise_nofile(wl.attackers + wl.viewers * 2 + 1024)
    relay_fds = wl.viewers + wl.max_per_address + 512
    wrap = ("prlimit", f"--nofile={relay_fds}") if shutil.which("prlimit") else ()
    async with bench_stack("slow-clients-") as st:
        url = await st.cluster(masters=3, replicas=0)
        relay = await st.serve("relay", lambda port: [
            *wrap, sys.executable, "-m", "tokenrelay", "relay", "--port", str(port),
            "--redis", url, "--insecure-no-auth", "--relay-id", "slow-bench",
            "--log-level", "WARNING", "--head-timeout-s", str(wl.head_timeout_s),
            "--body-timeout-s", str(wl.body_timeout_s),
            "--keepalive-timeout-s", str(wl.keepalive_timeout_s),
            "--max-connections-per-address", str(wl.max_per_address)], "/readyz")  # fmt: skip
        redis = connect(url)
        st.on_exit(redis.aclose)
        await redis.initialize()
        result = await _measure(wl, redis, relay.port, relay.pid)
        result["relay_log_tracebacks"] = relay.log_path.read_bytes().count(b"Traceback")
    result["workload"] = asdict(wl)
    result["relay_nofile"] = relay_fds if wrap else None
    return result


async def _measure(wl: Workload, redis: Any, port: int, pid: int) -> dict[str, Any]:
    sids = [new_session_id() for _ in range(max(1, wl.viewers // 10))]
    viewers = [Viewer(sids[i % len(sids)]) for i in range(wl.viewers)]
    stop_viewers, stop_publishing = asyncio.Event(), asyncio.Event()
    samples: list[tuple[float, int, int]] = []  # (t, fds, rss kB)
    sem = asyncio.Semaphore(50)

    async def start_viewer(i: int, v: Viewer) -> asyncio.Task[None]:
        """The viewer's task, once its stream is open (or it failed, or 10 s passed)."""
        ready = asyncio.Event()
        async with sem:
            src = VIEWER_ADDRESSES[i % len(VIEWER_ADDRESSES)]
            task = asyncio.create_task(_viewer(v, port, src, ready, stop_viewers))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([task, waiter], timeout=10, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return task

    log(f"{wl.viewers} viewers on {len(sids)} sessions")
    tasks = await asyncio.gather(*(start_viewer(i, v) for i, v in enumerate(viewers)))
    publisher = asyncio.create_task(_publish(redis, sids, stop_publishing))

    async def sample(until: asyncio.Event) -> None:
        while not until.is_set():
            samples.append((time.monotonic(), _fds(pid), rss_kb(pid)))
            await asyncio.sleep(0.25)

    sampling_done = asyncio.Event()
    sampler = asyncio.create_task(sample(sampling_done))
    await asyncio.sleep(wl.quiet_s)
    base_fds, base_rss = _fds(pid), rss_kb(pid)
    attack_ns = time.time_ns()
    log(f"attack: {wl.attackers} connections from 127.0.0.1 for {wl.attack_s:g} s")
    attackers = await run_json(
        [sys.executable, "-m", "bench.hostile.slow_clients", "--attack-spec"],
        {"port": port, "workload": asdict(wl)}, name="attackers", timeout_s=wl.attack_s + 60,
    )  # fmt: skip
    attack_end_ns = time.time_ns()
    await asyncio.sleep(1.0)  # the last attackers' sockets close
    end_fds, end_rss = _fds(pid), rss_kb(pid)
    sampling_done.set()
    await sampler
    stop_publishing.set()
    await publisher
    stop_viewers.set()
    async with asyncio.timeout(10):
        await asyncio.gather(*tasks)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    prefix = "tokenrelay_relay_http_guard_total{"
    guard = {ln.split('reason="')[1].split('"')[0]: int(float(ln.rsplit(" ", 1)[1]))
             for ln in text.splitlines() if ln.startswith(prefix)}  # fmt: skip
    return {
        "viewers": await _viewer_report(viewers, redis, attack_ns, attack_end_ns),
        "attackers": attackers,
        "relay": {
            "fds": {"before": base_fds, "peak": max(s[1] for s in samples), "after": end_fds},
            "rss_kb": {"before": base_rss, "peak": max(s[2] for s in samples), "after": end_rss},
            "fd_bound": wl.viewers + wl.max_per_address + 256,
            "http_guard": guard,
        },
    }


async def _viewer_report(viewers: list[Viewer], redis: Any, attack_ns: int,
                         attack_end_ns: int) -> dict[str, Any]:  # fmt: skip
    stored: dict[str, list[int]] = {}
    for sid in {v.sid for v in viewers}:
        raw, _, _ = await read_backlog(redis, sid, 0, 100_000)
        stored[sid] = [f.offset for f in map(decode, raw) if f.kind in ("token", "done")]
    lost = dup = disorder = 0
    for v in viewers:
        want = stored[v.sid]
        lost += len(set(want) - set(v.offsets))
        dup += len(v.offsets) - len(set(v.offsets))
        disorder += sum(1 for a, b in zip(v.offsets, v.offsets[1:], strict=False) if b <= a)
    quiet = [lat for v in viewers for ts, lat in v.lat_ns if ts < attack_ns]
    attack = [lat for v in viewers for ts, lat in v.lat_ns if attack_ns <= ts < attack_end_ns]

    def ms(values: list[int], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p / 1e6, 2)

    return {
        "count": len(viewers),
        "sessions": len(stored),
        "frames_stored": sum(len(stored[v.sid]) for v in viewers),
        "frames_read": sum(len(v.offsets) for v in viewers),
        "lost": lost,
        "duplicates": dup,
        "out_of_order": disorder,
        "errors": sorted({v.error for v in viewers if v.error}),
        "latency_ms": {
            "quiet": {"p50": ms(quiet, 0.5), "p99": ms(quiet, 0.99), "n": len(quiet)},
            "attack": {"p50": ms(attack, 0.5), "p99": ms(attack, 0.99), "n": len(attack)},
        },
    }


def _attacker_report(stats: dict[str, KindStats]) -> dict[str, Any]:
    kinds = {
        k: {"attempts": s.attempts, "admitted": s.admitted, "refused_429": s.refused,
            "reset": s.reset,
            "late_s_max": round(max(s.late_s), 3) if s.late_s else None,
            "late_s_p99": round(percentile(s.late_s, 0.99, 0.0), 3)}
        for k, s in stats.items()
    }  # fmt: skip
    late = [x for s in stats.values() for x in s.late_s]
    return {
        "attempts": sum(s.attempts for s in stats.values()),
        "admitted": sum(s.admitted for s in stats.values()),
        "refused_429": sum(s.refused for s in stats.values()),
        "late_s_max": round(max(late), 3) if late else None,
        "kinds": kinds,
    }


def verdict(result: dict[str, Any]) -> list[str]:
    """What failed (empty: the relay held)."""
    v, a, r = result["viewers"], result["attackers"], result["relay"]
    bad = []
    if v["lost"] or v["duplicates"] or v["out_of_order"] or v["errors"]:
        bad.append(f"viewers: lost {v['lost']}, duplicates {v['duplicates']}, "
                   f"out of order {v['out_of_order']}, errors {v['errors']}")  # fmt: skip
    if a["late_s_max"] is not None and a["late_s_max"] > SLACK_S:
        bad.append(f"an attacker outlived its deadline by {a['late_s_max']} s")
    if r["fds"]["peak"] > r["fd_bound"]:
        bad.append(f"relay fds peaked at {r['fds']['peak']} > {r['fd_bound']}")
    if result.get("relay_log_tracebacks"):
        bad.append("tracebacks in the relay's log")
    return bad


def markdown(result: dict[str, Any]) -> str:
    v, a, r, wl = result["viewers"], result["attackers"], result["relay"], result["workload"]
    q, t = v["latency_ms"]["quiet"], v["latency_ms"]["attack"]
    lines = [
        f"{wl['attackers']} slow connections from one address, {v['count']} viewers on "
        f"{v['sessions']} sessions, deadlines head {wl['head_timeout_s']:g} s / body "
        f"{wl['body_timeout_s']:g} s / idle {wl['keepalive_timeout_s']:g} s",
        "",
        "| viewers | p50 ms | p99 ms | frames read / stored | lost | duplicates |",
        "|---|---|---|---|---|---|",
        f"| before the attack | {q['p50']} | {q['p99']} | | | |",
        f"| during the attack | {t['p50']} | {t['p99']} | {v['frames_read']} / "
        f"{v['frames_stored']} | {v['lost']} | {v['duplicates']} |",
        "",
        "| attacker kind | attempts | admitted | 429 | closed past its deadline, max s |",
        "|---|---|---|---|---|",
    ]
    for k, s in a["kinds"].items():
        lines.append(f"| {k} | {s['attempts']} | {s['admitted']} | {s['refused_429']} | "
                     f"{s['late_s_max']} |")  # fmt: skip
    lines += [
        "",
        f"relay fds before / peak / after: {r['fds']['before']} / {r['fds']['peak']} / "
        f"{r['fds']['after']} (bound {r['fd_bound']}); RSS kB {r['rss_kb']['before']} / "
        f"{r['rss_kb']['peak']} / {r['rss_kb']['after']}; http_guard {r['http_guard']}",
    ]
    return "\n".join(lines)


@dataclass
class Flags(Common):
    attackers: int = flag(5000, "slow connections from one address", quick=500, least=1)
    viewers: int = flag(1000, "SSE viewers, 10 per session", quick=100, least=1)
    seed: int = flag(0, "the attackers' start jitter")
    attack_spec: Path | None = flag(None, "the attackers' child", hidden=True)


def measure(f: Flags) -> Outcome | int:
    if f.attack_spec:
        return attack_child(str(f.attack_spec))
    wl = Workload(quiet_s=3.0, attack_s=8.0) if f.quick else Workload()
    wl.seed, wl.attackers, wl.viewers = f.seed, f.attackers, f.viewers
    result = asyncio.run(run(wl))
    bad = verdict(result)
    for line in bad:
        log(line)
    return Outcome(result, markdown(result), 1 if bad else 0)


BENCH = Bench(Flags, measure, prog="python -m bench.hostile.slow_clients",
              description="Slow clients from one address against one relay while viewers stream.",
              quick_help="500 attackers, 100 viewers (< 1 min)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
