"""Routing simulator: every routing policy through the same engine model, on a real trace.

What it is for: deciding, with evidence, which policy the worker should route with. Each
run sends one workload through W workers and E engines modelled on vLLM
(``bench/routing/engine_model.py``: continuous batching in steps, chunked prefill sharing steps
with decodes, a block KV cache shared by running sequences and an LRU prefix cache,
preemption with recompute); ``bench/routing/core.py`` is one run, ``bench/routing/policies.py``
the policies, ``bench/routing/workloads.py`` the workloads. Policies: ``round_robin``,
``least_loaded``, ``sticky_session``, ``consistent_hash``, ``article_fixed_cap``,
``bounded_load_eps``, ``sglang_cache_aware``, ``cost_aware`` (the default), ``precise``
(cost_aware reading the engines' own KV events, ``python -m bench.routing.precise``).

Workloads: ``trace`` (the Mooncake conversation trace, ``--trace PATH``; replayed at its
own timing as ``native`` and time-scaled to 0.5, 0.75, 1.0 and 1.5 x the fleet's capacity);
``synthetic`` (multi-turn chat over Zipf-popular system prompts, one session a second,
time-scaled to the same load levels); ``pulse`` (the synthetic mix plus 200 sessions on one
8k-token system prompt within 10 s, time-scaled so that the mix offers 0.5 x: the burst is
compressed by the same factor); ``shared_prefix`` (not run unless named: the mix shaped
like llm-d's shared-prefix benchmark, ``bench.routing.workloads.SHARED_PREFIX``, at the
same load levels, its own capacity).
Capacity: the saturated completion rate under ``least_loaded`` (the workload's arrivals
compressed in time until they come at least 2 x faster than the fleet serves them;
completions per second until the last one), per seed for the trace, once (seed 0, at
1 session/s before compression) for the synthetic mix. Each figure is the mean of
``--seeds`` seeds (the seed moves every arrival by up to 1 s of trace time, names the
engines on the ring and draws the synthetic sessions), with its min and max under ``spread``.

``--quick``: the first 1,500 trace requests (about 7 minutes of the trace) and 90 s of
synthetic sessions, instead of all 12,031 requests and 600 s. ``--workloads`` runs a
subset (results of separate runs are separate JSON files).

CLI: ``python -m bench.routing.sim [--quick] [--seed N] [--seeds K] [--trace PATH]
[--workloads LIST] [--policies LIST] [--route-queue Q] [--recompute-weight W]
[--json PATH] [--plot PREFIX] [--procs N]``; with several seeds the table also gives each
policy's TTFT p99 seed by seed; then the same results as the Markdown tables
docs/ROUTING.md quotes (``bench/routing/report.py``). ``--route-queue`` and
``--recompute-weight`` change cost_aware's product settings (default: the worker's), to
measure what each one does.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Final

from bench.harness import Bench, Common, Outcome, flag
from bench.routing.core import DEFAULT_POLICY, SimConfig, run
from bench.routing.policies import POLICIES
from bench.routing.report import markdown
from bench.routing.workloads import (
    SHARED_PREFIX,
    Request,
    SynthConfig,
    TraceError,
    load_trace,
    pulse,
    scale,
    synthetic,
)

__all__ = [
    "DEFAULT_POLICY",
    "LEVELS",
    "POLICIES",
    "add_arguments",
    "capacity",
    "main",
    "run_all",
    "run_from_args",
    "workload",
]

LEVELS: Final = (0.5, 0.75, 1.0, 1.5)
WORKLOADS: Final = ("trace", "synthetic", "pulse", "shared_prefix")
DEFAULT_WORKLOADS: Final = ("trace", "synthetic", "pulse")
TRACE: Final = Path(__file__).parent / "traces" / "mooncake_conversation.jsonl"
_DEFAULTS: Final = SimConfig()
_BY_SEED: Final = ("goodput_rps", "ttft_p99_ms", "hit_rate", "rejected", "cap", "peak_load")
_METRICS: Final = (
    "goodput_rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p99_ms",
    "hit_rate",
    "preemptions",
    "rejected",
    "max_mean_load",
)


@functools.lru_cache(maxsize=4)
def _trace(path: str, limit: int) -> tuple[Request, ...]:
    return tuple(load_trace(path, limit=limit))


def _synth_cfg(quick: bool) -> SynthConfig:
    return SynthConfig(duration_s=90.0 if quick else 600.0)


def _native_rps(reqs: Sequence[Request]) -> float:
    if len(reqs) < 2:
        return 1e-9
    return max(1e-9, (len(reqs) - 1) / max(1e-9, reqs[-1].t - reqs[0].t))


@functools.lru_cache(maxsize=64)
def capacity(kind: str, path: str, quick: bool, seed: int, engines: int) -> float:
    """Saturated completion rate (requests/s) under least_loaded: the workload offered
    at least 2 x faster than it is served; completions per second until the last one."""
    offered = 2.0 * engines  # a first guess above what the engines serve
    served = 0.0
    for _ in range(4):
        base = list(_base(kind, path, quick, seed, 1.0))
        probe = scale(base, offered / _native_rps(base), seed=seed, jitter_s=0.0)
        res = run(
            SimConfig(policy="least_loaded", engines=engines, seed=seed, drain_s=36_000.0), probe
        )
        served = float(res["completion_rps"])
        if _native_rps(probe) >= 2.0 * served:
            return served
        offered = 4.0 * served
    return served


def _base(kind: str, path: str, quick: bool, seed: int, rate: float) -> tuple[Request, ...]:
    if kind == "trace":
        return _trace(path, 1500 if quick else 0)
    cfg = replace(_synth_cfg(quick), rate=rate)
    if kind == "shared_prefix":
        cfg = replace(SHARED_PREFIX, duration_s=cfg.duration_s, rate=rate)
    return tuple(synthetic(cfg, seed=seed))


def workload(
    kind: str, level: str, path: str, quick: bool, seed: int, engines: int
) -> list[Request]:
    """The requests of one workload at one load level (a capacity fraction or native)."""
    if kind == "trace":
        base = list(_trace(path, 1500 if quick else 0))
        if level == "native":
            return scale(base, 1.0, seed=seed)
        cap = capacity("trace", path, quick, seed, engines)
        return scale(base, float(level) * cap / _native_rps(base), seed=seed)
    # sessions at 1/s, then time-scaled like the trace (think times included)
    mix = "shared_prefix" if kind == "shared_prefix" else "synthetic"
    cap = capacity(mix, path, quick, 0, engines)
    base = list(_base(mix, path, quick, seed, 1.0))
    factor = float(level) * cap / _native_rps(base)
    if kind == "pulse":
        cfg = replace(_synth_cfg(quick), rate=1.0)
        return scale(pulse(cfg, seed=seed, at_s=cfg.duration_s / 3), factor, seed=seed)
    return scale(base, factor, seed=seed)


def _task(
    args: tuple[str, str, str, int, str, bool, int, SimConfig],
) -> tuple[tuple[str, str, str, int], dict[str, Any]]:
    kind, level, policy, seed, path, quick, engines, base = args
    reqs = workload(kind, level, path, quick, seed, engines)
    res = run(replace(base, policy=policy, engines=engines, seed=seed), reqs)
    return (kind, level, policy, seed), res


def run_all(
    *,
    quick: bool,
    seeds: Sequence[int],
    path: str,
    engines: int = 8,
    procs: int = 2,
    policies: Sequence[str] = POLICIES,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    base: SimConfig | None = None,
) -> dict[str, Any]:
    """Every workload, level, policy and seed; ``base``: the settings every run starts
    from (policy, engines and seed replaced)."""
    base = base or SimConfig()
    levels = [f"{x:g}" if x != 1.0 else "1.0" for x in LEVELS]
    full: dict[str, list[str]] = {
        "trace": ["native", *levels],
        "synthetic": levels,
        "pulse": ["0.5"],
        "shared_prefix": levels,
    }
    plan = {k: v for k, v in full.items() if k in workloads}
    tasks = [
        (kind, level, pol, s, path, quick, engines, base)
        for kind, levels in plan.items()
        for level in levels
        for s in seeds
        for pol in policies
    ]
    for s in seeds:  # calibrate once, before the pool forks (the children inherit the cache)
        if "trace" in plan:
            capacity("trace", path, quick, s, engines)
    if "synthetic" in plan or "pulse" in plan:
        capacity("synthetic", path, quick, 0, engines)
    if "shared_prefix" in plan:
        capacity("shared_prefix", path, quick, 0, engines)
    if procs > 1:
        with get_context("fork").Pool(procs) as pool:
            results = dict(pool.imap_unordered(_task, tasks, chunksize=1))
    else:
        results = dict(map(_task, tasks))
    out: dict[str, Any] = {
        "default_policy": DEFAULT_POLICY,
        "seeds": list(seeds),
        "quick": quick,
        "engines": engines,
        "route_queue": base.route_queue,
        "recompute_weight": base.recompute_weight,
        "workloads": {},
    }
    for kind, levels in plan.items():
        caps = {
            s: capacity("trace", path, quick, s, engines)
            if kind == "trace"
            else capacity(
                "shared_prefix" if kind == "shared_prefix" else "synthetic", path, quick, 0, engines
            )
            for s in seeds
        }
        w: dict[str, Any] = {
            "capacity_rps": {str(s): round(c, 3) for s, c in caps.items()},
            "levels": {},
        }
        for level in levels:
            row: dict[str, Any] = {}
            for pol in policies:
                runs = [results[(kind, level, pol, s)] for s in seeds]
                agg: dict[str, Any] = {
                    m: round(sum(r[m] for r in runs) / len(runs), 4) for m in _METRICS
                }
                agg["spread"] = {
                    m: [min(r[m] for r in runs), max(r[m] for r in runs)] for m in _METRICS
                }
                agg["by_seed"] = {m: [r[m] for r in runs] for m in _BY_SEED}
                agg["unfinished"] = sum(r["unfinished"] for r in runs)
                agg["reasons"] = runs[0]["reasons"]
                row[pol] = agg
            w["levels"][level] = row
        out["workloads"][kind] = w
    return out


def table(res: dict[str, Any]) -> str:
    lines: list[str] = []
    for kind, w in res["workloads"].items():
        lines.append(f"== {kind} (capacity {w['capacity_rps']} req/s by seed)")
        for level, rows in w["levels"].items():
            lines.append(f"load {level}")
            lines.append(f"{'policy':<20}" + "".join(f"{m:>15}" for m in _METRICS))
            for pol, r in rows.items():
                lines.append(f"{pol:<20}" + "".join(f"{r[m]:>15}" for m in _METRICS))
            if len(res["seeds"]) > 1:
                lines.append(f"TTFT p99 ms by seed {res['seeds']}")
                for pol, r in rows.items():
                    lines.append(f"{pol:<20} {r['by_seed']['ttft_p99_ms']}")
                sticky = rows.get("sticky_session")
                for pol, r in rows.items():
                    if sticky is not None and pol != "sticky_session":
                        ours, theirs = r["by_seed"]["ttft_p99_ms"], sticky["by_seed"]["ttft_p99_ms"]
                        below = sum(a < b for a, b in zip(ours, theirs, strict=True))
                        n = len(ours)
                        lines.append(f"{pol}: TTFT p99 below sticky_session's on {below} of {n}")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], prefix: str) -> list[str]:
    """One PNG per workload: goodput and TTFT p99 against load, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    prefix = prefix.removesuffix(".png")
    for kind, w in res["workloads"].items():
        levels = [lv for lv in w["levels"] if lv != "native"]
        if len(levels) < 2:
            continue
        xs = [float(lv) for lv in levels]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for pol in next(iter(w["levels"].values())):
            rows = [w["levels"][lv][pol] for lv in levels]
            a1.plot(xs, [r["goodput_rps"] for r in rows], marker="o", label=pol)
            a2.plot(xs, [max(1.0, r["ttft_p99_ms"]) for r in rows], marker="o", label=pol)
        a1.set_xlabel("offered load / capacity")
        a1.set_ylabel("goodput (req/s, TTFT <= 2 s and ITL <= 100 ms)")
        a2.set_xlabel("offered load / capacity")
        a2.set_ylabel("TTFT p99 (ms, log)")
        a2.set_yscale("log")
        for a in (a1, a2):
            a.grid(alpha=0.3)
        a2.legend(fontsize=8)
        fig.suptitle(f"routing_sim {kind}, seeds {res['seeds']}, {res['engines']} engines")
        fig.tight_layout()
        path = f"{prefix}_{kind}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


