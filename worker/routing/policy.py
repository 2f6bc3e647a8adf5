"""The router's names: routing and spill policies and the reasons for a route.

Pure and tiny, so the router, the cost model, the CLI and the metrics share one spelling.
Each is a :class:`enum.StrEnum`: a member *is* its string, so flags, JSON bodies and
metric labels carry the same values as before these were enums.

Spill: when the preferred engine refuses, ``"walk"`` takes the next acceptable *distinct*
engine clockwise (each vnode carries its precomputed list of distinct successors, so a full
cluster is detected in O(engines)); ``"least_loaded"`` takes the acceptable engine with the
lowest load/cap ratio (what the SGLang gateway does), ties broken in ring order. The routing
simulator (bench/routing/sim.py) finds the two within noise on cache hits and TTFT;
least-loaded spills fewer turns (11 vs 14 % at 0.5 and 0.8 load), so it is the default.
Sizing matters more than the rule: give an engine a cap of about 1.5 x the requests it
runs at once, or the bounded policies spill into a recompute spiral near saturation
(docs/ROUTING.md).

``policy="cost_aware"`` replaces the ring's choice (not the caps): among the engines that
accept by the router's capacity rules (a) and (b), the one with the least expected queue
wait + prefill of the part of the prompt it probably does not hold
(:mod:`worker.routing.cost`), from the ``TurnInfo`` the worker passes (its session's
previous engine, lengths) and the router's own leases and decisions. ``Lease.reason``
says why (``preferred``, ``spilled_cost``, ``least_cost``); ``Lease.first_token()`` tells
it the engine's prefill is done. ``policy="precise"`` is the same model with a block index
fed by the engines' KV-cache events (:mod:`worker.routing.kvevents`): what an engine holds
is read, not guessed, where it publishes them.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "DEFAULT_QUEUE",
    "DEFAULT_QUEUE_SLO_S",
    "DEFAULT_ROUTING",
    "DEFAULT_SPILL",
    "ROUTING_POLICIES",
    "SPILL_POLICIES",
    "RouteReason",
    "RoutingPolicy",
    "SpillPolicy",
]


class SpillPolicy(enum.StrEnum):
    """Where a request goes when its preferred engine refuses it."""

    WALK = "walk"  # the next acceptable distinct engine clockwise
    LEAST_LOADED = "least_loaded"  # the acceptable engine with the lowest load/cap ratio


class RoutingPolicy(enum.StrEnum):
    """How the router picks the engine."""

    # prefix-aware consistent hashing with bounded loads
    RING = "ring"
    # least expected queue wait + prefill of what the engine probably does not hold
    # (worker/routing/cost.py), within the same caps
    COST_AWARE = "cost_aware"
    # cost_aware with what the engines' KV events say they hold (worker/routing/blockindex.py)
    # for the engines that publish them, the estimate for the others
    PRECISE = "precise"
    # ignores the key (and so every KV cache): a baseline for measurements
    ROUND_ROBIN = "round_robin"


class RouteReason(enum.StrEnum):
    """Why a lease is on its engine (``Lease.reason``; a label of the route metrics)."""

    PREFERRED = "preferred"  # the ring's (or the cost model's) first choice
    SPILLED = "spilled"  # ring: the preferred engine refused, the spill policy chose
    SPILLED_COST = "spilled_cost"  # cost_aware: the session's engine was not the cheapest
    LEAST_COST = "least_cost"  # cost_aware: no engine holds the prefix; the cheapest
    # cost_aware: the cheapest engine was at its cap: the turn queues there (within the
    # queue allowance, expected in time for the TTFT SLO)
    QUEUED_PAST_CAP = "queued_past_cap"
    ROUND_ROBIN = "round_robin"  # the baseline


SPILL_POLICIES: Final = tuple(SpillPolicy)
ROUTING_POLICIES: Final = tuple(RoutingPolicy)
# the worker's default (WorkerConfig.routing): chosen by bench/routing/sim.py on the
# Mooncake trace (best goodput at every load up to capacity), see docs/ROUTING.md
DEFAULT_ROUTING: Final[RoutingPolicy] = RoutingPolicy.COST_AWARE
# cost_aware's queue past the cap: up to this many times an engine's cap more turns, each
# expected to get its first token within DEFAULT_QUEUE_SLO_S (the routing simulator's TTFT
# SLO). The cap counts every turn's whole prompt; engines share a prefix's blocks, so on a
# burst of turns on one system prompt an engine runs several times its cap at once. Chosen
# by bench/routing/sim.py on the pulse (2 refuses turns, 4 does no better), docs/ROUTING.md
DEFAULT_QUEUE: Final = 3.0
DEFAULT_QUEUE_SLO_S: Final = 2.0
# chosen by bench/routing/sim.py (fewer spills than walk at the same hit rate), docs/ROUTING.md
DEFAULT_SPILL: Final[SpillPolicy] = SpillPolicy.LEAST_LOADED
