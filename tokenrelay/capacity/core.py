"""Pure: the cluster a target needs, from the whole path's measured costs per token.

A target is ``viewers`` concurrent viewers watching sessions that stream ``tokens_per_s``
tokens each, ``viewers_per_session`` viewers per session; the producer sends
``tokens_per_frame`` tokens per frame (1: no coalescing, as the benchmark measured; each
cost is per frame). From :class:`Costs` (CPU µs
per token of each participant, as ``bench.peers.pathcost`` measures them: the producer
and every Redis node per *published* token, the relay per *delivered* token) and
:class:`Assumptions`, :func:`plan` gives the relays, the Redis masters (and replicas) and
the workers:

- relays: the larger of CPU (deliveries/s x relay µs, over ``cores_per_pod`` x
  ``utilisation`` per pod) and memory (viewers x KB per connection, over
  ``pod_memory_mb`` x ``utilisation``);
- Redis masters: published tokens/s x the masters' µs per token, over
  ``redis_core_ceiling`` x ``utilisation`` per master (one Redis node runs its commands
  on one thread: it cannot use a second core); replicas: ``replicas_per_master`` each,
  checked against the same ceiling;
- workers: published tokens/s x the producer's µs per token (its publish path only, not
  its engine client), over ``cores_per_pod`` x ``utilisation`` per pod.

:func:`costs_from_pathcost` reads the costs out of a pathcost result (its parsed JSON);
:func:`render` is the text ``tokenrelay capacity`` prints. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Assumptions", "Costs", "Plan", "Target", "costs_from_pathcost", "plan", "render"]


@dataclass(frozen=True)
class Costs:
    """CPU µs per token of each participant, and where they were measured."""

    producer_us: float  # per published token
    redis_masters_us: float  # per published token, every master together
    redis_replicas_us: float  # per published token, every replica together
    relay_us: float  # per delivered token
    source: str

    def check(self) -> None:
        for name in ("producer_us", "redis_masters_us", "redis_replicas_us", "relay_us"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class Assumptions:
    cores_per_pod: float = 1.0  # a relay or a worker is one Python event loop
    utilisation: float = 0.6  # of each pod's cores (and memory) the plan may use
    redis_core_ceiling: float = 1.0  # cores one Redis node can use: its command thread
    replicas_per_master: int = 1
    kb_per_conn: float = 4.85  # relay memory per idle WebSocket connection
    kb_source: str = "python -m bench.peers.socketio (idle tokenrelay, bench/README.md)"
    pod_memory_mb: float = 1024.0
    tokens_per_frame: float = 1.0  # the producer's coalescing: tokens a frame carries

    def check(self) -> None:
        if not (0 < self.utilisation <= 1):
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation}")
        for name in ("cores_per_pod", "redis_core_ceiling", "kb_per_conn", "pod_memory_mb",
                     "tokens_per_frame"):  # fmt: skip
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if self.replicas_per_master < 0:
            raise ValueError(f"replicas_per_master must be >= 0, got {self.replicas_per_master}")


@dataclass(frozen=True)
class Target:
    viewers: int
    tokens_per_s: float  # per session
    viewers_per_session: float

    def check(self) -> None:
        if self.viewers < 1:
            raise ValueError(f"viewers must be >= 1, got {self.viewers}")
        if not (math.isfinite(self.tokens_per_s) and self.tokens_per_s > 0):
            raise ValueError(f"tokens/s per session must be > 0, got {self.tokens_per_s}")
        if not (1 <= self.viewers_per_session <= self.viewers):
            raise ValueError(
                f"viewers per session must be in 1 .. {self.viewers}, "
                f"got {self.viewers_per_session}"
            )


@dataclass(frozen=True)
class Plan:
    target: Target
    sessions: int
    published_per_s: float
    delivered_per_s: float
    relay_cores: float
    relays: int
    relays_bound_by: str  # "cpu" or "memory"
    relay_memory_gb: float
    redis_master_cores: float
    masters: int
    replicas: int
    worker_cores: float
    workers: int


def _pods(need: float, per_pod: float) -> int:
    return max(1, math.ceil(need / per_pod - 1e-9))


def plan(target: Target, costs: Costs, a: Assumptions) -> Plan:
    target.check()
    costs.check()
    a.check()
    sessions = math.ceil(target.viewers / target.viewers_per_session)
    published = sessions * target.tokens_per_s / a.tokens_per_frame  # frames/s
    delivered = target.viewers * target.tokens_per_s / a.tokens_per_frame
    relay_cores = delivered * costs.relay_us / 1e6
    by_cpu = _pods(relay_cores, a.cores_per_pod * a.utilisation)
    memory_mb = target.viewers * a.kb_per_conn / 1024
    by_mem = _pods(memory_mb, a.pod_memory_mb * a.utilisation)
    master_cores = published * costs.redis_masters_us / 1e6
    masters = _pods(master_cores, a.redis_core_ceiling * a.utilisation)
    replica_cores = published * costs.redis_replicas_us / 1e6
    if a.replicas_per_master:  # replicas each take their master's share of the writes
        per_replica = replica_cores / (masters * a.replicas_per_master)
        if per_replica > a.redis_core_ceiling * a.utilisation:
            masters = _pods(replica_cores / a.replicas_per_master,
                            a.redis_core_ceiling * a.utilisation)  # fmt: skip
    worker_cores = published * costs.producer_us / 1e6
    return Plan(
        target=target,
        sessions=sessions,
        published_per_s=published,
        delivered_per_s=delivered,
        relay_cores=round(relay_cores, 3),
        relays=max(by_cpu, by_mem),
        relays_bound_by="cpu" if by_cpu >= by_mem else "memory",
        relay_memory_gb=round(memory_mb / 1024, 2),
        redis_master_cores=round(master_cores, 3),
        masters=masters,
        replicas=masters * a.replicas_per_master,
        worker_cores=round(worker_cores, 3),
        workers=_pods(worker_cores, a.cores_per_pod * a.utilisation),
    )


def _pick(phases: Mapping[str, Any], results: Mapping[str, Any], viewers: float) -> str:
    """The tokenrelay steady phase whose viewers per session are nearest ``viewers``
    (the fastest of those that kept up, else the fastest)."""
    steady = [n for n, p in phases.items() if p["kind"] == "steady" and "tokenrelay" in
              results.get(n, {})]  # fmt: skip
    if not steady:
        raise ValueError("the pathcost result has no steady phase with tokenrelay figures")
    near = min(abs(phases[n]["viewers"] - viewers) for n in steady)
    cands = [n for n in steady if abs(phases[n]["viewers"] - viewers) == near]
    kept = [n for n in cands if results[n]["tokenrelay"]["kept_up"]] or cands
    return max(kept, key=lambda n: float(phases[n]["tokens_per_s"]))


def costs_from_pathcost(res: Mapping[str, Any], viewers_per_session: float) -> Costs:
    """tokenrelay's costs out of a pathcost result: the producer's and Redis's per
    published token from its fastest one-reader phase that kept up, the relay's per
    delivered token from the phase nearest the target's viewers per session."""
    try:
        phases, results = res["phases"], res["results"]
        one = _pick(phases, results, 1)
        fan = _pick(phases, results, viewers_per_session)
        pub = results[one]["tokenrelay"]["us_per_published"]
        return Costs(
            producer_us=float(pub["producer"]),
            redis_masters_us=float(pub["redis_masters"]),
            redis_replicas_us=float(pub["redis_replicas"]),
            relay_us=float(results[fan]["tokenrelay"]["us_per_token"]["server"]),
            source=f"producer and Redis from {one}, relay from {fan}",
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a pathcost result with tokenrelay figures (no {exc})") from None


def _n(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.2f}"


def render(plans: Sequence[Plan], costs: Costs, a: Assumptions) -> str:
    """The table and the assumptions it rests on (markdown)."""
    head = ("viewers", "sessions", "frames/s published", "deliveries/s", "relays",
            "relay cores", "Redis masters (+replicas)", "master cores", "workers",
            "worker cores")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        cells = (f"{p.target.viewers:,}", f"{p.sessions:,}", _n(p.published_per_s),
                 _n(p.delivered_per_s), f"{p.relays:,} ({p.relays_bound_by})",
                 _n(p.relay_cores), f"{p.masters:,} (+{p.replicas:,})",
                 _n(p.redis_master_cores), f"{p.workers:,}", _n(p.worker_cores))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    t = plans[0].target if plans else None
    shape = (
        []
        if t is None
        else [
            f"- {t.tokens_per_s:g} tokens/s per session, {t.viewers_per_session:g} viewers per "
            f"session, {a.tokens_per_frame:g} token(s) per frame (the measured costs are "
            "per frame of one token)"
        ]
    )
    lines += [
        "",
        "Assumptions:",
        *shape,
        f"- costs (CPU µs per token): producer {costs.producer_us:g} and Redis masters "
        f"{costs.redis_masters_us:g} / replicas {costs.redis_replicas_us:g} per published "
        f"token, relay {costs.relay_us:g} per delivered token ({costs.source})",
        f"- {a.cores_per_pod:g} core(s) per relay or worker pod, used to "
        f"{a.utilisation:.0%}; {a.pod_memory_mb:g} MB per relay pod, used to "
        f"{a.utilisation:.0%}",
        f"- {a.kb_per_conn:g} KB of relay memory per connection ({a.kb_source})",
        f"- one Redis node uses at most {a.redis_core_ceiling:g} core(s), planned to "
        f"{a.utilisation:.0%}; {a.replicas_per_master} replica(s) per master",
        "- workers: the publish path's CPU only (the benchmark's paced publisher), not the "
        "engine client, tokenizer or HTTP",
    ]
    return "\n".join(lines)
