"""Prometheus metrics of one edge server, on its own ``CollectorRegistry``.

Several relays run in one test process, so nothing registers on the global registry:
each app builds one :class:`RelayMetrics` and serves :meth:`RelayMetrics.render` on
``GET /metrics``. Every name starts with ``tokenrelay_relay_``, except the supervised
loops' ``tokenrelay_loop_*`` (:mod:`relay.service.supervise`, on the same registry).
Every metric is declared here: the server's in :class:`RelayMetrics`, the hub's in
:data:`HUB_METRICS`.

Two sources:

- counters / gauges / the latency histogram that the server updates as it goes
  (connections, frames written, resumes, gaps, slow-client disconnects, auth
  failures, rejections, per-hop latency frame ``ts`` -> written to the socket);
- :class:`HubCollector`, which reads ``hub.stats()`` at scrape time (watches,
  subscriptions per shard, conflations, ...): the hub keeps its own numbers and is
  never called on the hot path for metrics. Numbers that only grow are counters.

Order of use: ``m = RelayMetrics(relay_id)``; ``m.bind_hub(hub.stats)`` once the hub
exists; the server calls the ``m.<metric>.labels(...).inc()`` etc.;
``body, content_type = m.render()``.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from typing import Any, Final, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from relay.edge.core.resume import Delivery
from relay.service.httpguard import Reason

__all__ = [
    "HUB_METRICS",
    "PREFIX",
    "TRANSPORTS",
    "HubCollector",
    "LoopCounter",
    "LoopHistogram",
    "OutMeter",
    "RelayMetrics",
]

PREFIX: Final = "tokenrelay_relay_"
TRANSPORTS: Final = ("sse", "ws")
# 1 ms .. 10 s: local hops are sub-millisecond, a stalled shard is seconds.
LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip

StatsFn = Callable[[], Mapping[str, Any]]
_C = TypeVar("_C")


class _LoopFamily(Collector, Generic[_C]):
    """What the two loop metrics share: a name, help text, label names, and one child
    per label values, made on first use by ``_new_child``."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = labelnames
        self._children: dict[tuple[str, ...], _C] = {}

    def _new_child(self) -> _C:
        raise NotImplementedError

    def labels(self, *values: str) -> _C:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} wants labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child


class LoopHistogram(_LoopFamily["_LoopChild"]):
    """A histogram for code that runs on one event loop: ``observe`` is a bisect and two
    list updates (no lock, no per-sample object), where prometheus-client's Histogram
    takes a lock per bucket update. The server observes every frame written to every
    socket, so this is on its hottest path. Exported at scrape time with the same
    exposition (``_bucket``, ``_count``, ``_sum``) as a prometheus-client Histogram.

    ``h.labels("sse").observe(seconds)``, or ``h.observe(seconds)`` without labels."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...] = (), *,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:  # fmt: skip
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(sorted(buckets))

    def _new_child(self) -> _LoopChild:
        return _LoopChild(self.bounds)

    def observe(self, seconds: float) -> None:
        self.labels().observe(seconds)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in sorted(self._children.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*self.bounds, math.inf), child.counts, strict=True):
                cumulative += n
                buckets.append((_bound_text(bound), cumulative))
            fam.add_metric(list(values), buckets, child.total)
        yield fam


class LoopCounter(_LoopFamily["_LoopCount"]):
    """A counter for code that runs on one event loop: ``inc`` is one addition (no lock:
    prometheus-client's Counter takes one per increment, and the server counts every
    socket write). Exported at scrape time as a prometheus-client Counter is
    (``<name>_total``). ``c.labels("sse").inc(n)``."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, documentation, labelnames)

    def _new_child(self) -> _LoopCount:
        return _LoopCount()

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in sorted(self._children.items()):
            fam.add_metric(list(values), child.value)
        yield fam


