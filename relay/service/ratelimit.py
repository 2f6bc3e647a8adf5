"""Token buckets by key (a client address), bounded in memory. Pure: the caller passes ``now``.

A bucket holds at most ``burst`` tokens and gains ``rate_per_s`` per second; each
request takes one. :meth:`Buckets.take` answers 0.0 (allowed) or the seconds until a
token is there (refused: the ``Retry-After``). At most ``max_keys`` buckets are kept,
least recently used first out: an evicted key starts again from a full bucket, which
only ever lets a flood of *distinct* addresses through at their first ``burst`` each.

Order of use: ``b = Buckets(rate_per_s=1.0, burst=20)``; per request
``wait = b.take(address, time.monotonic())``; ``wait > 0`` -> 429 with
``Retry-After: ceil(wait)``. ``rate_per_s == 0`` disables the limit.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Buckets"]


class Buckets:
    """Per-key token buckets (see the module docstring)."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 100_000) -> None:
        if rate_per_s < 0 or burst < 1 or max_keys < 1:
            raise ValueError("need rate_per_s >= 0, burst >= 1, max_keys >= 1")
        self.rate, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, now: float) -> float:
        """Take one token from ``key``'s bucket: 0.0 if there was one, else the wait."""
        if not self.enabled:
            return 0.0
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(now - at, 0.0) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait
