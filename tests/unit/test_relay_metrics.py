"""The relay's event-loop histogram exports exactly what prometheus-client's would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

import relay.edge.metrics as metrics_mod
from relay.edge.core.resume import Delivery
from relay.edge.metrics import LATENCY_BUCKETS, LoopHistogram, OutMeter, RelayMetrics


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@pytest.mark.parametrize("labelnames", [(), ("transport",)])
def test_loop_histogram_exposition_matches_prometheus_client(labelnames: tuple[str, ...]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("t_seconds", "latency", labelnames)
    ours.register(fast)
    ref = Histogram("t_seconds", "latency", labelnames, buckets=LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(5)
    values = [0.0, 0.0005, 0.001, 10.0, 11.0, *(rng.expovariate(20.0) for _ in range(500))]
    for i, v in enumerate(values):
        label = ("sse", "ws")[i % 2] if labelnames else None
        if label is None:
            fast.observe(v)
            ref.observe(v)
        else:
            fast.labels(label).observe(v)
            ref.labels(label).observe(v)
    assert _lines(ours) == _lines(theirs)


def test_loop_histogram_refuses_wrong_labels() -> None:
    h = LoopHistogram("t_seconds", "latency", ("transport",))
    with pytest.raises(ValueError, match="wants labels"):
        h.labels("sse", "extra")


def test_out_meter_observes_what_prometheus_client_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The socket-write meter buckets whole milliseconds by a table: every bucket edge,
    the table's end and past it land where prometheus-client's Histogram puts them,
    for both histograms (read -> socket on the monotonic clock, producer -> socket on
    the wall clock), with the same sums; negative waits count as 0."""
    mono_ms, wall_ms = 5_000_000, 1_700_000_000_000
    monkeypatch.setattr(metrics_mod, "_monotonic_ns", lambda: (mono_ms - 1) * 1_000_000)
    monkeypatch.setattr(metrics_mod, "_time_ns", lambda: wall_ms * 1_000_000 + 999_999)
    metrics = RelayMetrics("r1")
    meter = OutMeter(metrics, "sse")
    theirs = CollectorRegistry()
    refs = {
        name: Histogram(name, "latency", ("transport",), buckets=LATENCY_BUCKETS, registry=theirs)
        for name in ("q_seconds", "h_seconds")
    }
    edges = [round(b * 1000) for b in LATENCY_BUCKETS]
    waits = sorted({0, 1, 2, 3, 9_999, 10_000, 10_001, 12_345, *edges, *(e + 1 for e in edges)})
    for ms in [*waits, -3]:
        d = Delivery(1, "token", b"x", wall_ms - 2 * ms, mono_ms - ms, "")
        meter.sent([d, Delivery(2, "token", b"y", 0, 0, "")], 2)  # (a replayed one: none)
        refs["q_seconds"].labels("sse").observe(max(ms, 0) / 1000.0)
        refs["h_seconds"].labels("sse").observe(max(2 * ms, 0) / 1000.0)
    ours = CollectorRegistry()
    ours.register(metrics.edge_to_socket)
    ours.register(metrics.hop_latency)
    prefix = "tokenrelay_relay_"
    got = [
        line.replace(prefix + "edge_to_socket_seconds", "q_seconds").replace(
            prefix + "hop_latency_seconds", "h_seconds"
        )
        for line in _lines(ours)
    ]
    sse = 'transport="sse"'  # (the samples; the help texts differ)
    assert sorted(x for x in got if sse in x) == sorted(x for x in _lines(theirs) if sse in x)
