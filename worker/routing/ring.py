"""The consistent-hash ring: where keys and virtual nodes sit, and who owns each arc.

What it is for: map a routing key to the engines in the order the ring prefers them,
with no notion of load. The :class:`worker.routing.router.Router` owns one ring per
membership (it builds a new one when engine ids or weights change) and applies the
caps, the spill policy and the routing policies on top of it. Pure: no I/O, no clock.

Call order::

    ring = Ring([(engine_id, weight, owner), ...], vnodes=160)  # per membership change
    ring.successors(key)                          # hot path: the distinct owners clockwise

Hashing: every position on the ring and every key is ``mmh3.hash(text, 0, signed=False)``,
the 32-bit MurmurHash3 x86 variant, seed 0 (:func:`key_hash`). Virtual node ``i`` of
engine ``E`` is the hash of ``"E#i"``; an engine of weight ``w`` owns
``max(1, round(vnodes * w))`` of them. Vnodes are ordered by hash, then by engine id.

Each vnode carries the list of *distinct* owners met walking clockwise from it (its own
first), computed once per build, so a spill or a full cluster costs O(engines) on the
hot path, never O(vnodes).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Generic, TypeVar

import mmh3

__all__ = ["Ring", "key_hash"]

T = TypeVar("T")


def key_hash(text: str) -> int:
    """The 32-bit unsigned MurmurHash3 (seed 0) used for keys and virtual nodes alike."""
    return mmh3.hash(text, 0, False)


class Ring(Generic[T]):
    """The vnodes of one membership, sorted by hash, each with its distinct owners
    clockwise. Immutable once built: a membership change builds a new ring.

    ``hashes`` and ``succ`` are index-aligned (``succ[i]`` starts with the owner of the
    vnode at ``hashes[i]``); both are empty when there is no member."""

    __slots__ = ("hashes", "succ")

    def __init__(self, members: Iterable[tuple[str, float, T]], vnodes: int) -> None:
        """``members``: (engine id, weight, owner) per engine, ids distinct; the owner is
        what :meth:`successors` returns (the router's per-engine state)."""
        points: list[tuple[int, str, T]] = []
        n_owners = 0
        for eid, weight, owner in members:
            n_owners += 1
            n = max(1, round(vnodes * weight))
            points.extend((key_hash(f"{eid}#{i}"), eid, owner) for i in range(n))
        points.sort(key=lambda p: (p[0], p[1]))
        self.hashes: list[int] = [p[0] for p in points]
        owners = [p[2] for p in points]
        # Distinct successors, computed right to left over the doubled ring: the list at
        # vnode i is owners[i] followed by the list at i + 1 without owners[i].
        succ: list[tuple[T, ...]] = [()] * len(owners)
        if owners:
            nxt: tuple[T, ...] = ()
            for j in range(2 * len(owners) - 1, -1, -1):
                o = owners[j % len(owners)]
                nxt = (o, *(x for x in nxt if x is not o))[:n_owners]
                if j < len(owners):
                    succ[j] = nxt
        self.succ: list[tuple[T, ...]] = succ

    def successors(self, key: str) -> tuple[T, ...]:
        """The distinct owners clockwise from ``key``'s hash, the preferred one first
        (wrapping past the last vnode). The ring must not be empty."""
        hashes = self.hashes
        i = bisect_left(hashes, key_hash(key))
        return self.succ[i if i < len(hashes) else 0]
