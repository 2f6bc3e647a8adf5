"""The routing policies the simulator compares, each as one worker's decision rule.

Every policy sees only what a worker can know without I/O on the hot path: its own leases,
the other workers' in-flight counts as of their last delayed report (``view``), the
session meta (the previous turn's engine and length) and its own past
decisions. None reads an engine's cache but ``precise``, which follows what the engines
report of it (their KV events).

- ``round_robin``: the next engine in turn.
- ``least_loaded``: fewest in flight (own + reported), ties rotated.
- ``sticky_session``: the first turn goes to the least loaded engine, every later turn of
  the session to the same engine (no cap).
- ``consistent_hash``: the ring's preferred engine for the routing key (no cap).
- ``article_fixed_cap``: the article's algorithm: the ring, at most 4 in flight per engine,
  clockwise walk to the next engine under the cap (the real ``worker.routing.router.Router``).
- ``bounded_load_eps``: the project's ring with Mirrokni et al.'s bound
  ``ceil((1 + eps) * (total + 1) / n)`` (eps 0.25), the KV-derived cap and least-loaded
  spill (the real ``Router`` as the worker configures it).
- ``sglang_cache_aware``: our re-implementation of SGLang's router cache-aware policy: an
  approximate prefix tree per engine built from the router's own decisions; when the load
  is imbalanced (max - min > 64 and max > 1.5 x min) the least loaded engine, otherwise the
  engine with the longest prefix match if it covers > 30 % of the prompt, else the engine
  whose tree is smallest. The tree is not evicted (SGLang's default cap is far above these
  runs' sizes).
- ``cost_aware``: the real ``Router(policy="cost_aware")`` (``worker.routing.cost``: least
  expected queue wait + prefill of what the engine probably does not hold), under the same
  KV-derived cap and allowance as ``bounded_load_eps``, with the worker's queue past the cap
  (``worker.routing.policy.DEFAULT_QUEUE``).
- ``precise``: the same router with ``policy="precise"``: what each engine holds is read
  from a ``worker.routing.blockindex.BlockIndex`` fed by the engines' own KV events
  (``bench/routing/core.py`` delivers them, possibly late or lossy); the one policy here
  that reads the engines' caches, as the engines themselves report them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from bench.routing.workloads import Request
from worker.routing.blockindex import BlockIndex
from worker.routing.cost import CostProfile, TurnInfo
from worker.routing.lease import EngineSpec, Lease, LoadView
from worker.routing.policy import DEFAULT_QUEUE
from worker.routing.router import Router
from worker.routing.tokens import block_keys

__all__ = ["POLICIES", "Decision", "Policy", "Session", "make_policy"]

POLICIES: Final = (
    "round_robin",
    "least_loaded",
    "sticky_session",
    "consistent_hash",
    "article_fixed_cap",
    "bounded_load_eps",
    "sglang_cache_aware",
    "cost_aware",
    "precise",
)
ARTICLE_CAP: Final = 4


@dataclass(slots=True)
class Session:
    """The session meta the worker reads anyway (shared by all workers)."""

    engine: int = -1
    tokens: int = 0  # previous turn's prompt + reply


@dataclass(slots=True)
class Decision:
    engine: int
    reason: str
    lease: Lease | None = None


class Policy:
    """Base: one worker's policy over ``n`` engines. ``choose`` returns None to refuse."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.own = [0] * n  # this worker's in flight per engine
        self.rr = 0

    def load(self, view: list[int]) -> list[int]:
        return [a + b for a, b in zip(self.own, view, strict=True)]

    def least(self, view: list[int]) -> int:
        loads = self.load(view)
        n = self.n
        best = min(range(n), key=lambda j: (loads[(self.rr + j) % n], j))
        i = (self.rr + best) % n
        self.rr += 1
        return i

    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        raise NotImplementedError

    def admitted(self, rid: int, d: Decision, r: Request, s: Session) -> None:
        self.own[d.engine] += 1

    def first_token(self, rid: int) -> None:
        return None

    def finished(self, rid: int, d: Decision) -> None:
        self.own[d.engine] -= 1
        if d.lease is not None:
            d.lease.release()

    def apply_view(self, view: list[int], reports: Mapping[str, object]) -> None:
        return None

    def wait(self, r: Request, s: Session) -> str:
        """A refused turn starts waiting for a slot (``route_wait``): count it as unmet
        demand where the router says it wants to go; returns what :meth:`unwait` takes."""
        return ""

    def unwait(self, wanted: str) -> None:
        return None


class RoundRobin(Policy):
    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        i = self.rr % self.n
        self.rr += 1
        return Decision(i, "round_robin")


class LeastLoaded(Policy):
    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        return Decision(self.least(view), "least_loaded")


class Sticky(Policy):
    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        if s.engine >= 0:
            return Decision(s.engine, "preferred")
        return Decision(self.least(view), "new_least_loaded")


