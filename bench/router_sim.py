"""Routing simulator: which routing policy keeps KV caches warm without drowning a GPU.

What it is for: a deterministic discrete-event simulation of multi-turn chat traffic over a
fleet of engines, driving the real ``worker.router.Router`` and ``worker.loadshare`` rule with
a simulated clock. It compares round-robin, sticky hash (ring preference, no cap), bounded
loads with the clockwise walk, and bounded loads with least-loaded spill; then runs 4 worker
pods against one fleet with the load-sharing design off and on, and 1, cap and 2 x cap
worker pods at the usual load (does every worker get its share of the caps?).

Model: sessions arrive as a Poisson process; each picks a system prompt from a Zipf
distribution (a few prompts are shared by hundreds of sessions) and has a geometric number of
turns separated by think time. A turn's prompt is system + history + the new message; an
engine holds ``cap`` requests at once (its KV budget) and queues the rest FIFO; its prefix
cache is an LRU over tokens holding conversation prefixes and system prompts. Service time =
uncached prefill tokens x prefill cost + output tokens x decode cost.

Metrics: *cache-hit rate* = prefix tokens reused on the chosen engine / prefix tokens the best
engine could have reused (captured vs available); *max/mean load* = the busiest engine's
time-averaged in-flight (running + queued) over the fleet mean; *p99 queueing* = wait from
the turn's arrival to the start of its service; for the multi-worker runs, the peak global
in-flight per engine over its cap.

Call order: ``run(SimConfig(...)) -> dict`` per scenario; ``main()`` is the CLI:
``python -m bench.router_sim [--json PATH] [--quick]``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from worker.loadshare import WorkerReport, compute_view
from worker.router import DEFAULT_SPILL, EngineSpec, Lease, Router
from worker.routing_key import routing_key

__all__ = ["POLICIES", "SimConfig", "main", "run", "run_all"]

POLICIES = ("round_robin", "sticky", "walk", "least_loaded")


@dataclass(frozen=True)
class SimConfig:
    policy: str = DEFAULT_SPILL
    engines: int = 8
    cap: int = 16  # in-flight requests per engine (KV budget)
    workers: int = 1
    loadshare: bool = True  # multi-worker: exchange load reports (else every worker uses cap)
    exchange_s: float = 0.25
    rotate_s: float = 1.0  # LoadExchange.rotate_s: how long one order among equal workers lasts
    load: float = 0.85  # offered load / estimated fleet capacity
    duration_s: float = 300.0
    system_prompts: int = 40
    system_zipf: float = 1.2
    mean_turns: float = 5.0
    think_s: float = 8.0
    prefix_chars: int = 256
    cache_tokens: int = 400_000  # per engine
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.008
    eps: float = 0.25
    vnodes: int = 160
    seed: int = 7


@dataclass
class _Session:
    sid: int
    system: int
    first: str
    turns_left: int
    history: int = 0  # tokens of the conversation so far (without the system prompt)


@dataclass
class _Req:
    session: _Session
    arrival: float
    key: str
    prompt: int  # tokens, system included
    out: int
    worker: int
    lease: Lease | None = None
    engine: int = -1
    wanted: str = ""  # the engine it waits for (Router.add_waiter), while pending


class _Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cap = cfg.cap
        self.busy = 0
        self.queue: deque[_Req] = deque()
        self.cache: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.cached = 0
        self.limit = cfg.cache_tokens
        self.area = 0.0
        self.last = 0.0
        self.peak = 0

    def load(self) -> int:
        return self.busy + len(self.queue)

    def account(self, now: float) -> None:
        self.area += self.load() * (now - self.last)
        self.last = now

    def reusable(self, r: _Req, sys_len: int) -> int:
        hist = self.cache.get(("s", r.session.sid), 0)
        if hist and hist <= r.prompt:
            return hist
        return sys_len if ("p", r.session.system) in self.cache else 0

    def remember(self, item: tuple[str, int], tokens: int) -> None:
        self.cached += tokens - self.cache.pop(item, 0)
        self.cache[item] = tokens
        while self.cached > self.limit and self.cache:
            _, t = self.cache.popitem(last=False)
            self.cached -= t


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def run(cfg: SimConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    now = 0.0
    clock: Callable[[], float] = lambda: now  # noqa: E731
    specs = [EngineSpec(id=f"e{i}", url=f"sim://e{i}", cap=cfg.cap) for i in range(cfg.engines)]
    index = {s.id: i for i, s in enumerate(specs)}
    engines = [_Engine(cfg) for _ in specs]
    routers = [
        Router(specs, vnodes=cfg.vnodes, eps=cfg.eps, spill=cfg.policy, clock=clock)
        if cfg.policy in ("walk", "least_loaded")
        else Router(specs, vnodes=cfg.vnodes, clock=clock)
        for _ in range(cfg.workers)
    ]
    bounded = cfg.policy in ("walk", "least_loaded")
    sys_len = [rng.randint(300, 2500) for _ in range(cfg.system_prompts)]
    sys_text = [f"system prompt {k}: " + "rules " * 40 for k in range(cfg.system_prompts)]
    sys_cum = _zipf_cum(cfg.system_prompts, cfg.system_zipf)
    # capacity estimate: cap slots per engine / mean service time
    mean_service = 80 * cfg.decode_s_per_token + 250 * cfg.prefill_s_per_token
    req_rate = cfg.load * cfg.engines * cfg.cap / mean_service
    session_rate = req_rate / cfg.mean_turns
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()

    def push(t: float, kind: str, data: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, data))

    pending: list[deque[_Req]] = [deque() for _ in routers]
    reports: dict[int, WorkerReport] = {}
    waits: list[float] = []
    captured = available = 0
    spills = rr = sid_counter = 0
    peak_global = 0
    next_worker = 0

    warmup = min(60.0, 0.25 * cfg.duration_s)  # let sessions ramp up and caches fill

    def start(e: _Engine, r: _Req) -> None:
        nonlocal captured, available
        slen = sys_len[r.session.system]
        got = e.reusable(r, slen)
        if r.arrival >= warmup:
            captured += got
            available += max(x.reusable(r, slen) for x in engines)
            waits.append(now - r.arrival)
        e.busy += 1
        e.remember(("p", r.session.system), slen)
        e.remember(("s", r.session.sid), r.prompt + r.out)
        service = (r.prompt - got) * cfg.prefill_s_per_token + r.out * cfg.decode_s_per_token
        push(now + service, "finish", r)

    def assign(r: _Req, ei: int) -> None:
        nonlocal peak_global
        e = engines[ei]
        e.account(now)
        r.engine = ei
        if e.busy < e.cap:
            start(e, r)
        else:
            e.queue.append(r)
        e.peak = max(e.peak, e.load())
        if now >= warmup:
            peak_global = max(peak_global, e.load())

    def try_route(r: _Req) -> bool:
        nonlocal spills, rr
        router = routers[r.worker]
        if cfg.policy == "round_robin":
            assign(r, rr % cfg.engines)
            rr += 1
            return True
        if cfg.policy == "sticky":
            assign(r, index[router.preferred(r.key)])
            return True
        lease = router.try_route(r.key)
        if lease is None:
            return False
        spills += lease.spilled
        r.lease = lease
        assign(r, index[lease.engine.id])
        return True

    def drain_pending(w: int) -> None:
        q = pending[w]
        while q and try_route(q[0]):
            routers[w].remove_waiter(q.popleft().wanted)

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

    push(rng.expovariate(session_rate), "session", None)
    if bounded and cfg.workers > 1 and cfg.loadshare:
        for w in range(cfg.workers):
            push(rng.uniform(0, cfg.exchange_s), "exchange", w)
    push(warmup, "warm", None)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > cfg.duration_s:
            now = cfg.duration_s
            break
        if kind == "warm":
            for e in engines:
                e.account(now)
                e.area = 0.0
        elif kind == "session":
            push(now + rng.expovariate(session_rate), "session", None)
            sid_counter += 1
            system = bisect_right(sys_cum, rng.random() * sys_cum[-1])
            first = f"session {sid_counter} asks: " + "".join(
                rng.choice("abcdefghij klmnop") for _ in range(rng.randint(20, 300))
            )
            turns = 1 + int(rng.expovariate(1.0 / (cfg.mean_turns - 1)))
            push(now, "turn", _Session(sid_counter, system, first, turns))
        elif kind == "turn":
            s: _Session = data
            s.history += rng.randint(20, 200)
            s.turns_left -= 1
            key = routing_key(sys_text[s.system], [s.first], prefix_chars=cfg.prefix_chars)
            out = rng.randint(20, 140)
            r = _Req(s, now, key, sys_len[s.system] + s.history, out, next_worker)
            next_worker = (next_worker + 1) % cfg.workers
            if pending[r.worker] or not try_route(r):
                if bounded:  # a request waiting for a slot is this worker's unmet demand
                    r.wanted = routers[r.worker].add_waiter(r.key)
                pending[r.worker].append(r)
        elif kind == "finish":
            r = data
            e = engines[r.engine]
            e.account(now)
            e.busy -= 1
            if e.queue:
                start(e, e.queue.popleft())
            r.session.history += r.out
            if r.lease is not None:
                r.lease.release()
                drain_pending(r.worker)
            if r.session.turns_left > 0:
                push(now + rng.expovariate(1.0 / cfg.think_s), "turn", r.session)
        elif kind == "exchange":
            exchange(data)
            push(now + cfg.exchange_s, "exchange", data)
    for e in engines:
        e.account(now)
    means = [e.area / (now - warmup) for e in engines]
    mean = sum(means) / len(means)
    waits.sort()
    p99 = waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)] if waits else 0.0
    return {
        "requests": len(waits),
        "cache_hit_rate": round(captured / available, 4) if available else 0.0,
        "max_mean_load": round(max(means) / mean, 3) if mean else 0.0,
        "utilization": round(mean / cfg.cap, 3),
        "p50_queue_ms": round(waits[len(waits) // 2] * 1000, 1) if waits else 0.0,
        "p99_queue_ms": round(p99 * 1000, 1),
        "spill_rate": round(spills / len(waits), 4) if waits else 0.0,
        "peak_global_over_cap": round(peak_global / cfg.cap, 3),
    }


def run_all(quick: bool = False) -> dict[str, Any]:
    base = SimConfig(duration_s=90.0 if quick else 600.0)
    out: dict[str, Any] = {"config": asdict(base), "policies": {}, "shared_prompt": {}}
    for policy in POLICIES:
        out["policies"][policy] = run(replace(base, policy=policy))
    for chars in (0, base.prefix_chars):
        out["shared_prompt"][f"prefix_chars={chars}"] = run(replace(base, prefix_chars=chars))
    out["eps"] = {f"eps={eps}": run(replace(base, eps=eps)) for eps in (0.1, 0.25, 0.5, 1.0)}
    over = replace(base, workers=4, load=1.3)
    out["multi_worker"] = {
        "cap_x_1.1": 1.1,
        "off": run(replace(over, loadshare=False)),
        "on": run(over),
        "on_walk": run(replace(over, policy="walk")),
    }
    # As many or more worker pods than an engine has slots, at the usual load: each
    # worker's share of an engine is a slot or none, and shares must follow demand.
    out["many_workers"] = {
        str(n): run(replace(base, workers=n)) for n in (1, base.cap, 2 * base.cap)
    }
    return out


def _table(res: dict[str, Any]) -> str:
    cols = (
        "cache_hit_rate",
        "max_mean_load",
        "utilization",
        "p50_queue_ms",
        "p99_queue_ms",
        "spill_rate",
    )
    lines = [f"{'scenario':<28}" + "".join(f"{c:>16}" for c in cols)]
    rows = [
        *res["policies"].items(),
        *((f"{DEFAULT_SPILL} {k}", v) for k, v in res["shared_prompt"].items()),
        *((f"{DEFAULT_SPILL} {k}", v) for k, v in res["eps"].items()),
    ]
    for name, r in rows:
        lines.append(f"{name:<28}" + "".join(f"{r[c]:>16}" for c in cols))
    lines.append("")
    lines.append("4 workers, offered load 1.3x: peak global in-flight per engine / cap (<= 1.1?)")
    for name in ("off", "on", "on_walk"):
        r = res["multi_worker"][name]
        lines.append(
            f"  loadshare {name:<16} {r['peak_global_over_cap']:>6}  "
            f"utilization {r['utilization']}, cache hits {r['cache_hit_rate']}"
        )
    lines.append("")
    lines.append("N workers, load sharing on, usual load: does every worker get its share?")
    for n, r in res["many_workers"].items():
        lines.append(
            f"  {n:>3} workers  requests {r['requests']}  utilization {r['utilization']}  "
            f"p99 queueing {r['p99_queue_ms']} ms  peak/cap {r['peak_global_over_cap']}  "
            f"cache hits {r['cache_hit_rate']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.router_sim", description=__doc__)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="90 simulated seconds instead of 600")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run_all(quick=args.quick)
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    print(_table(res))
    print(f"\n(wall {res['wall_s']} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
