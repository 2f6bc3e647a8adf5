"""One routing simulation: a workload through W workers and E engines (pure, deterministic).

The engines are ``bench.routing.engine_model.Engine`` (continuous batching, chunked prefill, a
shared block KV cache with an LRU prefix cache, preemption with recompute). Requests reach
the workers round robin (the front door); each worker decides with its own policy state
(``bench.routing.policies``). Every ``exchange_s`` each worker publishes its in-flight
counts; the others receive them ``report_delay_s`` later (the load exchange), and the
capped ring policies install them with ``worker.routing.loadshare.compute_view`` as the worker does.
A turn a capped policy refuses waits in its worker for a slot (``route_wait``, counted as
unmet demand on the engine the router wants, as the worker reports it) up to
``admit_wait_s``; then it is rejected (a 429) and the client retries after the
Retry-After the router gives (whole seconds, at least 1): the session goes on.
``cost_aware`` runs the product router's queue past the cap (``Router(queue=...)``, the
worker's defaults), so it refuses only when that queue is full too or the turn would not
get its first token within the TTFT SLO.

Metrics (all requests of the workload): TTFT = first token - first arrival (retries
included); a request's ITL = its mean gap between tokens (vLLM's TPOT); ``itl_p99_ms``
over every token gap; goodput = requests meeting TTFT <= 2 s and ITL <= 100 ms, per
second of the workload's arrival span; ``hit_rate`` = prompt tokens found cached /
prompt tokens at first admission; ``max_mean_load`` = the busiest engine's mean requests
(running + waiting, sampled every second) over the fleet mean. Requests unfinished
``drain_s`` after the last arrival miss the SLO and count in TTFT with their wait so far.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from bench.routing.engine_model import H100_LLAMA8B, Engine, EngineParams, Seq
from bench.routing.policies import (
    POLICIES,
    Decision,
    PolicyConfig,
    RingPolicy,
    Session,
    make_policy,
)
from bench.routing.workloads import Request
from worker.routing.blockindex import BlockIndex
from worker.routing.cost import CostProfile
from worker.routing.kvwire import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from worker.routing.loadshare import WorkerReport, compute_view
from worker.routing.policy import DEFAULT_QUEUE, DEFAULT_ROUTING

__all__ = ["SimConfig", "derived_cap", "run"]

# the worker's default routing, by its name here
DEFAULT_POLICY: Final = {"ring": "bounded_load_eps"}.get(DEFAULT_ROUTING, DEFAULT_ROUTING)


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = DEFAULT_POLICY
    engines: int = 8
    workers: int = 2
    exchange_s: float = 0.25
    report_delay_s: float = 0.25
    admit_wait_s: float = 2.0
    engine: EngineParams = field(default_factory=lambda: H100_LLAMA8B)
    cap: int = 0  # in-flight cap per engine for bounded_load_eps; 0: KV tokens / mean context
    eps: float = 0.25
    seed: int = 7
    drain_s: float = 300.0
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    # cost_aware's product settings (the worker's defaults), for the measurements that
    # turn them off: its queue past the cap and its weight of recomputed history
    route_queue: float = DEFAULT_QUEUE
    recompute_weight: float = CostProfile().recompute_weight
    # precise: the engines' KV events reach the index this late, and this fraction of
    # batches never does: lost silently (the index does not know it is wrong) or, with
    # kv_drop_detected, as a gap no replay fills (the worker's rule: the engine's blocks
    # are dropped and it is estimated for kv_resync_s)
    kv_delay_s: float = 0.0
    kv_drop: float = 0.0
    kv_drop_detected: bool = False
    kv_resync_s: float = 10.0


def derived_cap(reqs: list[Request], params: EngineParams) -> int:
    """The in-flight cap the KV cache implies: capacity / mean (prompt + reply) tokens."""
    if not reqs:
        return 1
    mean = sum(r.prompt + r.out for r in reqs) / len(reqs)
    return max(1, int(params.kv_tokens // mean))


@dataclass(slots=True)
class _Rec:
    req: Request
    worker: int
    first_arrival: float
    seq: Seq | None = None
    decision: Decision | None = None
    rejected: int = 0
    state: int = 0  # 0 waiting for a route, 1 routed, 2 rejected (retry scheduled)
    wanted: str | None = None  # counted as unmet demand while it waits (Policy.wait)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _hist_pct(h: dict[float, int], q: float) -> float:
    total = sum(h.values())
    if not total:
        return 0.0
    need = math.ceil(q * total)
    acc = 0
    for k in sorted(h):
        acc += h[k]
        if acc >= need:
            return k
    return max(h)


def run(cfg: SimConfig, reqs: list[Request]) -> dict[str, Any]:
    """Simulate ``reqs`` under ``cfg``; returns the metrics (module docstring)."""
    if cfg.policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {cfg.policy!r}")
    now = 0.0

    def clock() -> float:
        return now

    p = cfg.engine
    engines = [Engine(p) for _ in range(cfg.engines)]
    cap = cfg.cap or derived_cap(reqs, p)
    profile = CostProfile(
        p.kv_tokens,
        p.chunk_tokens,
        p.step_base_s,
        p.per_token_s,
        p.per_kv_token_s,
        cfg.recompute_weight,
    )
    ids = [f"s{cfg.seed}e{i}" for i in range(cfg.engines)]
    blocks: BlockIndex | None = None
    if cfg.policy == "precise":
        # one index for every worker: each follows the same events, so they are equal
        blocks = BlockIndex(1, tokens_per_block=p.block_tokens, max_blocks=p.blocks + 1)
        for i, e in enumerate(engines):
            e.kv_events = []
            blocks.add_engine(ids[i])
            blocks.synced(ids[i], 0.0)  # an empty engine, known to be empty
    drop_rng = random.Random(f"{cfg.seed}:kv-drop")
    pcfg = PolicyConfig(
        cfg.engines, cap, cfg.eps, cfg.workers, cfg.seed, profile, cfg.route_queue, blocks
    )
    policies = [make_policy(cfg.policy, pcfg, clock) for _ in range(cfg.workers)]
    caps = dict.fromkeys(ids, cap)
    sessions: dict[int, Session] = {}
    recs: dict[int, _Rec] = {}
    pending: list[deque[_Rec]] = [deque() for _ in range(cfg.workers)]
    delivered: dict[int, list[int]] = {}  # worker -> in-flight per engine, as others see it
    reports: dict[int, WorkerReport] = {}
    events: list[tuple[float, int, int, Any]] = []
    order = itertools.count()
    ARRIVE, STEP, EXCH, DELIVER, DEADLINE, SAMPLE, KV = range(7)

    def push(t: float, kind: int, data: Any) -> None:
        heapq.heappush(events, (t, next(order), kind, data))

    def publish(i: int) -> None:
        """Engine ``i``'s KV events since the last call, as one batch to the index."""
        out = engines[i].kv_events
        if not out or blocks is None:
            return
        batch = KVEventBatch(
            now,
            [
                BlockStored(list[BlockHash](b), parent, b, 1, None, "GPU")
                if kind == "stored"
                else BlockRemoved(list[BlockHash](b), "GPU")
                for kind, b, parent in out
            ],
        )
        out.clear()
        if cfg.kv_drop and drop_rng.random() < cfg.kv_drop:
            if cfg.kv_drop_detected:
                blocks.unfilled(ids[i], now + cfg.kv_delay_s, cfg.kv_resync_s)
            return
        if cfg.kv_delay_s:
            push(now + cfg.kv_delay_s, KV, (i, batch))
        else:
            blocks.apply(ids[i], batch, now)

    for r in reqs:
        if not engines[0].fits(r.prompt, r.out, len(r.ids)):
            raise ValueError(f"request {r.rid} is larger than an engine's KV cache")
        push(r.t, ARRIVE, r)
    end_t = (reqs[-1].t if reqs else 0.0) + cfg.drain_s
    load_sum = [0.0] * cfg.engines
    peak = [0] * cfg.engines  # most requests on an engine at once
    samples = 0
    rejected = finished = 0
    reasons: dict[str, int] = {}

    def view_for(w: int) -> list[int]:
        v = [0] * cfg.engines
        for ow, counts in delivered.items():
            if ow != w:
                for i, c in enumerate(counts):
                    v[i] += c
        return v

    def try_route(rec: _Rec) -> bool:
        pol = policies[rec.worker]
        r = rec.req
        s = sessions.setdefault(r.conv, Session())
        d = pol.choose(r, s, view_for(rec.worker))
        if d is None:
            return False
        rec.decision, rec.state = d, 1
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        pol.admitted(r.rid, d, r, s)
        s.engine, s.tokens = d.engine, r.prompt + r.out
        seq = Seq(r.rid, r.ids, r.prompt, r.out, now)
        rec.seq = seq
        e = engines[d.engine]
        e.submit(seq)
        peak[d.engine] = max(peak[d.engine], e.load())
        t = e.start(now)
        publish(d.engine)
        if t is not None:
            push(t, STEP, d.engine)
        return True

    def unwait(rec: _Rec) -> None:
        if rec.wanted is not None:
            policies[rec.worker].unwait(rec.wanted)
            rec.wanted = None

    def drain(w: int) -> None:
        q = pending[w]
        while q:
            if q[0].state != 0 or try_route(q[0]):
                unwait(q.popleft())
            else:
                break

    for w in range(cfg.workers):
        push(cfg.exchange_s * (w + 1) / cfg.workers, EXCH, w)
    push(1.0, SAMPLE, None)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > end_t:
            now = end_t
            break
        if kind == STEP:
            e = engines[data]
            first, done = e.end(now)
            for s in first:
                policies[recs[s.rid].worker].first_token(s.rid)
            finished += len(done)
            for s in done:
                rec = recs[s.rid]
                assert rec.decision is not None
                policies[rec.worker].finished(s.rid, rec.decision)
                drain(rec.worker)
            t = e.start(now)
            publish(data)
            if t is not None:
                push(t, STEP, data)
        elif kind == KV:
            assert blocks is not None
            blocks.apply(ids[data[0]], data[1], now)
        elif kind == ARRIVE:
            r = data
            if r.rid not in recs:
                recs[r.rid] = _Rec(r, r.rid % cfg.workers, now)
            rec = recs[r.rid]
            rec.state = 0
            q = pending[rec.worker]
            if q or not try_route(rec):
                q.append(rec)
                s = sessions.setdefault(r.conv, Session())
                rec.wanted = policies[rec.worker].wait(r, s)
                push(now + cfg.admit_wait_s, DEADLINE, rec)
        elif kind == DEADLINE:
            rec = data
            if rec.state == 0:
                unwait(rec)
                rec.state, rec.rejected = 2, rec.rejected + 1
                rejected += 1
                pol = policies[rec.worker]
                hint = pol.retry_after() if isinstance(pol, RingPolicy) else 1.0
                push(now + max(1.0, math.ceil(hint)), ARRIVE, rec.req)
        elif kind == EXCH:
            w = data
            pol = policies[w]
            counts = list(pol.own)
            if isinstance(pol, RingPolicy) and pol.capped:
                router = pol.router
                mine, unmet = router.in_flight(), router.take_unmet()
                view = compute_view(
                    caps,
                    mine,
                    unmet,
                    [rep for ow, rep in reports.items() if ow != w],
                    f"w{w}",
                    int(now),
                    router.allowances(),
                    router.queue if router.policy in ("cost_aware", "precise") else 0.0,
                )
                router.apply_load_view(view)
                demand = {k: mine[k] + unmet.get(k, 0) for k in mine}
                push(
                    now + cfg.report_delay_s,
                    DELIVER,
                    (w, counts, WorkerReport(f"w{w}", mine, demand, view.allowance)),
                )
            else:
                push(now + cfg.report_delay_s, DELIVER, (w, counts, None))
            drain(w)
            push(now + cfg.exchange_s, EXCH, w)
        elif kind == DELIVER:
            w, counts, rep = data
            delivered[w] = counts
            if rep is not None:
                reports[w] = rep
        elif kind == SAMPLE:
            samples += 1
            for i, e in enumerate(engines):
                load_sum[i] += e.load()
            push(now + 1.0, SAMPLE, None)
        if finished == len(reqs):
            break
    res = _metrics(cfg, reqs, recs, engines, load_sum, samples, rejected, reasons, now, cap)
    res["peak_load"] = max(peak)
    return res


