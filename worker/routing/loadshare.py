"""One view of engine load across worker pods, without I/O on the routing path.

The problem: M worker pods each route with local counters. If each admits up to an
engine's cap, one engine can receive M x cap requests. This module computes, for one
worker, how many in-flight requests it may hold on each engine (its *allowance*) and how
many the other workers hold, and installs both in its Router (``Router.apply_load_view``),
which then decides every route in memory.

The rule (pure, :func:`compute_view`), per engine with cap C, evaluated every ~250 ms:

* every worker reports its in-flight count ``h`` and its unmet demand ``u`` (routes
  refused since its last report plus requests waiting for a slot now, see
  :func:`worker.routing.wait.route_wait`); its demand is ``d = h + u``;
* the *target* of each worker (:func:`split_cap`, computed identically by every worker
  from the same reports) is an integer max-min fair split of C over the demands: one
  slot at a time to the worker with the smallest target so far whose demand is not met,
  ties in an order that changes every ``rotate_s`` (1 s: the epoch of the wall clock
  hashed with the worker id), so under overload the slots rotate between workers
  instead of staying with the first ids; what no demand needs is
  then spread evenly over all workers as footholds (the remainder to the smallest
  targets), so an idle worker admits its next request without waiting for a round;
* ``reserved`` = sum over the other workers of the allowance they last reported (their
  in-flight when they reported none): an allowance is a reservation a worker may fill
  until its next report;
* ``allowance = max(mine, min(target, C - reserved))``: never above what the others
  leave free, never below what this worker holds (it never has to drop a request).
  With a queue past the cap (``cost_aware``, ``worker.routing.router``: up to
  ``floor(queue * allowance)`` more in flight), ``mine`` is the least allowance whose
  queue still covers what this worker holds, and never more than its previous
  allowance: what it holds past its allowance is queue, which counts in the in-flight
  others see and in its demand, never in the reservations, so a queue cannot grow the
  allowance that bounds it and a worker above its target still gives slots back.

Why this bounds the global in-flight by C: a worker's in-flight never exceeds its allowance,
and when worker i recomputes its allowance it leaves room for every other worker's current
reservation, so the sum of all allowances stays <= C as long as each worker sees the others'
latest reports. The only overshoot comes from two workers recomputing within the same Redis
round trip (each missing the other's new reservation). The targets only decide who gets
the room: a worker above its target stops admitting and its reservation shrinks to its
in-flight, so a slot moves to a starved worker within about two rounds (its demand is
reported, the holder shrinks, it grows). The simulator (bench/routing/sim.py) measures the
peak and the convergence.

If the exchange is stale (Redis unreachable for longer than ``stale_s``), each worker
falls back to a static split of the cap over the last known live workers
(:func:`static_view`): C // M, the remainder to the lowest-sorted ids, which sums to C
exactly. A worker alone in the cluster gets the whole cap.

Call order: ``LoadExchange(redis, router, worker_id)`` -> ``await start(supervisor)`` (the
process's :class:`relay.service.supervise.Supervisor` runs :meth:`LoadExchange.step` every
interval; without one the exchange makes its own) -> ``await stop()`` after the supervisor
stopped (it withdraws this worker's report; it never raises). Redis layout: one
hash per worker, ``tr:workers:{<worker_id>}`` (the braces are a hash tag: each worker's hash
sits in its own slot), fields ``in_flight``, ``demand`` and ``allowance`` (JSON objects
engine -> count), with a TTL of a few intervals so a dead worker's load vanishes; plus a sorted set
``tr:workers`` (member = worker id, score = last report time) to discover the peers.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from relay.broker.errors import RelayError
from relay.broker.port import Registry
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.keys import WORKERS_REGISTRY, worker_key
from relay.service.supervise import Supervisor
from worker.routing.lease import LoadView
from worker.routing.ring import key_hash
from worker.routing.router import Router

__all__ = [
    "REGISTRY_KEY",
    "LoadExchange",
    "WorkerReport",
    "compute_view",
    "split_cap",
    "static_view",
]

REGISTRY_KEY: Final = WORKERS_REGISTRY
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What one worker published, per engine id: its in-flight count, its demand (in-flight +
    unmet: refused and waiting routes) and the allowance it reserved until its next report."""

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


