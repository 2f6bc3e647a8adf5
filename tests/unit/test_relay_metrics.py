"""The relay's event-loop histogram exports exactly what prometheus-client's would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from relay.edge.metrics import LATENCY_BUCKETS, LoopHistogram


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