def _metrics(
    cfg: SimConfig,
    reqs: list[Request],
    recs: dict[int, _Rec],
    engines: list[Engine],
    load_sum: list[float],
    samples: int,
    rejected: int,
    reasons: dict[str, int],
    now: float,
    cap: int,
) -> dict[str, Any]:
    ttft: list[float] = []
    good = unfinished = 0
    for r in reqs:
        rec = recs.get(r.rid)
        s = rec.seq if rec is not None else None
        if rec is None or s is None or s.first_token < 0:
            unfinished += 1
            ttft.append(now - (rec.first_arrival if rec else r.t))
            continue
        t = s.first_token - rec.first_arrival
        ttft.append(t)
        if s.done < 0:
            unfinished += 1
            continue
        itl = (s.done - s.first_token) / (s.out - 1) if s.out > 1 else 0.0
        if t <= cfg.ttft_slo_s and itl <= cfg.itl_slo_s:
            good += 1
    ttft.sort()
    gaps: dict[float, int] = {}
    for e in engines:
        for k, v in e.gaps.items():
            gaps[k] = gaps.get(k, 0) + v
    span = max(1e-9, reqs[-1].t - reqs[0].t) if reqs else 1.0
    prompt = sum(e.prompt_tokens for e in engines)
    hit = sum(e.hit_tokens for e in engines)
    means = [x / max(1, samples) for x in load_sum]
    mean = sum(means) / len(means)
    return {
        "requests": len(reqs),
        "goodput_rps": round(good / span, 4),
        "slo_met": good,
        "ttft_p50_ms": round(_pct(ttft, 0.5) * 1000, 1),
        "ttft_p99_ms": round(_pct(ttft, 0.99) * 1000, 1),
        "itl_p99_ms": round(_hist_pct(gaps, 0.99), 1),
        "hit_rate": round(hit / prompt, 4) if prompt else 0.0,
        "preemptions": sum(e.preemptions for e in engines),
        "rejected": rejected,
        "unfinished": unfinished,
        "max_mean_load": round(max(means) / mean, 3) if mean else 0.0,
        "completion_rps": round((len(reqs) - unfinished) / max(1e-9, now - reqs[0].t), 4)
        if reqs
        else 0.0,
        "reasons": dict(sorted(reasons.items())),
        "cap": cap,
        "sim_end_s": round(now, 1),
    }