class _LoopCount:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _LoopChild:
    __slots__ = ("bounds", "by_ms", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.by_ms = _bucket_by_ms(bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def observe_ms(self, ms: int) -> None:
        """``observe(ms / 1000)`` for a whole number of milliseconds >= 0 (the same
        bucket and sum), by a table look-up instead of a bisect below :data:`_BY_MS`."""
        seconds = ms / 1000.0
        self.counts[self.by_ms[ms] if ms < _BY_MS else bisect_left(self.bounds, seconds)] += 1
        self.total += seconds


_BY_MS: Final = 10_001  # whole milliseconds whose bucket is looked up (0 .. 10 s)


@cache
def _bucket_by_ms(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Per whole millisecond below :data:`_BY_MS`, the bucket ``observe`` puts it in
    (shared by every child of the same bounds)."""
    return tuple(bisect_left(bounds, ms / 1000.0) for ms in range(_BY_MS))


class OutMeter:
    """What one transport's socket writes add to the metrics: :meth:`sent` runs for
    every write (a :class:`relay.edge.conn.base.Conn` calls it), so it reads the
    clocks once per write (the two clocks of :mod:`relay.protocol.frame`, inline),
    counts without a lock and observes the two latency histograms inline, by whole
    milliseconds (both clocks are in ms), with a table look-up per observation."""

    __slots__ = ("_bytes", "_frames", "_gaps", "_hop", "_queue")

    def __init__(self, metrics: RelayMetrics, transport: str) -> None:
        self._frames = metrics.frames_out.labels(transport)
        self._bytes = metrics.bytes_out.labels(transport)
        self._hop = metrics.hop_latency.labels(transport)
        self._queue = metrics.edge_to_socket.labels(transport)
        self._gaps = metrics.gaps

    def sent(self, batch: Sequence[Delivery], nbytes: int) -> None:
        self._frames.value += len(batch)
        self._bytes.value += nbytes
        mono = wall = 0
        for d in batch:
            received = d.received_mono_ms
            if received > 0:  # else replayed from the backlog: not a hop of the live path
                if not mono:  # frame.monotonic_ms() and frame.now_ms(), inline
                    mono = _monotonic_ns() // 1_000_000 + 1
                    wall = _time_ns() // 1_000_000
                # observe_ms of each histogram, inline (the hottest path)
                ms = mono - received  # in this process
                ms = ms if ms > 0 else 0
                h = self._queue
                i = h.by_ms[ms] if ms < _BY_MS else bisect_left(h.bounds, ms / 1000.0)
                h.counts[i] += 1
                h.total += ms / 1000.0
                if d.ts > 0:  # from the producer's clock
                    ms = wall - d.ts
                    ms = ms if ms > 0 else 0
                    h = self._hop
                    i = h.by_ms[ms] if ms < _BY_MS else bisect_left(h.bounds, ms / 1000.0)
                    h.counts[i] += 1
                    h.total += ms / 1000.0
            if d.kind == "gap":
                self._gaps.inc()


_monotonic_ns: Final = time.monotonic_ns
_time_ns: Final = time.time_ns


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


COUNTER: Final = "counter"
GAUGE: Final = "gauge"
# Every hub.stats() entry that is exported, declared here: key -> (type, help). A counter
# (it only grows) is exported as ``tokenrelay_relay_hub_<key>_total``, a gauge as
# ``tokenrelay_relay_hub_<key>``; a mapping entry gets one sample per key (label ``key``).
HUB_METRICS: Final[dict[str, tuple[str, str]]] = {
    "watches_opened": (COUNTER, "watches opened on the hub"),
    "frames_in": (COUNTER, "live frames read from Redis"),
    "reads": (
        COUNTER,
        "reads of a shard connection that carried messages (frames_in / reads: frames per read)",
    ),
    "frames_out": (COUNTER, "frames handed to watches"),
    "bad_frames": (COUNTER, "live messages that did not decode as frames"),
    "conflations": (COUNTER, "queued token frames merged for a slow socket"),
    "compacted": (COUNTER, "replay frames a compacted join saved (finished turns' tokens merged)"),
    "slow_disconnects": (COUNTER, "watches closed as slow consumers"),
    "replays": (COUNTER, "watches that replayed the backlog from an offset"),
    "gaps": (COUNTER, "gap frames produced (frames lost for good)"),
    "duplicates": (COUNTER, "live frames a watch already had from its replay, dropped"),
    "repairs": (COUNTER, "backlog reads that repaired a hole in the live feed"),
    "subscribes": (COUNTER, "session channels subscribed"),
    "unsubscribes": (COUNTER, "session channels unsubscribed"),
    "sealed": (COUNTER, "offsets sealed after a failover lost them"),
    "writes_direct": (COUNTER, "socket writes straight from the Redis reader"),
    "writes_queued": (COUNTER, "socket writes by the stream's task after the socket pushed back"),
    "deleted": (COUNTER, "deleted sessions whose streams this relay ended"),
    "screens_writes": (COUNTER, "screen counts of a session written (one script each)"),
    "screens_errors": (COUNTER, "screen counts that could not be written (tried again)"),
    "presence_frames": (COUNTER, "presence frames received and handed to a session's screens"),
    "presence_writes": (COUNTER, "presence entries written"),
    "presence_errors": (COUNTER, "presence pipelines that failed"),
    "reap_checks": (COUNTER, "reaps tried on silent open turns"),
    "reaped": (COUNTER, "turns ended because their worker was lost"),
    "reap_errors": (COUNTER, "reaps that failed"),
    "resubscribes": (COUNTER, "channels subscribed again after a topology change"),
    "replay_budget_waits": (COUNTER, "replay pages that waited for the relay-wide budget"),
    "subscriber": (COUNTER, "shard subscriber events, by key"),
    "watches": (GAUGE, "watches open on the hub"),
    "channels": (GAUGE, "session channels subscribed now"),
    "replay_budget_used": (GAUGE, "bytes of replay pages in memory"),
    "replay_budget_peak": (GAUGE, "most bytes of replay pages in memory at once"),
    "channels_per_node": (GAUGE, "subscribed session channels per shard node"),
}
# hub.stats() keys exported under a name of their own: key -> (metric, label name).
HUB_RENAMED: Final = {"channels_per_node": ("subscriptions", "shard")}


class HubCollector(Collector):
    """Turns ``hub.stats()`` into metrics at scrape time, as :data:`HUB_METRICS` declares.

    A numeric entry ``k`` becomes ``tokenrelay_relay_hub_<k>`` (``..._total`` for a
    counter); a mapping of numbers becomes one family with a ``key`` label, except
    ``channels_per_node``, which is ``tokenrelay_relay_subscriptions{shard="host:port"}``.
    Undeclared entries are skipped, and a failing ``stats()`` yields nothing rather
    than breaking the scrape.
    """

    def __init__(self) -> None:
        self.stats: StatsFn | None = None

    def describe(self) -> list[Metric]:
        return []  # dynamic: do not let the registry probe collect() at registration

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        try:
            stats = dict(self.stats())
        except Exception:  # a scrape must not fail because of the hub
            return
        for name, value in sorted(stats.items()):
            declared = HUB_METRICS.get(name)
            if declared is None:
                continue
            kind, doc = declared
            family = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            metric = PREFIX + "hub_" + _clean(name)
            n = _number(value)
            if n is not None:
                yield family(metric, doc, value=n)
            elif isinstance(value, Mapping):
                label = "key"
                if name in HUB_RENAMED:
                    metric, label = PREFIX + HUB_RENAMED[name][0], HUB_RENAMED[name][1]
                fam = family(metric, doc, labels=[label])
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0])):
                    n = _number(v)
                    if n is not None:
                        fam.add_metric([str(k)], n)
                yield fam


def _clean(name: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)


class RelayMetrics:
    """The server's metrics. Label values: ``transport`` is ``sse`` or ``ws``."""

    def __init__(self, relay_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        Info(p[:-1], "this relay", registry=r).info({"relay_id": relay_id})
        self.connections = Gauge(p + "connections", "open streams", ["transport"], registry=r)
        self.accepted = Counter(p + "accepted", "streams accepted", ["transport"], registry=r)
        self.watches = Gauge(p + "watches", "hub watches held by this server", registry=r)
        # counted per socket write: no lock (LoopCounter)
        self.frames_out = LoopCounter(p + "frames_out", "frames written to sockets", ("transport",))
        self.bytes_out = LoopCounter(
            p + "bytes_out", "frame bytes written to sockets", ("transport",)
        )
        self.resumes = Counter(
            p + "resume_replays", "streams that resumed from an offset", ["transport"], registry=r
        )
        self.gaps = Counter(p + "gaps", "gap frames written (frames lost for good)", registry=r)
        self.slow_disconnects = Counter(
            p + "slow_disconnects", "streams closed as slow consumers", ["transport"], registry=r
        )
        self.closes = Counter(
            p + "closes", "streams closed by the server, by code", ["transport", "code"], registry=r
        )
        self.auth_failures = Counter(
            p + "auth_failures", "requests refused by token checks", ["reason"], registry=r
        )
        self.rejected = Counter(
            p + "rejected", "requests refused before streaming", ["reason"], registry=r
        )
        self.http_guard = Counter(
            p + "http_guard",
            "connections the HTTP guard refused or closed (head_timeout, body_timeout, "
            "idle_timeout, too_many_connections) and clients that left mid-body (body_cut)",
            ["reason"],
            registry=r,
        )
        for reason in Reason:
            self.http_guard.labels(reason.value)
        self.draining = Gauge(p + "draining", "1 while the server drains", registry=r)
        self.publish_to_edge = LoopHistogram(
            p + "publish_to_edge_seconds",
            "live frames: frame ts (producer clock) to read by the relay from Redis",
        )
        self.edge_to_socket = LoopHistogram(
            p + "edge_to_socket_seconds",
            "live frames: read from Redis to written to the client socket (relay queueing)",
            ("transport",),
        )
        self.hop_latency = LoopHistogram(
            p + "hop_latency_seconds",
            "live frames: frame ts (producer clock) to written to the client socket",
            ("transport",),
        )
        self.loop_lag = LoopHistogram(
            p + "loop_lag_seconds",
            "how late a 10 ms timer fires: the event loop's longest turns, sampled",
        )
        for hist in (self.publish_to_edge, self.edge_to_socket, self.hop_latency, self.loop_lag):
            r.register(hist)
        r.register(self.frames_out)
        r.register(self.bytes_out)
        self.publish_to_edge.labels()
        self.loop_lag.labels()
        for transport in TRANSPORTS:  # export zeros from the start, not after first use
            for family in (
                self.connections, self.accepted, self.frames_out, self.bytes_out,
                self.resumes, self.slow_disconnects,
            ):  # fmt: skip
                family.labels(transport)
            self.hop_latency.labels(transport)
            self.edge_to_socket.labels(transport)
        self.hub = HubCollector()
        r.register(self.hub)

    def bind_hub(self, stats: StatsFn | None) -> None:
        self.hub.stats = stats

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
