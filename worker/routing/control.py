"""The control plane: which engines are alive, kept off the hot path.

Two sources of engines, usable together:

* **static** (``--engine URL`` or ``--engine ID=URL``): probed about once a second with
  ``GET <base>/health`` (an answer of 404, an engine without the route, counts as alive), each probe
  bounded by ``probe_timeout_s``. ``fail_after`` consecutive failures take the engine out
  of the ring; one success puts it back.
* **heartbeats** in Redis (``discover=True``): an engine (or a sidecar next to it)
  announces itself with :class:`EngineAnnouncer`, which every ``ttl_s / 3`` seconds writes

  - hash ``tr:engines:{<id>}`` fields ``url``, ``cap``, ``weight`` (PEXPIRE ``ttl_s``),
  - sorted set ``tr:engines``: member ``<id>``, score = last heartbeat Unix ms.

  An engine is alive while its hash exists and its score is within ``ttl_s``; a dead
  engine's hash simply expires. The mock engine can announce itself by running an
  ``EngineAnnouncer`` when given ``--redis`` (owned by ``devstack/mockengine/cli.py``).

Engine ids must agree between workers (the ring hashes them): the id of ``--engine URL``
is the URL's ``host:port``; ``ID=URL`` names it explicitly.

Order of use::

    cp = ControlPlane(router, http, static_specs, redis=r, on_engine_down=turns.abort_engine)
    await cp.start(supervisor)   # loops engine_probes and engine_heartbeats on it
    ... cp.alive() ...
    await supervisor.stop(); await cp.stop()

Both loops are critical (a dead one freezes the router's membership: turns keep going to
an engine that left, or never to one that came); a failing heartbeat read keeps the
last view of the announced engines. ``cp.tick()`` runs both steps once (tests).

Each step reconciles the router (``router.set_engines``) and calls
``on_engine_down(engine_id, reason)`` for every engine that left, so the turn runner can
end its in-flight streams with an ``error`` frame (the lease of a removed engine releases
harmlessly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from relay.broker.errors import RelayError
from relay.broker.port import Registry
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.keys import ENGINES_REGISTRY, engine_key
from relay.service.supervise import Supervisor
from worker.routing.lease import EngineSpec
from worker.routing.router import Router

__all__ = [
    "ControlPlane",
    "EngineAnnouncer",
    "ProbeState",
    "parse_engine_arg",
    "read_announced",
]

log = logging.getLogger(__name__)


def parse_engine_arg(arg: str, cap: int, weight: float = 1.0) -> EngineSpec:
    """``URL`` or ``ID=URL`` -> EngineSpec (id defaults to the URL's ``host:port``)."""
    eid, sep, url = arg.partition("=")
    if not sep or "://" in eid:
        eid, url = "", arg
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL must be http(s)://host[:port][/v1], got {url!r}")
    if not eid:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        eid = f"{parts.hostname}:{port}"
    engine_key(eid)  # the id must be usable as a hash tag: raises ValueError if not
    return EngineSpec(id=eid, url=url.rstrip("/"), cap=cap, weight=weight)


def _base(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


@dataclass(slots=True)
class ProbeState:
    """Pure liveness rule of one static engine: ``fail_after`` failures in a row -> dead,
    one success -> alive. Starts alive (a fresh worker routes at once)."""

    fail_after: int = 2
    failures: int = 0
    alive: bool = True

    def record(self, ok: bool) -> bool:
        """Record a probe result; return True when ``alive`` changed."""
        before = self.alive
        if ok:
            self.failures = 0
            self.alive = True
        else:
            self.failures += 1
            if self.failures >= self.fail_after:
                self.alive = False
        return before != self.alive


async def probe(http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """True if the engine answers its health endpoint with 2xx within ``timeout_s``; an
    engine without one (404: llama-cpp-python's server) is alive when it answers at all.
    Never ``/v1/models`` as a probe: llama-cpp-python's server takes its model lock for
    it, and with its default ``interrupt_requests`` a request waiting for that lock ends
    the reply streaming at that moment (``[DONE]``, no finish reason): a probe a second
    cut every turn longer than a second, most of them at 0 tokens."""
    base = _base(url)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.get(base + "/health", timeout=timeout) as resp:
            return 200 <= resp.status < 300 or resp.status == 404
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


def _registry(store: Registry | Any) -> Registry:
    """``store``, or the Redis store of a cluster client."""
    return store if isinstance(store, Registry) else RedisStore(store)


async def read_announced(store: Registry | Any, ttl_s: float) -> list[EngineSpec]:
    """Engines whose heartbeat is fresh, from the registry and their reports."""
    now_ms = time.time_ns() // 1_000_000
    registry = _registry(store)
    names = await registry.members_since(ENGINES_REGISTRY, now_ms - int(ttl_s * 1000))
    if not names:
        return []
    rows = await registry.reports([engine_key(eid) for eid in names])
    out: list[EngineSpec] = []
    for eid, fields in zip(names, rows, strict=True):
        try:
            out.append(
                EngineSpec(
                    id=eid,
                    url=fields["url"],
                    cap=int(fields["cap"]),
                    weight=float(fields.get("weight", 1.0)),
                )
            )
        except (KeyError, ValueError):
            continue  # expired or malformed: not alive
    return out


class EngineAnnouncer:
    """Writes one engine's heartbeat every ``ttl_s / 3`` seconds until stopped, into
    ``store``'s registry (a cluster client: its Redis store's; ``redis`` is what was
    given, the caller's to close)."""

    def __init__(self, store: Registry | Any, spec: EngineSpec, *, ttl_s: float = 3.0) -> None:
        self.redis: Any = store
        self.registry = _registry(store)
        self.spec = spec
        self.ttl_s = ttl_s
        self._supervisor: Supervisor | None = None
        self._own_supervisor = False

    async def beat(self) -> None:
        now_ms = time.time_ns() // 1_000_000  # a score other processes compare: wall clock
        fields = {"url": self.spec.url, "cap": str(self.spec.cap), "weight": str(self.spec.weight)}
        await self.registry.report(engine_key(self.spec.id), fields, int(self.ttl_s * 1000))
        await self.registry.join(ENGINES_REGISTRY, self.spec.id, now_ms, 3_600_000)

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Beat once (raises when the store cannot take it), then every ``ttl_s / 3`` on
        ``supervisor`` (or one of its own). Critical: an engine whose heartbeat stops is
        taken out of every worker's ring when its entry expires."""
        await self.beat()
        if self._supervisor is not None:
            return
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        period = self.ttl_s / 3
        self._supervisor.every(
            f"engine_heartbeat:{self.spec.id}", period, self.beat, first_delay_s=period
        )

    async def stop(self, *, withdraw: bool = True) -> None:
        """Stop beating (a shared supervisor is the caller's to stop) and, with
        ``withdraw``, delete the entry at once. Never raises."""
        sup, self._supervisor = self._supervisor, None
        if sup is not None and self._own_supervisor:
            await sup.stop()
        if withdraw:
            try:
                await self.registry.leave(ENGINES_REGISTRY, self.spec.id, engine_key(self.spec.id))
            except RelayError as exc:  # the entry expires by itself within ttl_s
                log.warning("engine heartbeat: could not withdraw %s: %s", self.spec.id, exc)


class ControlPlane:
    """Keeps ``router`` membership equal to the live engines, about once a second."""

    def __init__(
        self,
        router: Router,
        http: aiohttp.ClientSession,
        static: Iterable[EngineSpec],
        *,
        redis: Registry | Any | None = None,
        discover: bool = False,
        interval_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        fail_after: int = 2,
        heartbeat_ttl_s: float = 3.0,
        on_engine_down: Callable[[str, str], object] | None = None,
    ) -> None:
        self.router = router
        self.http = http
        self.static = {s.id: s for s in static}
        self.registry = None if redis is None else _registry(redis)
        self.discover = discover and redis is not None
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.on_engine_down = on_engine_down
        self.probes = {eid: ProbeState(fail_after) for eid in self.static}
        self._announced: dict[str, EngineSpec] = {}
        self._supervisor: Supervisor | None = None
        self._own_supervisor = False
        self.ticks = 0

    def alive(self) -> list[EngineSpec]:
        specs = {eid: s for eid, s in self.static.items() if self.probes[eid].alive}
        for eid, s in self._announced.items():
            specs.setdefault(eid, s)
        return list(specs.values())

    async def probe_step(self) -> None:
        """Probe the static engines once and reconcile the router."""
        results = await asyncio.gather(
            *(probe(self.http, s.url, self.probe_timeout_s) for s in self.static.values())
        )
        for eid, ok in zip(self.static, results, strict=True):
            if self.probes[eid].record(ok):
                log.warning("engine %s is %s", eid, "up" if ok else "down")
        self._reconcile()

    async def heartbeat_step(self) -> None:
        """Read the announced engines once and reconcile the router. Raises what Redis
        raised (mapped); the last view stays meanwhile."""
        if not self.discover or self.registry is None:
            return
        fresh = await read_announced(self.registry, self.heartbeat_ttl_s)
        self._announced = {s.id: s for s in fresh}
        self._reconcile()

    def _reconcile(self) -> list[EngineSpec]:
        before = {s.id for s in self.router.engines()}
        alive = self.alive()
        self.router.set_engines(alive)
        self.ticks += 1
        gone = before - {s.id for s in alive}
        if self.on_engine_down is not None:
            for eid in sorted(gone):
                self.on_engine_down(eid, "engine down")
        return alive

    async def tick(self) -> list[EngineSpec]:
        """Probe, read heartbeats (a Redis failure keeps the last view), reconcile the
        router; return the live engines."""
        await self.probe_step()
        try:
            await self.heartbeat_step()
        except RelayError as exc:
            log.warning("reading engine heartbeats failed: %s", exc)
        return self.alive()

    async def start(self, supervisor: Supervisor | None = None, *, discovery: bool = True) -> None:
        """Run the probes (and, with ``discovery``, the heartbeat reads: see
        :meth:`start_discovery`) every ``interval_s`` on ``supervisor`` (or one of its own)."""
        if self._supervisor is not None:
            return
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        if self.static:
            # critical: without probes the ring keeps a dead engine (turns fail on it) or
            # never takes a recovered one back
            self._supervisor.every("engine_probes", self.interval_s, self.probe_step, critical=True)
        if discovery:
            self.start_discovery()

    def start_discovery(self) -> None:
        """Start reading the announced engines (once Redis has been reached)."""
        sup = self._supervisor
        if sup is None or not self.discover or "engine_heartbeats" in sup.loops:
            return
        # critical: without heartbeat reads the announced engines freeze as last seen
        sup.every("engine_heartbeats", self.interval_s, self.heartbeat_step, critical=True)

    async def stop(self) -> None:
        """Stop the loops if the supervisor is this control plane's own. Never raises."""
        sup, self._supervisor = self._supervisor, None
        if sup is not None and self._own_supervisor:
            await sup.stop()
