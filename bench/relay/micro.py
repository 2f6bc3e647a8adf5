"""The relay's own Python cost per frame, without sockets: how much of the CPU per frame
of :mod:`bench.relay.throughput` is the relay's code and how much the kernel's.

A real :class:`relay.edge.fanout.hub.Hub` on the in-memory broker
(:class:`relay.broker.memory.MemoryBroker`: no server to start, and none would be on
the measured path, which never calls the broker) opens ``--sessions`` live SSE
connections (:class:`relay.edge.conn.sse.SseConn`: subscribed, bounds read), each
attached to a transport that only counts bytes and metered with the server's own
metrics (:class:`relay.edge.metrics.OutMeter`). Then the hub's reader callback
(``Hub._on_message``, what a read chunk from Redis calls) is fed ``--frames`` encoded
token frames, ``--per-chunk`` per call, each to the next session in turn, in order: the
same code path as a live frame, from the parsed ``smessage`` to ``transport.write``,
minus the parse and the system call.

``python -m bench.relay.micro [--quick] [--json PATH] [--seed N]`` prints µs per frame
(best of ``--repeats`` runs, and the median): ``hub_us_per_frame``. With ``--profile``
it prints cProfile's top functions of one more run (their times include cProfile's own
overhead, several times the code's: read them as shares, not as µs).
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import random
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.harness import Bench, Common, Outcome, flag
from relay.broker.memory import MemoryBroker
from relay.edge.conn.sse import SseConn
from relay.edge.fanout.hub import Hub
from relay.edge.metrics import OutMeter, RelayMetrics
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, encode
from relay.protocol.keys import live_channel, new_session_id

__all__ = ["CountingTransport", "add_arguments", "main", "measure", "run_from_args"]


class CountingTransport:
    """A transport that takes every write and keeps only the byte count."""

    def __init__(self) -> None:
        self.bytes = 0
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0


def _relative(text: str) -> str:
    """Profile lines with the checkout's and the interpreter's directories left out."""
    for d in sorted({str(Path(__file__).resolve().parents[2]), sysconfig.get_paths()["stdlib"]},
                    key=len, reverse=True):  # fmt: skip
        text = text.replace(d + "/", "")
    return text


def _frames(sids: list[str], n: int, gen: str, offsets: dict[str, int]) -> list[list[bytes]]:
    """``n`` token frames, one per session in turn, each session's offsets going on from
    ``offsets`` (updated)."""
    out: list[list[bytes]] = []
    ts = int(time.time() * 1000)
    for i in range(n):
        sid = sids[i % len(sids)]
        offsets[sid] += 1
        f = Frame(
            session=sid, turn=1, offset=offsets[sid], kind="token",
            text=f"{time.time_ns():019d};", epoch=1, ts=ts, meta={"gen": gen},
        )  # fmt: skip
        out.append([b"smessage", live_channel(sid).encode(), encode(f)])
    return out


async def measure(
    sessions: int, frames: int, per_chunk: int, repeats: int, profile: bool, seed: int
) -> dict[str, Any]:
    # no screen counts: what is measured is the frames' path (a count is written when a
    # screen joins or leaves, never per frame)
    hub = Hub(MemoryBroker("bench-micro"), reap_after_s=3600, screens_interval_s=0)
    await hub.start()
    sent = OutMeter(RelayMetrics("bench-micro"), "sse").sent
    transports: list[CountingTransport] = []
    conns: list[SseConn] = []
    try:
        sids = [new_session_id() for _ in range(sessions)]
        for sid in sids:
            conn = SseConn(hub, sid, None, sent=sent, write_timeout_s=30.0)
            await hub.open(conn)
            t = CountingTransport()
            conn.chunked = True  # an HTTP/1.1 SSE response: every write is one chunk
            conn.attach(cast(Any, t))
            transports.append(t)
            conns.append(conn)
        random.Random(seed).shuffle(sids)  # the order frames go round the sessions
        offsets = dict.fromkeys(sids, 0)
        runs: list[float] = []
        prof_text = ""
        on_message = hub._on_message  # what the shard reader calls per read chunk
        for r in range(repeats + (1 if profile else 0)):
            batch = _frames(sids, frames, "bench", offsets)
            chunks = [batch[i : i + per_chunk] for i in range(0, len(batch), per_chunk)]
            prof = cProfile.Profile() if profile and r == repeats else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            for chunk in chunks:
                on_message(chunk)
            if prof is not None:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
                prof_text = _relative(s.getvalue())
            else:
                runs.append((time.perf_counter() - t0) / frames * 1e6)
        written = sum(t.writes for t in transports)
    finally:
        for conn in conns:
            conn.shut("done", CloseCode.CLOSED)
        await hub.close()
    return {
        "sessions": sessions,
        "frames": frames,
        "per_chunk": per_chunk,
        "repeats": repeats,
        "hub_us_per_frame": round(min(runs), 2),
        "hub_us_per_frame_median": round(statistics.median(runs), 2),
        "runs_us_per_frame": [round(x, 2) for x in runs],
        "socket_writes": written,
        "profile": prof_text,
    }


@dataclass
class Flags(Common):
    seed: int = flag(0, "shuffles the sessions' order")
    sessions: int = flag(1_000, "watched sessions", least=1)
    frames: int = flag(300_000, "frames per run", quick=100_000, least=1)
    per_chunk: int = flag(2, "frames per read chunk", least=1)
    repeats: int = flag(5, "runs", quick=3, least=1)
    profile: bool = flag(False, "cProfile one more run")


def _run(f: Flags) -> Outcome:
    res = asyncio.run(measure(f.sessions, f.frames, f.per_chunk, f.repeats, f.profile, f.seed))
    prof = res.pop("profile")
    text = (
        f"hub_us_per_frame {res['hub_us_per_frame']} (median {res['hub_us_per_frame_median']};"
        f" runs {res['runs_us_per_frame']}), {res['sessions']:,} sessions,"
        f" {res['per_chunk']} frames per read chunk, {res['socket_writes']:,} socket writes"
    )
    return Outcome(res, text + (f"\n{prof}" if prof else ""))


BENCH = Bench(Flags, _run, prog="python -m bench.relay.micro", description=__doc__,
              quick_help="100,000 frames, 3 runs")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
