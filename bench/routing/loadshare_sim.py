"""Load-sharing simulator: do several worker pods keep every engine within its cap?

This is the earlier routing simulator, kept for what it measures well: the multi-worker
load exchange (``worker/routing/loadshare.py``) driving the real Router, with engines reduced to
slots and an LRU prefix cache. Routing policies are compared in ``bench/routing/sim.py``,
on a real trace and an engine model with continuous batching; this one's policy tables are
not evidence for that choice (its engines make overload free).

What it is for: a deterministic discrete-event simulation of multi-turn chat traffic over a
fleet of E engines, driving the real ``worker.routing.router.Router`` (ring policies) and the real
``worker.routing.loadshare.compute_view`` rule with a simulated clock. It compares seven routing
policies (plus the clockwise-walk spill variant of the project default) at 50, 80, 95 and
110 % of the fleet's estimated capacity; then runs 4 worker pods against one fleet at 1.3 x
overload with the load-sharing design off and on, and 1, cap and 2 x cap worker pods at the
usual load (does every worker get its share of the caps?).

Engines: each runs at most ``cap`` requests at once and queues the rest FIFO. Its KV cache
is an LRU of 16-token prefix blocks, as in vLLM's automatic prefix caching (and
``devstack/mockengine/prefix_cache.py``):
a block is identified by its chain (system prompt k, block i)
while it lies inside system prompt k -- so sessions sharing a system prompt share those
blocks -- and by (session, block i) from the first block that holds conversation text. A
lookup walks the chain from block 0 to the first missing block. A request touches its
blocks tail first (the prefix stays most recently used) when its prefill starts, and again
with its reply when it finishes, so every chain's cached blocks are always a prefix of the
chain and the cache is kept per chain (count of leading blocks, LRU over chains), which is
exactly the block LRU at O(1) per lookup. Prefill time = uncached prompt tokens x
``prefill_s_per_token``; decode time = output tokens x ``decode_s_per_token``.

Workload: sessions arrive as a Poisson process; each picks one of a few system prompts
(300-2,500 tokens) from a Zipf distribution (the hottest is shared by about a quarter of
all sessions) and has a geometric number of turns separated by exponential think time; each
turn appends a user message and the previous reply to the history, so prompts grow. The
workload is drawn from per-session random streams: every policy sees the same sessions.

Policies (``POLICIES``): ``round_robin``; ``least_loaded`` (fewest in flight + queued,
keys ignored); ``sticky_session`` (pinned to the least-loaded engine at the first turn, no
cap); ``consistent_hash`` (the ring's preferred engine, no cap); ``bounded_load`` (the real
Router with the fixed cap only); ``bounded_load_eps`` (the real Router with the cap and
eps = 0.25, least-loaded spill: the project default); ``bounded_load_eps_walk`` (the same
with the clockwise walk); ``cost_aware`` (the engine with the least expected queue wait +
prefill time of the part of the prompt it does not hold; queues when over its cap). A turn
the Router refuses waits in its worker's queue (``route_wait``) and is *rejected* (a 429) if
not admitted within ``admission_wait_s`` (2 s) of its arrival; unbounded policies never
reject. ``router_cap`` gives the Router a cap above the engine's running limit (the engine
queues the excess FIFO), which ``run_all`` tries at 95 % load.

Metrics (over turns arriving after the warm-up): ``hit_rate`` = cached prompt tokens /
prompt tokens; ``ttft_p50_ms`` / ``ttft_p99_ms`` = arrival to first token = admission wait +
engine queue + prefill (turns still waiting at the end count with their wait so far);
``max_mean_load`` = the busiest engine's time-averaged in flight (running + queued) over the
fleet mean; ``available_tokens`` = prefix tokens the best engine held at the routing
decision, ``captured_tokens`` = those held by the chosen engine (``captured_over_available``
their ratio); ``rejected``; for the multi-worker runs, ``peak_global_over_cap``.

Call order: ``run(SimConfig(...)) -> dict`` per scenario, ``run_all(quick, seed)`` for all;
``main()`` is the CLI: ``python -m bench.routing.loadshare_sim [--quick] [--seed N] [--json PATH]
[--plot PATH]``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

from bench._util import percentile
from bench.harness import Bench, Common, Outcome, flag
from worker.routing.key import routing_key
from worker.routing.lease import EngineSpec, Lease
from worker.routing.loadshare import WorkerReport, compute_view
from worker.routing.router import Router

__all__ = [
    "LEVELS",
    "POLICIES",
    "SimConfig",
    "add_arguments",
    "main",
    "run",
    "run_all",
    "run_from_args",
]

POLICIES: Final = (
    "round_robin",
    "least_loaded",
    "sticky_session",
    "consistent_hash",
    "bounded_load",
    "bounded_load_eps",
    "bounded_load_eps_walk",
    "cost_aware",
)
# policy -> (spill rule, eps or None for SimConfig.eps) of the real Router
_ROUTER_POLICIES: Final[dict[str, tuple[str, float | None]]] = {
    "bounded_load": ("least_loaded", 1e9),  # the fixed cap only
    "bounded_load_eps": ("least_loaded", None),
    "bounded_load_eps_walk": ("walk", None),
}
_ALIASES: Final = {"sticky": "consistent_hash", "walk": "bounded_load_eps_walk"}  # old names
LEVELS: Final = (0.5, 0.8, 0.95, 1.10)
DEFAULT_POLICY: Final = "bounded_load_eps"
_SYS: Final = 0  # chain kinds in an engine's cache
_SES: Final = 1


@dataclass(frozen=True)
class SimConfig:
    policy: str = DEFAULT_POLICY
    engines: int = 8
    cap: int = 16  # requests running at once per engine (its KV budget)
    router_cap: int = 0  # EngineSpec.cap given to the Router (0: the engine's cap)
    workers: int = 1
    loadshare: bool = True  # multi-worker: exchange load reports (else every worker uses cap)
    exchange_s: float = 0.25
    rotate_s: float = 1.0  # LoadExchange.rotate_s: how long one order among equal workers lasts
    load: float = 0.85  # offered load / estimated fleet capacity
    duration_s: float = 600.0
    warmup_s: float = 60.0  # at most a quarter of the duration
    system_prompts: int = 40
    system_zipf: float = 1.2
    mean_turns: float = 5.0
    think_s: float = 8.0
    prefix_chars: int = 256
    cache_tokens: int = 400_000  # per engine
    block_tokens: int = 16
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.008
    eps: float = 0.25
    vnodes: int = 160
    admission_wait_s: float = 2.0  # route_wait deadline before a 429
    seed: int = 7


@dataclass
class _Session:
    sid: int
    system: int
    key: str
    turns_left: int
    rng: random.Random
    history: int = 0  # tokens of the conversation so far (without the system prompt)
    engine: int = -1  # sticky_session: the engine of its first turn


@dataclass
class _Req:
    session: _Session
    arrival: float
    prompt: int  # tokens, system included
    out: int
    worker: int
    measured: bool  # arrived after the warm-up
    lease: Lease | None = None
    engine: int = -1
    wanted: str = ""  # the engine it waits for (Router.add_waiter), while pending
    state: int = 0  # 0 new/pending, 1 admitted, 2 rejected
    cached: int = 0  # tokens found in the cache when its prefill started
    started: float = 0.0


@dataclass
class _Engine:
    cap: int
    limit: int  # cache capacity in blocks
    service_s: float  # EWMA of service time (cost_aware's queue-wait estimate)
    busy: int = 0
    queue: deque[_Req] = field(default_factory=deque)
    # chain -> number of its leading blocks cached, in LRU order (least recent first)
    chains: OrderedDict[tuple[int, int], int] = field(default_factory=OrderedDict)
    blocks: int = 0
    area: float = 0.0
    last: float = 0.0

    def load(self) -> int:
        return self.busy + len(self.queue)

    def account(self, now: float) -> None:
        self.area += self.load() * (now - self.last)
        self.last = now

    def cached_blocks(self, system: int, sys_blocks: int, sid: int, prompt_blocks: int) -> int:
        """Leading blocks of the prompt held here: the system chain, then the session's."""
        c = self.chains.get((_SYS, system), 0)
        if c < sys_blocks:
            return c
        return sys_blocks + min(self.chains.get((_SES, sid), 0), prompt_blocks - sys_blocks)

    def touch(self, system: int, sys_blocks: int, sid: int, blocks: int) -> None:
        """Insert/refresh the first ``blocks`` blocks of a prompt, tail first."""
        self._touch((_SES, sid), blocks - sys_blocks)
        self._touch((_SYS, system), min(sys_blocks, blocks))
        excess = self.blocks - self.limit
        while excess > 0 and self.chains:
            chain, n = self.chains.popitem(last=False)  # the least recently used chain
            if n > excess:  # drop its tail blocks only; it stays least recent
                self.chains[chain] = n - excess
                self.chains.move_to_end(chain, last=False)
                n = excess
            self.blocks -= n
            excess -= n

    def _touch(self, chain: tuple[int, int], n: int) -> None:
        if n <= 0:
            return
        cur = self.chains.pop(chain, 0)
        n = max(n, cur)
        self.chains[chain] = n
        self.blocks += n - cur


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def mean_service_estimate(cfg: SimConfig) -> float:
    """The capacity estimate's mean service time: 80 output tokens + 250 uncached tokens."""
    return 80 * cfg.decode_s_per_token + 250 * cfg.prefill_s_per_token


