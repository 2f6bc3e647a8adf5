"""One view of engine load across worker pods, without I/O on the routing path.

The problem: M worker pods each route with local counters. If each admits up to an
engine's cap, one engine can receive M x cap requests. This module computes, for one
worker, how many in-flight requests it may hold on each engine (its *allowance*) and how
many the other workers hold, and installs both in its Router (``Router.apply_load_view``),
which then decides every route in memory.

The rule (pure, :func:`compute_view`), per engine with cap C, evaluated every ~250 ms:

* ``others`` = sum of the in-flight counts the other live workers last reported (used by the
  bounded-load rule and least-loaded spill);
* ``reserved`` = sum over the other workers of max(in-flight, allowance) they last reported:
  an allowance is a reservation a worker may fill until its next report;
* ``free`` = max(0, C - mine - reserved), what nobody holds or may take;
* each worker may take a share of ``free`` proportional to its demand (its in-flight count
  plus the routes refused there since its last report), smoothed by +1 so an idle worker
  keeps a foothold: ``share = (d_me + 1) / (D + M)`` where D sums every live worker's
  demand; the shares of all workers sum to 1 when they see the same reports;
* ``allowance = mine + floor(free * share)``: a worker never has to drop what it holds.

Why this bounds the global in-flight by C: a worker's in-flight never exceeds its allowance,
and when worker i recomputes its allowance it leaves room for every other worker's current
reservation, so the sum of all allowances stays <= C as long as each worker sees the others'
latest reports. The only overshoot comes from two workers recomputing within the same Redis
round trip (each missing the other's new reservation), and each of them takes only its
demand share of ``free``. The simulator (bench/router_sim.py) measures the peak.

If the exchange is stale (Redis unreachable for longer than ``stale_s``), each worker
falls back to a static split of the cap over the last known live workers
(:func:`static_view`): C // M, the remainder to the lowest-sorted ids, which sums to C
exactly. A worker alone in the cluster gets the whole cap.

Call order: ``LoadExchange(redis, router, worker_id)`` -> ``await start()`` (a background
task runs :meth:`LoadExchange.tick` every interval) -> ``await stop()``. Redis layout: one
hash per worker, ``tr:workers:{<worker_id>}`` (the braces are a hash tag: each worker's hash
sits in its own slot), fields ``in_flight``, ``demand`` and ``allowance`` (JSON objects
engine -> count), with a TTL of a few intervals so a dead worker's load vanishes; plus a sorted set
``tr:workers`` (member = worker id, score = last report time) to discover the peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from redis.asyncio import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from worker.router import LoadView, Router

__all__ = [
    "REGISTRY_KEY",
    "LoadExchange",
    "WorkerReport",
    "compute_view",
    "static_view",
    "worker_key",
]

REGISTRY_KEY: Final = "tr:workers"
_log = logging.getLogger(__name__)


def worker_key(worker_id: str, namespace: str = "tr") -> str:
    """The Redis hash holding one worker's report (its id is the hash tag)."""
    if not worker_id or any(c in worker_id for c in "{}"):
        raise ValueError(f"invalid worker id {worker_id!r}")
    return f"{namespace}:workers:{{{worker_id}}}"


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What one worker published, per engine id: its in-flight count, its demand (in-flight +
    refused routes) and the allowance it reserved until its next report."""

    worker_id: str
    in_flight: Mapping[str, int] = field(default_factory=dict)
    demand: Mapping[str, int] = field(default_factory=dict)
    allowance: Mapping[str, int] = field(default_factory=dict)


def static_view(caps: Mapping[str, int], workers: Iterable[str], me: str) -> LoadView:
    """Split each cap over the live workers: C // M each, the remainder to the first ids in
    sorted order. Safe without any fresh report: the allowances sum to C."""
    ids = sorted({*workers, me})
    m, rank = len(ids), ids.index(me)
    allowance = {eid: cap // m + (1 if rank < cap % m else 0) for eid, cap in caps.items()}
    return LoadView(others={}, allowance=allowance)


def compute_view(
    caps: Mapping[str, int],
    mine: Mapping[str, int],
    my_pressure: Mapping[str, int],
    others: Iterable[WorkerReport],
) -> LoadView:
    """The load view of this worker from its own counters and the others' fresh reports
    (see the module docstring for the rule). Pure."""
    reports = list(others)
    m = len(reports) + 1
    held: dict[str, int] = {}
    allowance: dict[str, int] = {}
    for eid, cap in caps.items():
        o = sum(r.in_flight.get(eid, 0) for r in reports)
        reserved = sum(
            max(r.in_flight.get(eid, 0), r.allowance.get(eid, r.in_flight.get(eid, 0)))
            for r in reports
        )
        me = mine.get(eid, 0)
        d_me = me + my_pressure.get(eid, 0)
        d_all = d_me + sum(r.demand.get(eid, 0) for r in reports)
        free = max(0, cap - me - reserved)
        share = (d_me + 1) / (d_all + m)
        held[eid] = o
        allowance[eid] = min(cap, me + math.floor(free * share))
    return LoadView(others=held, allowance=allowance)


class LoadExchange:
    """Every ``interval_s``: write this worker's report, read the others', install the view.

    The router is never blocked: the view is computed here, off the hot path, and applied
    in one synchronous call."""

    def __init__(
        self,
        redis: RedisCluster,
        router: Router,
        worker_id: str,
        *,
        interval_s: float = 0.25,
        ttl_s: float = 1.5,
        stale_s: float = 2.0,
        namespace: str = "tr",
    ) -> None:
        self._redis = redis
        self._router = router
        self.worker_id = worker_id
        self._ns = namespace
        self._key = worker_key(worker_id, namespace)
        self._registry = REGISTRY_KEY if namespace == "tr" else f"{namespace}:workers"
        self.interval_s = interval_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.stale_s = stale_s
        self._task: asyncio.Task[None] | None = None
        self._last_ok = time.monotonic()
        self.peers: list[str] = []  # other live workers at the last successful tick
        self.ticks = 0
        self.errors = 0

    async def tick(self) -> LoadView:
        """One exchange round: read the peers, compute and install the view, then publish
        this worker's report with its new reservation (three pipelined round trips).
        Raises RedisError on failure."""
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(self._registry, {self.worker_id: now})
        pipe.zremrangebyscore(self._registry, "-inf", now - 60.0)
        pipe.zrange(self._registry, 0, -1)
        results = await pipe.execute()
        ids = [_text(x) for x in results[-1]]
        peers = [w for w in ids if w != self.worker_id]
        reports: list[WorkerReport] = []
        if peers:
            read = self._redis.pipeline(transaction=False)
            for w in peers:
                read.hgetall(worker_key(w, self._ns))
            for w, raw in zip(peers, await read.execute(), strict=True):
                report = _parse(w, raw)
                if report is not None:  # an expired hash: that worker is gone
                    reports.append(report)
        self.peers = [r.worker_id for r in reports]
        caps = {spec.id: spec.cap for spec in self._router.engines()}
        mine = self._router.in_flight()
        pressure = self._router.take_pressure()
        view = compute_view(caps, mine, pressure, reports)
        self._router.apply_load_view(view)
        demand = {eid: mine.get(eid, 0) + pressure.get(eid, 0) for eid in mine}
        write = self._redis.pipeline(transaction=False)
        write.hset(
            self._key,
            mapping={
                "in_flight": json.dumps(mine),
                "demand": json.dumps(demand),
                "allowance": json.dumps(dict(view.allowance)),
            },
        )
        write.pexpire(self._key, self.ttl_ms)
        await write.execute()
        self._last_ok = time.monotonic()
        self.ticks += 1
        return view

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"load-exchange-{self.worker_id}")

    async def stop(self) -> None:
        """Stop the loop and delete this worker's report so peers reclaim its share."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(RedisError, OSError):
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(self._key)
            pipe.zrem(self._registry, self.worker_id)
            await pipe.execute()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except (RedisError, RedisClusterException, OSError) as exc:  # SlotNotCovered too
                self.errors += 1
                if time.monotonic() - self._last_ok > self.stale_s:
                    caps = {spec.id: spec.cap for spec in self._router.engines()}
                    self._router.apply_load_view(static_view(caps, self.peers, self.worker_id))
                _log.warning("load exchange failed: %s", exc)
            await asyncio.sleep(self.interval_s)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _parse(worker_id: str, raw: Mapping[bytes | str, bytes | str]) -> WorkerReport | None:
    if not raw:
        return None
    fields = {_text(k): _text(v) for k, v in raw.items()}
    try:
        in_flight = {str(k): int(v) for k, v in json.loads(fields["in_flight"]).items()}
        demand = {str(k): int(v) for k, v in json.loads(fields.get("demand", "{}")).items()}
        allowance = {str(k): int(v) for k, v in json.loads(fields.get("allowance", "{}")).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        _log.warning("ignoring malformed load report of worker %s", worker_id)
        return None
    return WorkerReport(worker_id, in_flight, demand, allowance)