@dataclass
class Flags(Common):
    seed: int = flag(7, "first seed")
    seeds: int = flag(3, "seeds averaged", least=1)
    trace: str = flag(str(TRACE), "a Mooncake-format JSONL trace")
    engines: int = flag(8, "engines", least=1)
    procs: int = flag(2, "worker processes", least=1)
    workloads: str = flag(",".join(DEFAULT_WORKLOADS),
                          f"comma-separated subset of {','.join(WORKLOADS)}")  # fmt: skip
    policies: str = flag(",".join(POLICIES), "comma-separated subset (default: all)")
    route_queue: float = flag(_DEFAULTS.route_queue,
                              "cost_aware's queue past the cap, x the cap (the worker's)",
                              least=0)  # fmt: skip
    recompute_weight: float = flag(_DEFAULTS.recompute_weight, "cost_aware's weight of a "
                                   "session's tokens an engine lacks (the worker's)",
                                   least=0)  # fmt: skip
    plot: str | None = flag(None, "write PREFIX_<workload>.png", metavar="PREFIX")


def _run(f: Flags) -> Outcome:
    workloads = [w for w in f.workloads.split(",") if w]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        sys.exit(
            f"routing_sim: --workloads takes a comma-separated subset of {','.join(WORKLOADS)}"
        )
    policies = [p for p in f.policies.split(",") if p]
    if not policies or any(p not in POLICIES for p in policies):
        sys.exit(f"routing_sim: --policies takes a comma-separated subset of {','.join(POLICIES)}")
    try:
        load_trace(f.trace, limit=1)
    except TraceError as exc:
        sys.exit(f"routing_sim: {exc}")
    t0 = time.perf_counter()
    res = run_all(
        quick=f.quick,
        seeds=[f.seed + i for i in range(f.seeds)],
        path=f.trace,
        engines=f.engines,
        procs=f.procs,
        policies=policies,
        workloads=workloads,
        base=SimConfig(route_queue=f.route_queue, recompute_weight=f.recompute_weight),
    )
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{table(res)}\n(wall {res['wall_s']} s)\n\n{markdown(res)}")
    if f.plot:
        for p in plot(res, f.plot):
            print(f"wrote {p}")
    return Outcome(res)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.sim", description=__doc__,
              quick_help="1,500 trace requests, 90 s synthetic", raw_description=True,
              markdown=markdown, sigterm=False)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