def run(cfg: SimConfig) -> dict[str, Any]:
    """One simulation; returns its metrics (see the module docstring). Deterministic."""
    policy = _ALIASES.get(cfg.policy, cfg.policy)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {cfg.policy!r}")
    now = 0.0

    def clock() -> float:
        return now

    bsz = cfg.block_tokens
    rcap = cfg.router_cap or cfg.cap
    specs = [EngineSpec(id=f"e{i}", url=f"sim://e{i}", cap=rcap) for i in range(cfg.engines)]
    index = {s.id: i for i, s in enumerate(specs)}
    est = mean_service_estimate(cfg)
    engines = [_Engine(cfg.cap, cfg.cache_tokens // bsz, est) for _ in specs]
    bounded = policy in _ROUTER_POLICIES
    spill, eps = _ROUTER_POLICIES.get(policy, ("least_loaded", None))
    routers = [
        Router(
            specs,
            vnodes=cfg.vnodes,
            eps=cfg.eps if eps is None else eps,
            spill=spill,
            clock=clock,
        )
        for _ in range(cfg.workers)
    ]
    wl = random.Random(f"{cfg.seed}:workload")
    arrivals = random.Random(f"{cfg.seed}:arrivals")
    sys_len = [wl.randint(300, 2500) for _ in range(cfg.system_prompts)]
    sys_blocks = [n // bsz for n in sys_len]
    sys_text = [f"system prompt {k}: " + "rules " * 40 for k in range(cfg.system_prompts)]
    sys_cum = _zipf_cum(cfg.system_prompts, cfg.system_zipf)
    # capacity estimate: cap slots per engine / mean service time
    req_rate = cfg.load * cfg.engines * cfg.cap / est
    session_rate = req_rate / cfg.mean_turns
    warmup = min(cfg.warmup_s, 0.25 * cfg.duration_s)  # sessions ramp up, caches fill
    events: list[tuple[float, int, int, Any]] = []
    seq = itertools.count()
    SESSION, TURN, FINISH, EXCHANGE, TIMEOUT, WARM = range(6)

    def push(t: float, kind: int, data: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, data))

    pending: list[deque[_Req]] = [deque() for _ in routers]
    reports: dict[int, WorkerReport] = {}
    ttft: list[float] = []
    queue_waits: list[float] = []
    prompt_tokens = cached_tokens = captured = available = 0
    spills = rr = sid_counter = rejected = routed = 0
    peak_global = 0
    next_worker = 0

    def start(e: _Engine, r: _Req) -> None:
        nonlocal prompt_tokens, cached_tokens
        s = r.session
        sb = sys_blocks[s.system]
        pb = r.prompt // bsz
        r.cached = e.cached_blocks(s.system, sb, s.sid, pb) * bsz
        prefill = (r.prompt - r.cached) * cfg.prefill_s_per_token
        if r.measured:
            prompt_tokens += r.prompt
            cached_tokens += r.cached
            queue_waits.append(now - r.arrival)
            ttft.append(now - r.arrival + prefill)
        r.started = now
        e.busy += 1
        e.touch(s.system, sb, s.sid, pb)
        push(now + prefill + r.out * cfg.decode_s_per_token, FINISH, r)

    def holds(r: _Req) -> list[int]:
        s = r.session
        sb, pb = sys_blocks[s.system], r.prompt // bsz
        return [e.cached_blocks(s.system, sb, s.sid, pb) * bsz for e in engines]

    def assign(r: _Req, ei: int, held: list[int] | None = None) -> None:
        nonlocal peak_global, captured, available, routed
        r.state = 1
        if r.measured:
            held = held if held is not None else holds(r)
            captured += held[ei]
            available += max(held)
            routed += 1
        e = engines[ei]
        e.account(now)
        r.engine = ei
        if e.busy < e.cap:
            start(e, r)
        else:
            e.queue.append(r)
        if now >= warmup:
            peak_global = max(peak_global, e.load())

    def least_loaded() -> int:
        nonlocal rr
        n = cfg.engines
        best = min(range(n), key=lambda j: (engines[(rr + j) % n].load(), j))
        rr += 1  # rotate the tie-break so equal engines share the work
        return (rr - 1 + best) % n

    def cost_aware(r: _Req) -> tuple[int, list[int]]:
        held = holds(r)
        best, choice = (math.inf, 0), 0
        for i, e in enumerate(engines):
            wait = max(0, e.load() - e.cap + 1) * e.service_s / e.cap
            cost = (wait + (r.prompt - held[i]) * cfg.prefill_s_per_token, e.load())
            if cost < best:
                best, choice = cost, i
        return choice, held

    def try_route(r: _Req) -> bool:
        nonlocal spills, rr
        router = routers[r.worker]
        if policy == "round_robin":
            assign(r, rr % cfg.engines)
            rr += 1
        elif policy == "least_loaded":
            assign(r, least_loaded())
        elif policy == "sticky_session":
            if r.session.engine < 0:
                r.session.engine = least_loaded()
            assign(r, r.session.engine)
        elif policy == "consistent_hash":
            assign(r, index[router.preferred(r.session.key)])
        elif policy == "cost_aware":
            ei, held = cost_aware(r)
            assign(r, ei, held)
        else:
            lease = router.try_route(r.session.key)
            if lease is None:
                return False
            if r.measured:
                spills += lease.spilled
            r.lease = lease
            assign(r, index[lease.engine.id])
        return True

    def drain_pending(w: int) -> None:
        q = pending[w]
        while q:
            if q[0].state == 2:  # rejected at its deadline
                q.popleft()
            elif try_route(q[0]):
                routers[w].remove_waiter(q.popleft().wanted)
            else:
                break

    def exchange(w: int) -> None:
        router = routers[w]
        mine = router.in_flight()
        unmet = router.take_unmet()
        others = [rep for ow, rep in reports.items() if ow != w]
        caps = {s.id: s.cap for s in specs}
        view = compute_view(caps, mine, unmet, others, f"w{w}", int(now // cfg.rotate_s))
        router.apply_load_view(view)
        demand = {k: mine[k] + unmet.get(k, 0) for k in mine}
        reports[w] = WorkerReport(f"w{w}", mine, demand, view.allowance)
        drain_pending(w)

    push(arrivals.expovariate(session_rate), SESSION, None)
    if bounded and cfg.workers > 1 and cfg.loadshare:
        for w in range(cfg.workers):
            push(arrivals.uniform(0, cfg.exchange_s), EXCHANGE, w)
    push(warmup, WARM, None)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > cfg.duration_s:
            now = cfg.duration_s
            break
        if kind == TURN:
            s: _Session = data
            s.history += s.rng.randint(20, 200)  # the new user message
            s.turns_left -= 1
            r = _Req(
                s,
                now,
                sys_len[s.system] + s.history,
                s.rng.randint(20, 140),
                next_worker,
                now >= warmup,
            )
            next_worker = (next_worker + 1) % cfg.workers
            q = pending[r.worker]
            while q and q[0].state == 2:
                q.popleft()
            if q or not try_route(r):
                # a turn waiting for a slot is this worker's unmet demand (route_wait)
                r.wanted = routers[r.worker].add_waiter(s.key)
                q.append(r)
                push(now + cfg.admission_wait_s, TIMEOUT, r)
        elif kind == FINISH:
            r = data
            e = engines[r.engine]
            e.account(now)
            e.busy -= 1
            s = r.session
            e.service_s += 0.05 * ((now - r.started) - e.service_s)
            e.touch(s.system, sys_blocks[s.system], s.sid, (r.prompt + r.out) // bsz)
            if e.queue:
                start(e, e.queue.popleft())
            s.history += r.out
            if r.lease is not None:
                r.lease.release()
                drain_pending(r.worker)
            if s.turns_left > 0:
                push(now + s.rng.expovariate(1.0 / cfg.think_s), TURN, s)
        elif kind == SESSION:
            push(now + arrivals.expovariate(session_rate), SESSION, None)
            sid_counter += 1
            srng = random.Random(f"{cfg.seed}:session:{sid_counter}")
            system = bisect_right(sys_cum, srng.random() * sys_cum[-1])
            first = f"session {sid_counter} asks: " + "".join(
                srng.choices("abcdefghij klmnop", k=srng.randint(20, 300))
            )
            key = routing_key(sys_text[system], [first], prefix_chars=cfg.prefix_chars)
            # geometric on 1, 2, ... with mean mean_turns
            turns = 1 + int(math.log(1.0 - srng.random()) / math.log(1.0 - 1.0 / cfg.mean_turns))
            push(now, TURN, _Session(sid_counter, system, key, turns, srng))
        elif kind == EXCHANGE:
            exchange(data)
            push(now + cfg.exchange_s, EXCHANGE, data)
        elif kind == TIMEOUT:
            r = data
            if r.state == 0:  # still waiting: the worker answers 429
                r.state = 2
                routers[r.worker].remove_waiter(r.wanted)
                rejected += r.measured
        elif kind == WARM:
            for e in engines:
                e.account(now)
                e.area = 0.0
    # turns still waiting at the end count with the wait they have had (a lower bound)
    unstarted = 0
    for r in itertools.chain(*(e.queue for e in engines), *pending):
        if r.measured and r.state != 2:
            unstarted += 1
            ttft.append(now - r.arrival)
            queue_waits.append(now - r.arrival)
    for e in engines:
        e.account(now)
    means = [e.area / (now - warmup) for e in engines]
    mean = sum(means) / len(means)
    ttft.sort()
    queue_waits.sort()
    served = len(ttft) - unstarted
    return {
        "requests": served,
        "rejected": rejected,
        "unstarted": unstarted,
        "hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 0.5, 0.0) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99, 0.0) * 1000, 1),
        "queue_p50_ms": round(percentile(queue_waits, 0.5, 0.0) * 1000, 1),
        "queue_p99_ms": round(percentile(queue_waits, 0.99, 0.0) * 1000, 1),
        "max_mean_load": round(max(means) / mean, 3) if mean else 0.0,
        "utilization": round(mean / cfg.cap, 3),
        "available_tokens": available,
        "captured_tokens": captured,
        "captured_over_available": round(captured / available, 4) if available else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "spill_rate": round(spills / routed, 4) if routed else 0.0,
        "peak_global_over_cap": round(peak_global / cfg.cap, 3),
    }


def run_all(
    quick: bool = False, seed: int | None = None, base: SimConfig | None = None
) -> dict[str, Any]:
    """Every policy at every load level, the key and eps variants of the default at 95 %,
    and the multi-worker scenarios. ``base``: the fleet and workload (default: 8 engines,
    600 simulated seconds, or 150 with ``quick``); ``seed`` overrides its seed."""
    if base is None:
        base = SimConfig(duration_s=150.0, warmup_s=30.0) if quick else SimConfig()
    if seed is not None:
        base = replace(base, seed=seed)
    seed = base.seed
    out: dict[str, Any] = {"config": asdict(base), "seed": seed, "levels": {}}
    for load in LEVELS:
        out["levels"][f"{load:g}"] = {p: run(replace(base, policy=p, load=load)) for p in POLICIES}
    at95 = replace(base, load=0.95)
    out["shared_prompt"] = {
        f"prefix_chars={c}": run(replace(at95, prefix_chars=c)) for c in (0, base.prefix_chars)
    }
    out["eps"] = {f"eps={e}": run(replace(at95, eps=e)) for e in (0.1, 0.25, 0.5, 1.0)}
    # the Router admitting 1.5 x the engine's running limit: a short queue at the preferred
    # engine instead of a spill (the engine queues FIFO beyond its cap)
    rcap = base.cap * 3 // 2
    out["router_cap"] = {f"router_cap={rcap}": run(replace(at95, router_cap=rcap))}
    over = replace(base, workers=4, load=1.3)
    out["multi_worker"] = {
        "cap_x_1.1": 1.1,
        "off": run(replace(over, loadshare=False)),
        "on": run(over),
        "on_walk": run(replace(over, policy="bounded_load_eps_walk")),
    }
    # As many or more worker pods than an engine has slots, at the usual load: each
    # worker's share of an engine is a slot or none, and shares must follow demand.
    out["many_workers"] = {
        str(n): run(replace(base, workers=n)) for n in (1, base.cap, 2 * base.cap)
    }
    return out


_COLS: Final = (
    ("hit_rate", "hit_rate"),
    ("ttft_p50_ms", "ttft_p50_ms"),
    ("ttft_p99_ms", "ttft_p99_ms"),
    ("max_mean_load", "max_mean_load"),
    ("rejected", "rejected"),
    ("available_tokens", "available"),
    ("captured_tokens", "captured"),
    ("captured_over_available", "capt/avail"),
    ("spill_rate", "spill"),
)


def level_table(rows: dict[str, dict[str, Any]]) -> str:
    """One load level: a row per policy."""
    lines = [f"{'policy':<24}" + "".join(f"{h:>14}" for _, h in _COLS)]
    for name, r in rows.items():
        lines.append(f"{name:<24}" + "".join(f"{r[c]:>14}" for c, _ in _COLS))
    return "\n".join(lines)


def _table(res: dict[str, Any]) -> str:
    lines: list[str] = []
    for level, rows in res["levels"].items():
        lines.append(f"load {level} of estimated capacity")
        lines.append(level_table(rows))
        lines.append("")
    lines.append(f"{DEFAULT_POLICY} at load 0.95: routing key, eps, router cap")
    lines.append(level_table({**res["shared_prompt"], **res["eps"], **res["router_cap"]}))
    lines.append("")
    lines.append("4 workers, offered load 1.3x: peak global in-flight per engine / cap (<= 1.1?)")
    for name in ("off", "on", "on_walk"):
        r = res["multi_worker"][name]
        lines.append(
            f"  loadshare {name:<8} peak/cap {r['peak_global_over_cap']:>6}  "
            f"served {r['requests']}  rejected {r['rejected']}  "
            f"utilization {r['utilization']}  hit rate {r['hit_rate']}"
        )
    lines.append("")
    lines.append("N workers, load sharing on, load 0.85: does every worker get its share?")
    for n, r in res["many_workers"].items():
        lines.append(
            f"  {n:>3} workers  served {r['requests']}  rejected {r['rejected']}  "
            f"queue p99 {r['queue_p99_ms']} ms  ttft p99 {r['ttft_p99_ms']} ms  "
            f"peak/cap {r['peak_global_over_cap']}  hit rate {r['hit_rate']}"
        )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    """PNG: hit rate and TTFT p99 against offered load, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(res["levels"])
    loads = [float(x) for x in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in POLICIES:
        rows = [res["levels"][lv][p] for lv in levels]
        ax1.plot(loads, [r["hit_rate"] for r in rows], marker="o", label=p)
        ax2.plot(loads, [max(r["ttft_p99_ms"], 1.0) for r in rows], marker="o", label=p)
    ax1.set_xlabel("offered load / estimated capacity")
    ax1.set_ylabel("prefix-cache hit rate (cached / prompt tokens)")
    ax2.set_xlabel("offered load / estimated capacity")
    ax2.set_ylabel("TTFT p99 (ms, log)")
    ax2.set_yscale("log")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(f"routing_sim, seed {res['seed']}, {res['config']['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Flags(Common):
    seed: int = flag(7, "random seed")
    plot: str | None = flag(None, "PNG of hit rate and TTFT p99 against load", metavar="PATH")


def _run(f: Flags) -> Outcome:
    t0 = time.perf_counter()
    res = run_all(quick=f.quick, seed=f.seed)
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    print(f"{_table(res)}\n\n(wall {res['wall_s']} s)")
    if f.plot:
        plot(res, f.plot)
    return Outcome(res)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.loadshare_sim", description=__doc__,
              quick_help="150 simulated seconds instead of 600", raw_description=True,
              sigterm=False)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
