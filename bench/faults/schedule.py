"""The nemesis's schedule: which faults start when and for how long, from a seed. Pure.

Faults come in bursts, so that they overlap in time as real outages do (a failover
during a slot migration while a relay restarts): each burst starts two to four faults
within a few seconds of each other, each holding for seconds (a process down or frozen,
a port partitioned). :func:`overlapping` counts the faults whose time overlaps another's.
The executor (:mod:`bench.faults.nemesis`) may still refuse a fault at its time, for a
combination that cannot be survived by design (both nodes of one shard down at once);
it says so in the history.

Order of use::

    faults = plan(seed=7, duration_s=180, bursts=4)
    overlapping(faults)       # how many overlap another
    faults[0].at_s, faults[0].kind, faults[0].hold_s, faults[0].pick
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

__all__ = ["HOLD_S", "KINDS", "Fault", "overlapping", "plan"]

# kind -> (shortest, longest) hold in seconds: how long a process stays down or frozen,
# a port partitioned; 0 for a fault that is one act (a failover, a slot migration)
HOLD_S: Final[dict[str, tuple[float, float]]] = {
    "relay_kill": (1.0, 6.0),  # SIGKILL, restarted after the hold
    "relay_freeze": (1.0, 5.0),  # SIGSTOP, SIGCONT after the hold
    "worker_kill": (1.0, 6.0),
    "worker_freeze": (1.0, 5.0),
    "master_kill": (3.0, 8.0),  # its replica is promoted; the node returns as a replica
    "master_freeze": (0.5, 4.0),  # past the 2 s node timeout: an automatic failover
    "replica_kill": (2.0, 8.0),
    "failover": (0.0, 0.0),  # CLUSTER FAILOVER on a replica of a busy master
    "migrate": (0.0, 0.0),  # a slot with live sessions moves to another master
    "partition": (2.0, 6.0),  # a master's client port drops every packet (iptables)
    "storm": (0.0, 0.0),  # half the screens drop and reconnect at once
    "producer_kill": (1.0, 6.0),  # a producer of your own (Python or Node), restarted
}
KINDS: Final = tuple(HOLD_S)


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # from the start of the run
    kind: str
    hold_s: float
    pick: int  # the executor's choice among the targets of this kind (modulo their count)

    @property
    def end_s(self) -> float:
        return self.at_s + self.hold_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    *,
    seed: int,
    duration_s: float,
    bursts: int,
    kinds: Sequence[str] = KINDS,
    warm_s: float = 5.0,
    quiet_s: float = 15.0,
) -> list[Fault]:
    """``bursts`` bursts of 2-4 faults of ``kinds`` between ``warm_s`` and
    ``duration_s - quiet_s`` (the quiet end lets every screen catch up before the
    checker reads), sorted by start. The same arguments give the same schedule."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds: {', '.join(unknown)} (known: {', '.join(KINDS)})")
    if not kinds:
        raise ValueError("no fault kinds to schedule")
    last = duration_s - quiet_s - max(hi for lo, hi in (HOLD_S[k] for k in kinds))
    if last <= warm_s or bursts < 1:
        raise ValueError(f"a run of {duration_s:g} s has no room for {bursts} bursts")
    rng = random.Random(seed)
    out: list[Fault] = []
    span = (last - warm_s) / bursts
    for b in range(bursts):
        start = warm_s + b * span + rng.uniform(0, span * 0.5)
        for _ in range(rng.randint(2, 4)):
            kind = rng.choice(list(kinds))
            lo, hi = HOLD_S[kind]
            at = min(last, start + rng.uniform(0, 3.0))
            out.append(
                Fault(round(at, 2), kind, round(rng.uniform(lo, hi), 2), rng.randrange(1 << 30))
            )
    return sorted(out, key=lambda f: (f.at_s, f.kind))


def overlapping(faults: Sequence[Fault], *, act_s: float = 2.0) -> int:
    """How many faults overlap another in time (a fault of one act counts ``act_s``:
    a failover or a migration takes about that long)."""
    spans = [(f.at_s, f.at_s + max(f.hold_s, act_s)) for f in faults]
    return sum(
        1
        for i, (a0, a1) in enumerate(spans)
        if any(j != i and b0 < a1 and a0 < b1 for j, (b0, b1) in enumerate(spans))
    )
