"""Prefix-aware consistent hashing with bounded loads: the pure router core.

What it is for: choose the inference engine for one request, in local memory, in a few
microseconds, so that a conversation lands on the engine that holds its KV cache while no
engine takes more than its share. No I/O (:func:`route_wait` in :mod:`worker.routing.wait`).

Call order::

    router = Router(specs, vnodes=160, eps=0.25)       # build the ring
    with router.route(key) as lease:                    # or lease = route(...); lease.release()
        ... stream from lease.engine.url ...
    router.set_engines(specs)                           # control plane, ~1/s
    router.apply_load_view(view)                        # load exchange, ~4/s (loadshare.py)
    router.snapshot()                                   # metrics

The ring itself (hashing, virtual nodes, each vnode's distinct engines clockwise) is
:mod:`worker.routing.ring`; this module applies the caps, the spill policy and the routing
policies to the engines it names, and accounts for the leases.

Capacity: an engine accepts a new request when (a) it is not draining, (b) this worker's
in-flight count on it is below its *effective cap* (the fixed cap derived from the KV-cache
size, or this worker's allowance of it when a load view is applied), and (c) its estimated
global in-flight is below ``ceil((1 + eps) * (total + 1) * w / W)``, the bounded-load rule
of Mirrokni, Thorup and Zadimoghaddam (total = in flight over the cluster including the
new request, W = sum of the weights of the routable engines).

Queue past the cap (``cost_aware``, ``queue`` > 0): the cheapest engine takes a turn past
its effective cap, up to ``floor(queue * cap)`` more, when the turn's expected time to first
token there is within ``queue_slo_s`` (:meth:`CostModel.choose_queued`); lease reason
``queued_past_cap``. An engine then holds at most ``(1 + queue) * cap`` over all workers.

Spill (the preferred engine refuses) and the routing policies: :mod:`worker.routing.policy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Final

from worker.routing.blockindex import BlockIndex
from worker.routing.cost import CostModel, CostProfile, TurnInfo
from worker.routing.lease import AllEnginesFull, EngineSpec, Lease, LoadView
from worker.routing.policy import (
    DEFAULT_QUEUE,
    DEFAULT_QUEUE_SLO_S,
    DEFAULT_SPILL,
    ROUTING_POLICIES,
    SPILL_POLICIES,
    RouteReason,
    RoutingPolicy,
    SpillPolicy,
)
from worker.routing.profile import Profiles
from worker.routing.ring import Ring

__all__ = ["Router"]

_RETRY_MIN_S: Final = 0.05
_RETRY_MAX_S: Final = 30.0
_HOLD_PRIOR_S: Final = 2.0  # assumed lease duration before any lease was released
_EWMA_ALPHA: Final = 0.05


class _Engine:
    """Mutable per-engine state, owned by the Router."""

    __slots__ = (
        "allowance",
        "draining",
        "factor",
        "in_flight",
        "others",
        "refused",
        "removed",
        "spec",
        "waiting",
    )

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.in_flight = 0  # leases held by this worker
        self.others = 0  # in flight at other workers (load view)
        self.allowance = spec.cap  # this worker's effective cap
        self.draining = False
        self.removed = False
        self.factor = 0.0  # (1 + eps) * weight / total weight; 0 when not routable
        self.refused = 0  # routes refused since the last take_unmet() that wanted it
        self.waiting = 0  # requests in route_wait that want it


class Router:
    """The ring, the capacity rule and the spill policy. Not thread-safe: one event loop."""

    def __init__(
        self,
        engines: Iterable[EngineSpec],
        *,
        vnodes: int = 160,
        eps: float = 0.25,
        spill: str = DEFAULT_SPILL,
        policy: str = RoutingPolicy.RING,
        clock: Callable[[], float] = time.monotonic,
        cost_profile: CostProfile | None = None,
        queue: float = DEFAULT_QUEUE,
        queue_slo_s: float = DEFAULT_QUEUE_SLO_S,
        index: BlockIndex | None = None,
        profiles: Profiles | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        if min(eps, queue, queue_slo_s) < 0:
            raise ValueError("eps, queue and queue_slo_s must be >= 0")
        if spill not in SPILL_POLICIES:
            raise ValueError(f"spill must be one of {', '.join(SPILL_POLICIES)}, got {spill!r}")
        self.vnodes, self.eps = vnodes, eps
        self.queue, self.queue_slo_s = queue, queue_slo_s
        self.spill = SpillPolicy(spill)
        self.policy = RoutingPolicy(policy)
        self._rr = 0  # next index for the round-robin baseline
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._ring: Ring[_Engine] = Ring((), vnodes)  # rebuilt on every membership change
        self._total = 0  # in flight at this worker on routable engines
        self._others_total = 0
        self._hold_s = _HOLD_PRIOR_S
        self._routes = 0
        self._spills = 0
        self._rejections = 0
        self._double_releases = 0
        self._listeners: list[Callable[[], None]] = []
        self._lease_ids = 0
        self._cost_profile = cost_profile or CostProfile()
        self._cost: CostModel | None = None
        self.profiles = profiles or Profiles()  # each engine's shape and speed
        self.index = index if self.policy is RoutingPolicy.PRECISE else None
        for spec in engines:
            if spec.id in self._engines:
                raise ValueError(f"duplicate engine id {spec.id!r}")
            self._engines[spec.id] = _Engine(spec)
        self._rebuild()

    # ---- the hot path -------------------------------------------------------------------

    def route(self, key: str, avoid: str | None = None, turn: TurnInfo | None = None) -> Lease:
        """Admit a request for ``key``; raise :class:`AllEnginesFull` when nothing accepts.

        ``avoid``: an engine id not to use (it just refused a connection); the request
        spills past it as if it were full. A refusal counts as unmet demand on the engine
        the request would have used (:meth:`take_unmet`)."""
        lease = self.try_route(key, avoid, turn)
        if lease is None:
            self._routes += 1
            self._rejections += 1
            if not self._ring.hashes:
                raise AllEnginesFull(self.retry_after(), "no routable engine")
            self._engine_wanted(key, turn).refused += 1
            raise AllEnginesFull(self.retry_after())
        return lease

    def try_route(
        self, key: str, avoid: str | None = None, turn: TurnInfo | None = None
    ) -> Lease | None:
        """:meth:`route` without the exception and without counting demand: ``None`` when
        nothing accepts (:func:`route_wait` counts its waiter once instead). ``turn``:
        what the worker knows of the turn (cost_aware; the ring ignores it)."""
        ring = self._ring
        if not ring.hashes:
            return None
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return self._try_round_robin(avoid)
        if self._cost is not None:
            return self._try_cost(key, avoid, turn)
        succ = ring.successors(key)
        first = succ[0]
        total1 = self._total + self._others_total + 1
        walk = self.spill is SpillPolicy.WALK
        chosen: _Engine | None = None
        best = math.inf
        for e in succ:  # the owner first, then clockwise; one rule for every candidate
            if (
                e.spec.id != avoid
                and not e.draining
                and e.in_flight < e.allowance
                and e.in_flight + e.others < math.ceil(e.factor * total1)
            ):
                if e is first or walk:  # the owner itself, or (walk) the next that fits
                    chosen = e
                    break
                ratio = (e.in_flight + e.others) / e.spec.cap  # least loaded for its cap
                if ratio < best:
                    best, chosen = ratio, e
        if chosen is None:
            return None
        if chosen is first:
            return self._admit(first, first, False)
        self._spills += 1
        return self._admit(chosen, first, True)

    def _try_cost(self, key: str, avoid: str | None, turn: TurnInfo | None) -> Lease | None:
        """cost_aware: the cheapest engine by :class:`CostModel` under this worker's cap (rules
        (a) and (b); no eps bound: the queue estimate balances) or in its queue past it."""
        cost = self._cost
        assert cost is not None
        under: list[str] = []
        past: list[str] = []
        for eid, e in self._engines.items():
            if eid != avoid and not e.draining:
                if e.in_flight < e.allowance:
                    under.append(eid)
                elif e.in_flight < e.allowance + math.floor(self.queue * e.allowance):
                    past.append(eid)
        info = TurnInfo(prompt_tokens=1) if turn is None else turn
        if not info.key:
            info = replace(info, key=key)
        others = {eid: e.others for eid, e in self._engines.items()}
        order = [e.spec.id for e in self._ring.successors(key)] if self._ring.hashes else []
        picked = cost.choose_queued(info, others, under, past, self.queue_slo_s, order)
        if picked is None:
            return None
        choice, queued = picked
        slot = self._engines[choice.engine]
        reason = RouteReason.QUEUED_PAST_CAP if queued else choice.reason
        spilled = choice.reason is RouteReason.SPILLED_COST
        if spilled:
            self._spills += 1
        lease = self._admit(slot, slot, spilled, reason)
        cost.admitted(lease.id, choice, cost.resolve(info))
        return lease

    def _try_round_robin(self, avoid: str | None) -> Lease | None:
        """The baseline that ignores the key: the next engine in turn that is not
        draining and has room in this worker's allowance (the same caps as the ring)."""
        engines = [e for e in self._engines.values() if not e.draining]
        n = len(engines)
        for j in range(n):
            e = engines[(self._rr + j) % n]
            if e.spec.id != avoid and e.in_flight < e.allowance:
                self._rr = (self._rr + j + 1) % n
                return self._admit(e, e, False, RouteReason.ROUND_ROBIN)
        return None

    def _engine_wanted(self, key: str, turn: TurnInfo | None = None) -> _Engine:
        """Where a refused request would go if this worker's share allowed it: cost_aware's
        cheapest engine that is not draining; the ring's first engine clockwise that is not
        draining and has room cluster-wide, else the first that is not draining (all full:
        wait for the preferred one). Only on the refusal path; the ring is not empty."""
        ok = [eid for eid, e in self._engines.items() if not e.draining]
        if self._cost is not None and turn is not None and ok:
            others = {eid: e.others for eid, e in self._engines.items()}
            return self._engines[
                self._cost.choose(replace(turn, key=turn.key or key), others, ok).engine
            ]
        succ = self._ring.successors(key)
        for e in succ:
            if not e.draining and e.in_flight + e.others < e.spec.cap:
                return e
        return next((e for e in succ if not e.draining), succ[0])

    def add_waiter(self, key: str, turn: TurnInfo | None = None) -> str:
        """Count a request that waits for a slot as unmet demand (on the engine it wants)
        until :meth:`remove_waiter`; returns that engine's id."""
        if not self._ring.hashes:
            return ""
        e = self._engine_wanted(key, turn)
        e.waiting += 1
        return e.spec.id

    def remove_waiter(self, engine_id: str) -> None:
        e = self._engines.get(engine_id)
        if e is not None and e.waiting > 0:
            e.waiting -= 1

    def _admit(
        self, slot: _Engine, preferred: _Engine, spilled: bool, reason: RouteReason | None = None
    ) -> Lease:
        self._routes += 1
        slot.in_flight += 1
        self._total += 1
        lease_id = self._lease_ids
        self._lease_ids += 1
        t0 = self._clock()

        def released() -> None:
            self._release(slot, t0, lease_id)

        def double() -> None:
            self._double_releases += 1

        def first_token() -> None:
            if self._cost is not None:
                self._cost.first_token(lease_id)

        def cached(cached_tokens: int, prompt_tokens: int) -> None:
            if self._cost is not None:
                self._cost.reported(lease_id, cached_tokens, prompt_tokens)

        return Lease(slot.spec, preferred.spec.id, spilled, reason, lease_id=lease_id,
                     on_release=released, on_double_release=double,
                     on_first_token=first_token, on_cached=cached)  # fmt: skip

    def _release(self, slot: _Engine, t0: float, lease_id: int) -> None:
        if self._cost is not None:
            self._cost.finished(lease_id)
        slot.in_flight -= 1
        if not slot.removed:
            self._total -= 1
        self._hold_s += _EWMA_ALPHA * ((self._clock() - t0) - self._hold_s)
        if self._listeners:
            for cb in tuple(self._listeners):
                cb()

    def retry_after(self) -> float:
        """Expected wait until a slot frees: with n leases of mean duration h in flight,
        one ends every h / n seconds on average."""
        n = max(1, self._total)
        return min(_RETRY_MAX_S, max(_RETRY_MIN_S, self._hold_s / n))

    # ---- lookups --------------------------------------------------------------------------

    def preferred(self, key: str) -> str:
        """The engine the ring prefers for ``key`` regardless of load (draining included)."""
        if not self._ring.hashes:
            raise AllEnginesFull(self.retry_after(), "no routable engine")
        return self._ring.successors(key)[0].spec.id

    def engines(self) -> list[EngineSpec]:
        return [e.spec for e in self._engines.values()]

    def in_flight(self) -> dict[str, int]:
        """This worker's in-flight leases per engine (what the load exchange reports)."""
        return {eid: e.in_flight for eid, e in self._engines.items()}

    def allowances(self) -> dict[str, int]:
        """This worker's effective cap per engine (its in-flight past it are queued)."""
        return {eid: e.allowance for eid, e in self._engines.items()}

    def take_unmet(self) -> dict[str, int]:
        """Per engine, the demand this worker could not place: routes refused since the
        last call plus requests waiting now (what the load exchange reports as want)."""
        out = {eid: e.refused + e.waiting for eid, e in self._engines.items()}
        for e in self._engines.values():
            e.refused = 0
        return out

    def snapshot(self) -> dict[str, Any]:
        engines = {
            eid: {
                "in_flight": e.in_flight,
                "others": e.others,
                "cap": e.spec.cap,
                "effective_cap": min(e.spec.cap, e.allowance),
                "queued": max(0, e.in_flight - e.allowance),  # past the cap (cost_aware)
                "waiting": e.waiting,
                "weight": e.spec.weight,
                "draining": e.draining,
            }
            for eid, e in self._engines.items()
        }
        return {
            "engines": engines,
            "spill": self.spill,
            "policy": self.policy,
            "vnodes": self.vnodes,
            "eps": self.eps,
            "queue": self.queue if self._cost is not None else 0.0,
            "counters": {
                "routes": self._routes,
                "spills": self._spills,
                "rejections": self._rejections,
                "double_releases": self._double_releases,
                "in_flight": self._total,
            },
        }

    # ---- membership (control plane) -----------------------------------------------------

    def add_engine(self, spec: EngineSpec) -> None:
        if spec.id in self._engines:
            raise ValueError(f"engine {spec.id!r} already present")
        self._engines[spec.id] = _Engine(spec)
        self._rebuild()

    def drain_engine(self, engine_id: str) -> None:
        """No new routes to ``engine_id``; its leases finish. Its vnodes stay on the ring,
        so its keys spill exactly where they will go once it is removed."""
        self._engines[engine_id].draining = True
        self._reweigh()

    def remove_engine(self, engine_id: str) -> None:
        """Take the engine off the ring. Leases still held on it release harmlessly."""
        e = self._engines.pop(engine_id)
        e.removed = True
        self._total -= e.in_flight
        self._others_total -= e.others
        self._rebuild()

    def set_engines(self, specs: Iterable[EngineSpec]) -> None:
        """Reconcile to ``specs``: add new ids, update changed specs, remove missing ids.
        The ring is rebuilt only when ids or weights changed."""
        wanted = {s.id: s for s in specs}
        rebuild = False
        for eid in [eid for eid in self._engines if eid not in wanted]:
            e = self._engines.pop(eid)
            e.removed = True
            self._total -= e.in_flight
            self._others_total -= e.others
            rebuild = True
        for eid, spec in wanted.items():
            cur = self._engines.get(eid)
            if cur is None:
                self._engines[eid] = _Engine(spec)
                rebuild = True
            elif cur.spec != spec:
                rebuild = rebuild or cur.spec.weight != spec.weight
                if cur.allowance == cur.spec.cap:
                    cur.allowance = spec.cap
                cur.allowance = min(cur.allowance, spec.cap)
                cur.spec = spec
        if rebuild:
            self._rebuild()

    def apply_load_view(self, view: LoadView | None) -> None:
        """Install what other workers hold (``None``: this worker is alone). Wakes the
        release listeners when the view frees room (a larger allowance, fewer held by
        others), so a route waiting in :func:`route_wait` retries at once."""
        others_total = 0
        freed = False
        for eid, e in self._engines.items():
            before = (e.allowance, e.others)
            if view is None:
                e.others, e.allowance = 0, e.spec.cap
            else:
                e.others = max(0, view.others.get(eid, 0))
                e.allowance = min(e.spec.cap, max(0, view.allowance.get(eid, e.spec.cap)))
            freed = freed or e.allowance > before[0] or e.others < before[1]
            others_total += e.others
        self._others_total = others_total
        if freed and self._listeners:
            for cb in tuple(self._listeners):
                cb()

    def add_release_listener(self, cb: Callable[[], None]) -> None:
        self._listeners.append(cb)

    def remove_release_listener(self, cb: Callable[[], None]) -> None:
        self._listeners.remove(cb)

    # ---- ring construction ----------------------------------------------------------------
    def _reweigh(self) -> None:
        routable = [e for e in self._engines.values() if not e.draining]
        wsum = sum(e.spec.weight for e in routable)
        for e in self._engines.values():
            e.factor = 0.0 if e.draining else (1.0 + self.eps) * e.spec.weight / wsum

    def _rebuild(self) -> None:
        members = ((eid, e.spec.weight, e) for eid, e in self._engines.items())
        self._ring = Ring(members, self.vnodes)
        self._total = sum(e.in_flight for e in self._engines.values())
        self._others_total = sum(e.others for e in self._engines.values())
        self._reweigh()
        if self.policy in (RoutingPolicy.COST_AWARE, RoutingPolicy.PRECISE):
            if self._cost is None:
                self._cost = CostModel(
                    list(self._engines), self._cost_profile, index=self.index,
                    profiles=self.profiles,
                )  # fmt: skip
            else:
                self._cost.engines = list(self._engines)
