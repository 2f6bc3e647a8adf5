"""What routing hands out: engine specs, load views, leases, and the "all full" refusal.

Pure data and the lease's lifecycle; the :class:`worker.routing.router.Router` creates
leases and is told (through the callbacks it gives each one) when one ends. Every
caller that may reach a release from more than one path uses :func:`release_once`:
the first call gives the slot back, later ones do nothing (and are not counted as
double releases, which stay the signature of a bug).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from worker.routing.policy import RouteReason

__all__ = [
    "AllEnginesFull",
    "EngineSpec",
    "Lease",
    "LeaseState",
    "LoadView",
    "release_once",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """An inference engine as the control plane sees it. ``cap``: in-flight requests its
    KV cache can hold (per cluster, not per worker); ``weight`` scales its vnodes and share."""

    id: str
    url: str
    cap: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("engine id must not be empty")
        if self.cap < 1:
            raise ValueError(f"engine {self.id}: cap must be >= 1, got {self.cap}")
        if not self.weight > 0:
            raise ValueError(f"engine {self.id}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class LoadView:
    """What the other workers hold, as computed off the hot path by ``worker.routing.loadshare``.

    ``others``: per engine id, in-flight requests held by the other workers (their last
    reports); ``allowance``: per engine id, how many in-flight requests *this* worker may
    hold. Engines missing from a mapping get 0 others and the full cap."""

    others: Mapping[str, int]
    allowance: Mapping[str, int]


class AllEnginesFull(Exception):
    """No engine can take the request now. ``retry_after_s`` estimates when one will."""

    def __init__(self, retry_after_s: float, reason: str = "all engines at capacity") -> None:
        super().__init__(f"{reason}; retry after {retry_after_s:.2f}s")
        self.retry_after_s = retry_after_s
        self.reason = reason


class LeaseState(enum.Enum):
    """A lease's whole lifecycle: HELD -> RELEASED, once. Releasing again is a counted no-op."""

    HELD = "held"
    RELEASED = "released"


class Lease:
    """One admitted request on one engine. Release exactly once (``with`` does it)."""

    __slots__ = (
        "_on_cached",
        "_on_double",
        "_on_first_token",
        "_on_release",
        "engine",
        "id",
        "preferred",
        "reason",
        "spilled",
        "state",
    )

    def __init__(
        self,
        engine: EngineSpec,
        preferred: str,
        spilled: bool,
        reason: RouteReason | None = None,
        *,
        lease_id: int = 0,
        on_release: Callable[[], None] | None = None,
        on_double_release: Callable[[], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_cached: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.preferred = preferred
        self.spilled = spilled
        self.reason = reason or (RouteReason.SPILLED if spilled else RouteReason.PREFERRED)
        self.id = lease_id
        self._on_release = on_release
        self._on_double = on_double_release
        self._on_first_token = on_first_token
        self._on_cached = on_cached
        self.state = LeaseState.HELD

    def first_token(self) -> None:
        """The engine sent the first token: its prefill is done (cost_aware's queue)."""
        if self._on_first_token is not None:
            self._on_first_token()

    def cached(self, cached_tokens: int, prompt_tokens: int) -> None:
        """What the engine reported of the prompt: tokens it reused, tokens in all (the
        cost model learns from them what the engine keeps)."""
        if self._on_cached is not None:
            self._on_cached(cached_tokens, prompt_tokens)

    def release(self) -> bool:
        """Give the slot back. Returns False (and counts it) when already released."""
        if self.state is LeaseState.RELEASED:
            if self._on_double is not None:
                self._on_double()
            return False
        self.state = LeaseState.RELEASED
        if self._on_release is not None:
            self._on_release()
        return True

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        release_once(self)

    def __repr__(self) -> str:
        return (
            f"Lease(engine={self.engine.id!r}, preferred={self.preferred!r}, "
            f"spilled={self.spilled}, state={self.state.value})"
        )


def release_once(lease: Lease | None) -> None:
    """Give ``lease``'s slot back if it is still held: the one release every path of a
    request may call (engine done, client gone, error, shutdown); only the first one
    releases, and a later one is not a double release."""
    if lease is not None and lease.state is LeaseState.HELD:
        lease.release()