def split_cap(
    cap: int, held: Mapping[str, int], unmet: Mapping[str, int], epoch: int = 0
) -> dict[str, int]:
    """Each worker's target share of one engine's ``cap`` (see the module docstring): an
    integer max-min fair split over the demands ``held + unmet``, ties in an order that
    changes with ``epoch``; the rest spread as footholds. Sums to ``cap``. Pure and
    deterministic: every worker that sees the same reports in the same epoch computes
    the same split."""
    ids = sorted({*held, *unmet})
    if not ids:
        return {}
    demand = {w: held.get(w, 0) + max(0, unmet.get(w, 0)) for w in ids}
    turn = {w: key_hash(f"{epoch}:{w}") for w in ids}  # who goes first among equals
    target = dict.fromkeys(ids, 0)
    left = cap
    # heap entries: (target so far, turn, id); a worker leaves when its demand is met
    heap = [(0, turn[w], w) for w in ids if demand[w] > 0]
    heapq.heapify(heap)
    while left > 0 and heap:
        t, r, w = heapq.heappop(heap)
        target[w] = t + 1
        left -= 1
        if t + 1 < demand[w]:
            heapq.heappush(heap, (t + 1, r, w))
    if left > 0:  # footholds: the same number each, the remainder to the smallest targets
        each, extra = divmod(left, len(ids))
        for rank, w in enumerate(sorted(ids, key=lambda w: (target[w], turn[w], w))):
            target[w] += each + (1 if rank < extra else 0)
    return target


def compute_view(
    caps: Mapping[str, int],
    mine: Mapping[str, int],
    my_unmet: Mapping[str, int],
    others: Iterable[WorkerReport],
    me: str = "",
    epoch: int = 0,
    my_allowance: Mapping[str, int] | None = None,
    queue: float = 0.0,
) -> LoadView:
    """The load view of worker ``me`` from its own counters and the others' fresh reports
    (see the module docstring for the rule); ``epoch`` rotates the order among equals
    (:func:`split_cap`); ``my_allowance`` and ``queue``: this worker's current allowances
    and its queue past them (``Router.allowances()``, ``Router.queue``). Pure."""
    reports = [r for r in others if r.worker_id != me]
    held: dict[str, int] = {}
    allowance: dict[str, int] = {}
    for eid, cap in caps.items():
        in_flight = {r.worker_id: r.in_flight.get(eid, 0) for r in reports}
        unmet = {
            r.worker_id: max(0, r.demand.get(eid, 0) - r.in_flight.get(eid, 0)) for r in reports
        }
        m = mine.get(eid, 0)
        in_flight[me] = m
        unmet[me] = my_unmet.get(eid, 0)
        target = split_cap(cap, in_flight, unmet, epoch)[me]
        reserved = sum(r.allowance.get(eid, r.in_flight.get(eid, 0)) for r in reports)
        held[eid] = sum(r.in_flight.get(eid, 0) for r in reports)
        if my_allowance is None or queue <= 0:
            kept = m  # what it holds
        else:  # what its allowance must be for its queue to cover what it holds
            kept = min(my_allowance.get(eid, m), _covering(m, queue))
        allowance[eid] = max(kept, min(target, cap - reserved))
    return LoadView(others=held, allowance=allowance)


def _covering(held: int, queue: float) -> int:
    """The least allowance ``a`` with ``a + floor(queue * a) >= held``."""
    a = math.ceil(held / (1.0 + queue))
    while a + math.floor(queue * a) < held:
        a += 1
    return a


