"""The instruments that read the relay under test during a phase of
:mod:`bench.relay.throughput` (they measure nothing by themselves):

- :func:`metrics_text`: the relay's ``/metrics`` text, read before and after a phase;
- :func:`loop_lag`: from two such texts, the relay's ``tokenrelay_relay_loop_lag_seconds``
  histogram (how late a 10 ms timer fired): samples during the phase, how many were more
  than 1 ms late, and the longest event-loop turn seen (as the bucket bound it falls
  under);
- :func:`relay_view`: from the same two texts, what the relay saw: live frames per read of
  a shard connection, frames per socket write, and where the median and the 99th
  percentile of its own latency histograms fell;
- :func:`profiled` samples the relay with py-spy while a phase runs (``--profile DIR``)
  and :func:`summarize_profile` ranks functions by the share of samples in which they
  are on the CPU themselves (self) and on the stack (total).

py-spy is started and stopped (by pid) with :mod:`devstack.procs`.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp

from bench.relay.harness import RelayProc
from devstack.procs import Proc

__all__ = ["loop_lag", "metrics_text", "profiled", "relay_view", "summarize_profile"]

_LAG = re.compile(r'^tokenrelay_relay_loop_lag_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$')


# -- /metrics ------------------------------------------------------------------------------


async def metrics_text(relay: RelayProc) -> str:
    """The relay's ``/metrics`` (Prometheus text)."""
    async with aiohttp.ClientSession() as http, http.get(relay.base + "/metrics") as r:
        return await r.text()


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


# -- py-spy --------------------------------------------------------------------------------


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
