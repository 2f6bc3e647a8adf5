"""The worker's Prometheus metrics, in a per-app registry (tests run several workers).

Order of use: ``m = WorkerMetrics()`` once per app; the turn runner increments the
counters; ``m.bind_router(router)`` makes the per-engine gauges read the router at scrape
time; ``m.render()`` is the body of ``GET /metrics``.

``tokenrelay_worker_publishes_total / tokenrelay_worker_tokens_published_total`` is the
number of Redis operations per token (coalescing lowers it);
``..._cache_affinity_available_total`` counts turns whose previous turn's engine is still
in the ring (its KV cache could be reused), ``..._cache_affinity_captured_total`` those
that routing actually sent there, and ``..._cached_prompt_tokens_total`` what the engines
reported as served from cache.

Every family the worker exports, by type:

- counters: ``..._turns_total{outcome}`` (:class:`worker.chat.turnstate.TurnOutcome`),
  ``..._rejected_requests_total{status}``, ``..._tokens_published_total``,
  ``..._publishes_total``, ``..._route_spills_total``,
  ``..._route_decisions_total{policy,reason}`` (:mod:`worker.routing.policy`),
  ``..._cache_affinity_available_total``, ``..._cache_affinity_captured_total``,
  ``..._cached_prompt_tokens_total``, ``..._prompt_tokens_total``,
  ``..._cancellations_total{reason}``; read from the router at scrape time
  ``..._router_routes_total``, ``..._router_spills_total``, ``..._router_rejections_total``,
  ``..._router_double_releases_total``;
- precise routing (``--engine-kv-events``, at scrape time): counters
  ``..._kv_events_total{kind}``, ``..._kv_events_bad_total{reason}``,
  ``..._kv_blocks_skipped_total{reason}``; gauges ``..._kv_index_blocks{engine}``,
  ``..._kv_index_live{engine}``;
- gauges (router, at scrape time): ``..._engine_in_flight{engine}``,
  ``..._engine_cap{engine}``, ``..._engine_effective_cap{engine}`` (``engine``: the id,
  never an address: :func:`engine_label`);
- histograms: ``..._ttft_seconds``, ``..._coalesce_wait_seconds``;
- the background loops' (declared by :class:`relay.service.supervise.Supervisor` in this
  registry): ``tokenrelay_loop_failures_total{loop}``,
  ``tokenrelay_loop_restarts_total{loop}``, ``tokenrelay_loop_healthy{loop}``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from relay.service.httpguard import Reason
from worker.routing.kvevents import KVEventFollower
from worker.routing.router import Router

__all__ = ["CONTENT_TYPE_LATEST", "WorkerMetrics", "engine_label"]

_P = "tokenrelay_worker_"
_HOST_PORT: Final = re.compile(r".+:[0-9]+")


def engine_label(engine_id: str) -> str:
    """The ``engine`` label of an engine: its id, unless the id is its address (the
    default id of ``--engine URL`` is ``host:port``), which metrics do not publish; then
    ``engine-<8 hex of the id's SHA-256>``, the same on every worker. Name engines
    (``--engine ID=URL``) for readable labels."""
    if _HOST_PORT.fullmatch(engine_id) is None:
        return engine_id
    return "engine-" + hashlib.sha256(engine_id.encode()).hexdigest()[:8]


class _RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        snap = self.router.snapshot()
        inflight = GaugeMetricFamily(
            _P + "engine_in_flight", "Leases this worker holds per engine.", labels=["engine"]
        )
        cap = GaugeMetricFamily(_P + "engine_cap", "Engine cap (cluster-wide).", labels=["engine"])
        eff = GaugeMetricFamily(
            _P + "engine_effective_cap",
            "What this worker may hold on the engine (its load-exchange allowance).",
            labels=["engine"],
        )
        for eid, e in snap["engines"].items():
            label = [engine_label(eid)]
            inflight.add_metric(label, e["in_flight"])
            cap.add_metric(label, e["cap"])
            eff.add_metric(label, e["effective_cap"])
        c = snap["counters"]
        # the router's own counts only grow: counters (exposed with the _total suffix)
        routes = CounterMetricFamily(_P + "router_routes", "Routes decided by the router.")
        routes.add_metric([], c["routes"])
        spills = CounterMetricFamily(_P + "router_spills", "Routes off the preferred engine.")
        spills.add_metric([], c["spills"])
        rejections = CounterMetricFamily(_P + "router_rejections", "Routes refused (all full).")
        rejections.add_metric([], c["rejections"])
        double = CounterMetricFamily(_P + "router_double_releases", "Leases released twice.")
        double.add_metric([], c["double_releases"])
        yield from (inflight, cap, eff, routes, spills, rejections, double)


class _KVEventsCollector(Collector):
    """The KV-event follower's counts and the block index's (precise routing)."""

    def __init__(self, follower: KVEventFollower) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        f, ix = self.follower, self.follower.index
        st = ix.stats
        counts = CounterMetricFamily(
            _P + "kv_events",
            "KV-event traffic from the engines: messages, batches and events applied, "
            "duplicates, gaps, replays asked and batches replayed, replays unanswered, "
            "batches dropped in a flood, engine restarts seen.",
            labels=["kind"],
        )
        for kind, n in f.counts.items():
            counts.add_metric([kind], n)
        counts.add_metric(["restarts"], st.restarts)
        bad = CounterMetricFamily(
            _P + "kv_events_bad",
            "KV-event messages that were not a batch (garbled, shape, unknown_tag, seq, "
            "frames, flood): the engine's blocks dropped, the router estimates it meanwhile.",
            labels=["reason"],
        )
        for reason, n in f.bad.items():
            bad.add_metric([reason], n)
        skipped = CounterMetricFamily(
            _P + "kv_blocks_skipped",
            "Blocks in events the index could not use (orphan, medium, block_size, "
            "token_count, unknown_removed, max_blocks).",
            labels=["reason"],
        )
        for reason, n in st.skipped.items():
            skipped.add_metric([reason], n)
        blocks = GaugeMetricFamily(
            _P + "kv_index_blocks", "Blocks the index holds per engine.", labels=["engine"]
        )
        live = GaugeMetricFamily(
            _P + "kv_index_live",
            "1 when the engine's events are followed (precise), 0 when it is estimated.",
            labels=["engine"],
        )
        for name in ix.engines():
            blocks.add_metric([engine_label(name)], ix.blocks(name))
            live.add_metric([engine_label(name)], 1 if ix.live(name) else 0)
        yield from (counts, bad, skipped, blocks, live)


class WorkerMetrics:
    """Counters and histograms of one worker app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.turns = Counter(_P + "turns", "Turns by outcome.", ["outcome"], registry=reg)
        self.rejected = Counter(
            _P + "rejected_requests", "Turn POSTs refused, by status.", ["status"], registry=reg
        )
        self.http_guard = Counter(
            _P + "http_guard",
            "Connections the HTTP guard refused or closed (head_timeout, body_timeout, "
            "idle_timeout, too_many_connections) and clients that left mid-body (body_cut).",
            ["reason"],
            registry=reg,
        )
        for reason in Reason:
            self.http_guard.labels(reason.value)
        self.ttft = Histogram(
            _P + "ttft_seconds",
            "Time from the POST to the first token from the engine.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=reg,
        )
        self.tokens = Counter(_P + "tokens_published", "Engine tokens published.", registry=reg)
        self.publishes = Counter(
            _P + "publishes", "Publish round trips to Redis (one Lua call each).", registry=reg
        )
        self.coalesce_wait = Histogram(
            _P + "coalesce_wait_seconds",
            "Time a token waited in the coalescing buffer.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=reg,
        )
        self.spills = Counter(_P + "route_spills", "Turns routed off their preferred engine.",
                              registry=reg)  # fmt: skip
        self.route_decisions = Counter(
            _P + "route_decisions", "Turns routed, by routing policy and the reason for the "
            "engine (preferred, spilled, spilled_cost, least_cost, queued_past_cap, round_robin).",
            ["policy", "reason"], registry=reg,
        )  # fmt: skip
        self.affinity_available = Counter(
            _P + "cache_affinity_available",
            "Turns whose previous engine (holding their prefix) was in the ring.",
            registry=reg,
        )
        self.affinity_captured = Counter(
            _P + "cache_affinity_captured",
            "Turns routed to the engine that served their previous turn.",
            registry=reg,
        )
        self.cached_tokens = Counter(
            _P + "cached_prompt_tokens", "Prompt tokens the engines served from cache.",
            registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            _P + "prompt_tokens", "Prompt tokens sent to engines.", registry=reg
        )
        self.cancellations = Counter(
            _P + "cancellations", "Turns aborted before the end, by reason.", ["reason"],
            registry=reg,
        )  # fmt: skip

    def bind_router(self, router: Router) -> None:
        self.registry.register(_RouterCollector(router))

    def bind_kv_events(self, follower: KVEventFollower) -> None:
        self.registry.register(_KVEventsCollector(follower))

    def render(self) -> bytes:
        return generate_latest(self.registry)