class LoadExchange:
    """Every ``interval_s``: write this worker's report, read the others', install the view.

    The router is never blocked: the view is computed here, off the hot path, and applied
    in one synchronous call."""

    def __init__(
        self,
        registry: Registry | Any,
        router: Router,
        worker_id: str,
        *,
        interval_s: float = 0.25,
        ttl_s: float = 1.5,
        stale_s: float = 2.0,
        rotate_s: float = 1.0,
        namespace: str = "tr",
    ) -> None:
        # the store's registry of live members (a cluster client: its Redis store's)
        self._store: Registry = registry if isinstance(registry, Registry) else RedisStore(registry)
        self._router = router
        self.worker_id = worker_id
        self._ns = namespace
        self._key = worker_key(worker_id, namespace)
        self._registry = REGISTRY_KEY if namespace == "tr" else f"{namespace}:workers"
        self.interval_s = interval_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.stale_s = stale_s
        self.rotate_s = rotate_s  # how long one order among equal workers lasts
        self._supervisor: Supervisor | None = None
        self._own_supervisor = False
        self._last_ok = time.monotonic()
        self.peers: list[str] = []  # other live workers at the last successful tick
        self.ticks = 0
        self.errors = 0

    async def tick(self) -> LoadView:
        """One exchange round: read the peers, compute and install the view, then publish
        this worker's report with its new reservation (three round trips of the store's
        registry).
        Raises what the store raised (:class:`relay.broker.errors.RelayError`)."""
        now = time.time()
        ids = await self._store.join(self._registry, self.worker_id, now, 60.0)
        peers = [w for w in ids if w != self.worker_id]
        reports: list[WorkerReport] = []
        if peers:
            raws = await self._store.reports([worker_key(w, self._ns) for w in peers])
            for w, raw in zip(peers, raws, strict=True):
                report = _parse(w, raw)
                if report is not None:  # an expired hash: that worker is gone
                    reports.append(report)
        self.peers = [r.worker_id for r in reports]
        caps = {spec.id: spec.cap for spec in self._router.engines()}
        mine = self._router.in_flight()
        unmet = self._router.take_unmet()
        epoch = int(now // self.rotate_s)
        view = compute_view(
            caps,
            mine,
            unmet,
            reports,
            self.worker_id,
            epoch,
            self._router.allowances(),
            self._router.queue if self._router.policy in ("cost_aware", "precise") else 0.0,
        )
        self._router.apply_load_view(view)
        demand = {eid: mine.get(eid, 0) + unmet.get(eid, 0) for eid in mine}
        fields = {
            "in_flight": json.dumps(mine),
            "demand": json.dumps(demand),
            "allowance": json.dumps(dict(view.allowance)),
        }
        await self._store.report(self._key, fields, self.ttl_ms)
        self._last_ok = time.monotonic()
        self.ticks += 1
        return view

    async def step(self) -> None:
        """One supervised round: :meth:`tick`; when it fails (whatever it raises: a Redis
        outage or an error redis-py leaks), the static split replaces a view older than
        ``stale_s``, and the failure goes on to the supervisor (logged, backed off, and
        /readyz told when it keeps failing)."""
        try:
            await self.tick()
        except Exception:
            self.errors += 1
            if time.monotonic() - self._last_ok > self.stale_s:
                caps = {spec.id: spec.cap for spec in self._router.engines()}
                self._router.apply_load_view(static_view(caps, self.peers, self.worker_id))
            raise

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Run :meth:`step` every ``interval_s`` on ``supervisor`` (or on one of its own).

        Critical: a load exchange that keeps failing leaves the router on a frozen or
        static view, so the worker admits against shares that no longer match the
        cluster; /readyz says so instead of serving from it."""
        if self._supervisor is not None:
            return
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self._supervisor.every("load_exchange", self.interval_s, self.step, critical=True)

    async def stop(self) -> None:
        """Stop the loop (if the supervisor is this exchange's own; a shared one is the
        caller's to stop first) and delete this worker's report so peers reclaim its
        share. Never raises."""
        sup, self._supervisor = self._supervisor, None
        if sup is not None and self._own_supervisor:
            await sup.stop()
        await self.withdraw()

    async def withdraw(self) -> None:
        """Delete this worker's report and registry entry; a failure is logged, not raised."""
        try:
            await self._store.leave(self._registry, self.worker_id, self._key)
        except RelayError as exc:  # the report expires by itself within ttl_s
            log.warning("load exchange: could not withdraw the report: %s", exc)
        except Exception:
            log.exception("load exchange: withdrawing the report failed")


def _parse(worker_id: str, fields: Mapping[str, str]) -> WorkerReport | None:
    if not fields:
        return None
    try:
        in_flight = {str(k): int(v) for k, v in json.loads(fields["in_flight"]).items()}
        demand = {str(k): int(v) for k, v in json.loads(fields.get("demand", "{}")).items()}
        allowance = {str(k): int(v) for k, v in json.loads(fields.get("allowance", "{}")).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        log.warning("ignoring malformed load report of worker %s", worker_id)
        return None
    return WorkerReport(worker_id, in_flight, demand, allowance)