class RingPolicy(Policy):
    """The real Router: ``capped`` False uses only its preferred engine (plain hashing)."""

    def __init__(
        self,
        n: int,
        cap: int,
        eps: float,
        spill: str,
        capped: bool,
        seed: int,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(n)
        self.capped = capped
        specs = [EngineSpec(id=f"s{seed}e{i}", url=f"sim://{i}", cap=cap) for i in range(n)]
        self.index = {sp.id: i for i, sp in enumerate(specs)}
        self.router = Router(specs, eps=eps, spill=spill, clock=clock)

    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        if not self.capped:
            return Decision(self.index[self.router.preferred(r.key)], "preferred")
        lease = self.router.try_route(r.key)
        if lease is None:
            return None
        return Decision(
            self.index[lease.engine.id], "spilled" if lease.spilled else "preferred", lease
        )

    def apply_view(self, view: list[int], reports: Mapping[str, object]) -> None:
        if self.capped:
            others = {eid: view[i] for eid, i in self.index.items()}
            self.router.apply_load_view(LoadView(others=others, allowance={}))

    def retry_after(self) -> float:
        return self.router.retry_after()

    def wait(self, r: Request, s: Session) -> str:
        return self.router.add_waiter(r.key) if self.capped else ""

    def unwait(self, wanted: str) -> None:
        self.router.remove_waiter(wanted)


class _Node:
    __slots__ = ("children", "engines")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.engines: set[int] = set()


class SglangCacheAware(Policy):
    def __init__(
        self,
        n: int,
        cache_threshold: float = 0.3,
        abs_threshold: int = 64,
        rel_threshold: float = 1.5,
    ) -> None:
        super().__init__(n)
        self.root = _Node()
        self.size = [0] * n  # tree nodes (blocks) per engine
        self.cache_threshold = cache_threshold
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        loads = self.load(view)
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            i, reason = self.least(view), "imbalanced"
        else:
            node, depth, match = self.root, 0, (0, -1)
            for b in r.ids:
                child = node.children.get(b)
                if child is None or not child.engines:
                    break
                node, depth = child, depth + 1
                match = (depth, min(child.engines, key=lambda e: (loads[e], e)))
            if match[1] >= 0 and match[0] / len(r.ids) > self.cache_threshold:
                i, reason = match[1], "cache_match"
            else:
                i = min(range(self.n), key=lambda e: (self.size[e], loads[e], e))
                reason = "smallest_tree"
        node = self.root
        for b in r.ids:  # the router's own record: this engine now holds this prefix
            child = node.children.get(b)
            if child is None:
                child = node.children[b] = _Node()
            if i not in child.engines:
                child.engines.add(i)
                self.size[i] += 1
            node = child
        return Decision(i, reason)


class CostAware(RingPolicy):
    """The real Router with ``policy="cost_aware"`` (``worker.routing.cost``), the
    KV-derived cap and this worker's allowance, fed what the worker knows of the turn."""

    def __init__(
        self,
        n: int,
        cap: int,
        profile: CostProfile,
        seed: int,
        clock: Callable[[], float],
        queue: float = DEFAULT_QUEUE,
        blocks: BlockIndex | None = None,
    ) -> None:
        Policy.__init__(self, n)
        self.capped = True
        specs = [EngineSpec(id=f"s{seed}e{i}", url=f"sim://{i}", cap=cap) for i in range(n)]
        self.index = {sp.id: i for i, sp in enumerate(specs)}
        self.names = [sp.id for sp in specs]
        policy = "cost_aware" if blocks is None else "precise"
        self.router = Router(
            specs, policy=policy, clock=clock, cost_profile=profile, queue=queue, index=blocks
        )
        self.leases: dict[int, Lease] = {}
        self.blocks = blocks

    def _turn(self, r: Request, s: Session) -> TurnInfo:
        return TurnInfo(
            prompt_tokens=r.prompt,
            key=r.key,
            prev_engine=self.names[s.engine] if s.engine >= 0 else "",
            prev_tokens=s.tokens,
            shared_key=f"p{r.ids[0]}",
            shared_tokens=r.shared,
            # precise: the prompt's blocks keyed as the index keys the engines' events
            # (one id a block: block_keys over the ids, block size 1)
            blocks=tuple(block_keys(r.ids, 1)) if self.blocks is not None else (),
        )

    def wait(self, r: Request, s: Session) -> str:
        return self.router.add_waiter(r.key, self._turn(r, s))

    def choose(self, r: Request, s: Session, view: list[int]) -> Decision | None:
        lease = self.router.try_route(r.key, turn=self._turn(r, s))
        if lease is None:
            return None
        self.leases[r.rid] = lease
        return Decision(self.index[lease.engine.id], lease.reason, lease)

    def first_token(self, rid: int) -> None:
        lease = self.leases.get(rid)
        if lease is not None:
            lease.first_token()

    def finished(self, rid: int, d: Decision) -> None:
        self.leases.pop(rid, None)
        super().finished(rid, d)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    engines: int
    cap: int  # KV-derived in-flight cap per engine (bounded_load_eps)
    eps: float = 0.25
    workers: int = 1
    seed: int = 0
    profile: CostProfile = field(default_factory=CostProfile)
    queue: float = DEFAULT_QUEUE  # cost_aware's queue past the cap (x the cap)
    blocks: BlockIndex | None = None  # precise: the index the engines' events feed


def make_policy(name: str, cfg: PolicyConfig, clock: Callable[[], float]) -> Policy:
    n = cfg.engines
    if name == "round_robin":
        return RoundRobin(n)
    if name == "least_loaded":
        return LeastLoaded(n)
    if name == "sticky_session":
        return Sticky(n)
    if name == "consistent_hash":
        return RingPolicy(n, cfg.cap, cfg.eps, "walk", False, cfg.seed, clock)
    if name == "article_fixed_cap":
        return RingPolicy(n, ARTICLE_CAP, 1e9, "walk", True, cfg.seed, clock)
    if name == "bounded_load_eps":
        return RingPolicy(n, cfg.cap, cfg.eps, "least_loaded", True, cfg.seed, clock)
    if name == "sglang_cache_aware":
        return SglangCacheAware(n)
    if name == "cost_aware":
        return CostAware(n, cfg.cap, cfg.profile, cfg.seed, clock, cfg.queue)
    if name == "precise":
        if cfg.blocks is None:
            raise ValueError("precise needs the block index (PolicyConfig.blocks)")
        return CostAware(n, cfg.cap, cfg.profile, cfg.seed, clock, cfg.queue, cfg.blocks)
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
