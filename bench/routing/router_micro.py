"""Micro-benchmark of the router's hot path: route + release, beside the bare hash.

What it is for: show that a routing decision costs a few microseconds, for 4, 16 and 64
engines with 160 vnodes each, both *idle* (the preferred engine accepts) and *saturated*
(every engine is at its cap but one, the farthest clockwise from each key, so every route
walks or scans the whole distinct-successor list), next to the cost of the bare
``mmh3.hash`` of the same keys.

Call order: ``measure(engines, mode) -> ns``; ``main()`` is the CLI:
``python -m bench.routing.router_micro [--json PATH] [--quick]``. JSON keys: ``route_release_ns``
(engine count -> {"idle", "saturated", "saturated_least_loaded", "full": ns}; "full" is a
route that raises AllEnginesFull, nothing to release) and ``hash_ns``. Each figure is the
median over repeats of the mean over a batch of keys.
"""

from __future__ import annotations

import gc
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import mmh3

from bench.harness import Bench, Common, Outcome, flag
from worker.routing.lease import AllEnginesFull, EngineSpec, Lease
from worker.routing.policy import DEFAULT_SPILL
from worker.routing.router import Router

__all__ = ["ENGINE_COUNTS", "MODES", "add_arguments", "hash_ns", "main", "measure", "run_from_args"]

ENGINE_COUNTS = (4, 16, 64)
MODES = ("idle", "saturated", "saturated_least_loaded", "full")
_KEYS = [f"{i:032x}\x1fuser:question number {i} about consistent hashing" for i in range(2000)]


def _median_ns(fn: Any, repeats: int) -> float:
    """Median over ``repeats`` of the mean ns per key of ``fn(keys)`` over all keys."""
    samples = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection inside one batch is not the router's cost
    try:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            fn(_KEYS)
            samples.append((time.perf_counter_ns() - t0) / len(_KEYS))
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(samples)


def hash_ns(repeats: int) -> float:
    h = mmh3.hash

    def run(keys: list[str]) -> None:
        for k in keys:
            h(k, 0, False)

    return _median_ns(run, repeats)


def measure(n_engines: int, mode: str, repeats: int) -> float:
    """Median ns per operation. ``mode``: ``idle`` (default spill policy), ``saturated``
    (walk spill to the one engine with room), ``saturated_least_loaded`` (least-loaded
    scan for it), ``full`` (default policy detects a full cluster, raises AllEnginesFull)."""
    spill = {"saturated": "walk", "saturated_least_loaded": "least_loaded"}.get(mode, DEFAULT_SPILL)
    cap = 1_000_000 if mode == "idle" else 1
    specs = [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=cap) for i in range(n_engines)]
    router = Router(specs, vnodes=160, eps=1e9, spill=spill)
    held: list[Lease] = []
    keys = _KEYS
    if mode != "idle":
        # Hold one lease on every engine but the last (all of them for "full").
        free = None if mode == "full" else specs[-1].id
        for s in specs:
            if s.id != free:
                key = next(k for k in _KEYS if router.preferred(k) == s.id)
                held.append(router.route(key))
        keys = [k for k in _KEYS if router.preferred(k) != free]
    route = router.route

    def run(_: list[str]) -> None:
        for k in keys:
            route(k).release()

    def run_full(_: list[str]) -> None:
        for k in keys:
            try:  # noqa: SIM105 - contextlib.suppress would add its own cost to the figure
                route(k)
            except AllEnginesFull:
                pass

    ns = _median_ns(run_full if mode == "full" else run, repeats) * len(_KEYS) / len(keys)
    for lease in held:
        lease.release()
    return ns


@dataclass
class Flags(Common):
    repeats: int = flag(31, "timed repeats per figure (the median kept)", quick=5, least=1)


def _run(f: Flags) -> Outcome:
    out: dict[str, Any] = {
        "route_release_ns": {},
        "hash_ns": round(hash_ns(f.repeats), 1),
        "vnodes": 160,
        "default_spill": DEFAULT_SPILL,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(f"bare mmh3.hash of the key: {out['hash_ns']:.0f} ns")
    print(f"{'engines':>8}" + "".join(f"{m:>24}" for m in MODES) + "   (ns per operation)")
    for n in ENGINE_COUNTS:
        row = {m: round(measure(n, m, f.repeats), 1) for m in MODES}
        out["route_release_ns"][str(n)] = row
        print(f"{n:>8}" + "".join(f"{row[m]:>24.0f}" for m in MODES), flush=True)
    return Outcome(out)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.router_micro", description=__doc__,
              quick_help="fewer repeats")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
