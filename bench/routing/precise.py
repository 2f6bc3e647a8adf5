"""Precise routing from the engines' KV events, against the estimate (``cost_aware``).

What it answers, in one run (the machine is shared: the timings are ratios of one run):

1. **Routing** (the routing simulator, ``bench/routing/sim.py``, engines modelled on vLLM
   publishing their KV events into each worker's index): hit rate, goodput and TTFT p99 of
   ``precise`` beside ``cost_aware`` (the default) and two other policies, on the Mooncake
   conversation trace (native timing and 0.5 / 0.75 / 1.0 / 1.5 x capacity) and on the
   shared-prefix workload shaped like llm-d's benchmark
   (``bench.routing.workloads.SHARED_PREFIX``), ``--workers`` workers.
2. **Workers**: the same on the shared-prefix workload at 1.0 x with 2, 4 and 8 workers (the
   estimate knows only its own worker's decisions; the index is the same in every worker).
3. **Staleness**: ``precise`` on the shared-prefix workload at 1.0 x with its events
   delayed (0 to 16 s) or lost (5 to 80 % of the batches), the loss either unseen (the
   index is silently wrong) or seen as a gap no replay fills (the worker's rule: the
   engine's blocks dropped, the engine estimated for 10 s), beside ``cost_aware``: how
   stale the index may get before precise stops winning.
4. **Costs** (``micro``): the index's memory per million blocks; the events one worker
   absorbs per second (decode + sequence check + apply, CPU per event, vLLM-sized batches);
   a routing decision (route + release) with the index against today's ``cost_aware``
   for an 8k-token prompt on 8 engines, and the prompt -> block keys step (the mock
   tokenizer + chained keys) the worker runs before it, its messages seen before (a
   session's history, a system prompt: cached) and first seen.

CLI: ``python -m bench.routing.precise [--quick] [--seed N] [--seeds K] [--procs N]
[--workers W] [--json PATH]``; prints the tables docs/ROUTING.md quotes. ``--quick``: the
simulator's quick workloads (90 s of sessions, 1,500 trace requests: mostly a cold start,
not the figures the docs quote) and shorter micro-benchmarks.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Any, Final

from bench.harness import Bench, Common, Outcome, flag
from bench.routing.core import SimConfig, run
from bench.routing.sim import TRACE, capacity, run_all, workload
from worker.routing.blockindex import BlockIndex
from worker.routing.cost import TurnInfo
from worker.routing.kvwire import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from worker.routing.kvwire import encode_batch as encode
from worker.routing.lease import EngineSpec
from worker.routing.router import Router
from worker.routing.tokens import block_keys, clear_cache, prompt_ids

__all__ = ["add_arguments", "main", "micro", "run_from_args"]

POLICIES: Final = ("precise", "cost_aware", "bounded_load_eps", "sglang_cache_aware")
METRICS: Final = ("hit_rate", "goodput_rps", "ttft_p99_ms", "rejected")
DELAYS: Final = (0.0, 0.25, 1.0, 4.0, 16.0)
DROPS: Final = (0.05, 0.2, 0.5, 0.8)
WORKER_COUNTS: Final = (2, 4, 8)


def _sim(args: tuple[str, str, str, int, bool, SimConfig]) -> tuple[tuple[Any, ...], Any]:
    kind, level, policy, seed, quick, base = args
    reqs = workload(kind, level, str(TRACE), quick, seed, base.engines)
    res = run(replace(base, policy=policy, seed=seed), reqs)
    stale = (base.kv_delay_s, base.kv_drop, base.kv_drop_detected)
    key = (kind, level, policy, seed, base.workers, *stale)
    return key, {m: res[m] for m in METRICS}


def _pool_map(tasks: list[Any], procs: int) -> dict[tuple[Any, ...], Any]:
    if procs > 1:
        with get_context("fork").Pool(procs) as pool:
            return dict(pool.imap_unordered(_sim, tasks, chunksize=1))
    return dict(map(_sim, tasks))


def _mean(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    return {m: round(sum(r[m] for r in rows) / len(rows), 4) for m in METRICS}


def sweeps(quick: bool, seeds: Sequence[int], procs: int, workers: int) -> dict[str, Any]:
    """Workers and staleness on the shared-prefix workload at 1.0 x capacity."""
    capacity("shared_prefix", str(TRACE), quick, 0, 8)  # calibrated before the fork
    tasks: list[Any] = []
    for w in WORKER_COUNTS:
        for pol in ("precise", "cost_aware"):
            tasks += [("shared_prefix", "1.0", pol, s, quick, SimConfig(workers=w)) for s in seeds]
    for d in DELAYS[1:]:
        base = SimConfig(workers=workers, kv_delay_s=d)
        tasks += [("shared_prefix", "1.0", "precise", s, quick, base) for s in seeds]
    for p in DROPS:
        for detected in (False, True):
            base = SimConfig(workers=workers, kv_drop=p, kv_drop_detected=detected)
            tasks += [("shared_prefix", "1.0", "precise", s, quick, base) for s in seeds]
    got = _pool_map(tasks, procs)

    def mean(
        pol: str, w: int, delay: float = 0.0, drop: float = 0.0, detected: bool = False
    ) -> dict[str, float]:
        keys = [("shared_prefix", "1.0", pol, s, w, delay, drop, detected) for s in seeds]
        return _mean([got[k] for k in keys])

    return {
        "workers": {
            str(w): {p: mean(p, w) for p in ("precise", "cost_aware")} for w in WORKER_COUNTS
        },
        "staleness": {
            "cost_aware": mean("cost_aware", workers),
            "delay_s": {f"{d:g}": mean("precise", workers, delay=d) for d in DELAYS},
            "drop": {f"{p:g}": mean("precise", workers, drop=p) for p in DROPS},
            "drop_detected": {
                f"{p:g}": mean("precise", workers, drop=p, detected=True) for p in DROPS
            },
        },
    }


# ---- costs ------------------------------------------------------------------------------

_BS: Final = 16


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` (the collector off, as timeit does)."""
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(samples)


def _memory(n_blocks: int, engines: int = 8) -> float:
    """Bytes a block of the index costs: ``n_blocks`` distinct 16-token blocks stored by
    ``engines`` engines (chains of 64 blocks), measured by tracemalloc."""
    ix = BlockIndex(_BS, max_blocks=n_blocks)
    for e in range(engines):
        ix.add_engine(f"e{e}")
        ix.sequence(f"e{e}", 0)
    batches = []
    h = 0
    for c in range(n_blocks // 64):
        tokens = list(range(c * 64 * _BS, (c + 1) * 64 * _BS))
        hashes: list[BlockHash] = [(h + i) * 0x9E3779B97F4A7C15 & (2**64 - 1) for i in range(64)]
        h += 64
        batches.append(
            (f"e{c % engines}", KVEventBatch(0.0, [BlockStored(hashes, None, tokens, _BS)]))
        )
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for name, b in batches:
        ix.apply(name, b, 0.0)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    stored = len(ix)
    assert stored == n_blocks // 64 * 64
    return (after - before) / stored


def _absorb(n_batches: int, repeats: int) -> dict[str, float]:
    """CPU of the follower's work per event: decode, sequence check, apply. Batches as vLLM
    sends them in steady state: a BlockStored of 4 new blocks (a 64-token chunk of one
    request) and a BlockRemoved of 4 evicted ones, per engine step."""
    payloads = []
    for i in range(n_batches):
        toks = list(range(i * 64, (i + 1) * 64))
        stored = BlockStored([i * 4 + j for j in range(4)], None, toks, _BS, None, "GPU")
        removed = BlockRemoved([(i - 50) * 4 + j for j in range(4)], "GPU")
        payloads.append(encode(KVEventBatch(0.0, [stored, removed] if i >= 50 else [stored])))
    events = sum(2 if i >= 50 else 1 for i in range(n_batches))

    def absorb() -> None:
        ix = BlockIndex(_BS)
        ix.add_engine("e")
        for seq, p in enumerate(payloads):
            if ix.sequence("e", seq) == "apply":
                ix.apply("e", decode_batch(p), 0.0)

    s = _timed(absorb, repeats)
    return {
        "us_per_event": round(s / events * 1e6, 3),
        "us_per_block": round(s / (events * 4) * 1e6, 3),
        "events_per_s": round(events / s),
    }


def _route(repeats: int) -> dict[str, float]:
    """Route + release (µs) of an 8k-token prompt on 8 engines: precise with an index in
    which 2 engines hold its first half, cost_aware with the same turn; and the prompt ->
    block keys step (the mock tokenizer over the messages, keys of 512 blocks)."""
    system = " ".join(f"w{i}" for i in range(4094))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "x " * 4096}]
    ids = prompt_ids(msgs)
    keys = block_keys(ids, _BS)
    specs = [EngineSpec(id=f"e{i}", url=f"sim://{i}", cap=1_000_000) for i in range(8)]
    ix = BlockIndex(_BS)
    for i in range(8):
        ix.add_engine(f"e{i}")
        ix.sequence(f"e{i}", 0)
        n = len(keys) // 2 if i < 2 else 0
        hashes: list[BlockHash] = list(range(i * 10_000, i * 10_000 + n))
        ix.apply(f"e{i}", KVEventBatch(0.0, [BlockStored(hashes, None, ids[: n * _BS], _BS)]), 0.0)
    turn = TurnInfo(prompt_tokens=len(ids), key="k", shared_key="s", shared_tokens=4096)
    out: dict[str, float] = {}
    n = 2000
    for name, policy, t in (
        ("cost_aware", "cost_aware", turn),
        ("precise", "precise", replace(turn, blocks=tuple(keys))),
    ):
        router = Router(specs, policy=policy, index=ix)

        def loop(router: Router = router, t: TurnInfo = t) -> None:
            for j in range(n):
                router.route(f"k{j % 64}", turn=t).release()

        out[f"{name}_us"] = round(_timed(loop, repeats) / n * 1e6, 2)
    m = 200
    out["prompt_keys_us"] = round(
        _timed(lambda: [block_keys(prompt_ids(msgs), _BS) for _ in range(m)], repeats) / m * 1e6, 1
    )

    def cold() -> None:
        for _ in range(20):
            clear_cache()
            block_keys(prompt_ids(msgs), _BS)

    out["prompt_keys_cold_us"] = round(_timed(cold, repeats) / 20 * 1e6, 1)
    out["prompt_tokens"] = len(ids)
    out["match_blocks"] = len(keys)
    return out


def micro(quick: bool) -> dict[str, Any]:
    reps = 3 if quick else 7
    n = 100_000 if quick else 1_000_000
    per_block = _memory(n)
    return {
        "index_bytes_per_block": round(per_block, 1),
        "index_mib_per_million_blocks": round(per_block * 1e6 / 2**20, 1),
        "memory_blocks_measured": n,
        "absorb": _absorb(2_000 if quick else 20_000, reps),
        "route": _route(reps),
    }


# ---- output -----------------------------------------------------------------------------


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _compare(lines: list[str], res: dict[str, Any]) -> None:
    for kind, w in res["compare"]["workloads"].items():
        lines += ["", f"**{kind}** ({res['workers']} workers, seeds {res['seeds']})", ""]
        head = ["load"]
        for m in ("hit", "goodput", "TTFT p99 ms"):
            head += [f"precise {m}", f"cost_aware {m}"]
        lines += [_row(head), _row(["---"] * len(head))]
        for level, rows in w["levels"].items():
            cells: list[object] = [level]
            for m in ("hit_rate", "goodput_rps", "ttft_p99_ms"):
                cells += [rows["precise"][m], rows["cost_aware"][m]]
            lines.append(_row(cells))
        others = [p for p in next(iter(w["levels"].values())) if p not in ("precise", "cost_aware")]
        if not others:
            continue
        head = ["load", *(f"{p} goodput / TTFT p99 ms" for p in others)]
        lines += ["", _row(head), _row(["---"] * len(head))]
        for level, rows in w["levels"].items():
            pairs = [f"{rows[p]['goodput_rps']} / {rows[p]['ttft_p99_ms']}" for p in others]
            lines.append(_row([level, *pairs]))


def _sweeps(lines: list[str], res: dict[str, Any]) -> None:
    sw = res["sweeps"]
    head = ["workers", "precise hit", "cost_aware hit", "precise goodput", "cost_aware goodput"]
    head += ["precise TTFT p99 ms", "cost_aware TTFT p99 ms"]
    lines += ["", "**workers** (shared_prefix, 1.0 x)", "", _row(head), _row(["---"] * len(head))]
    for w, r in sw["workers"].items():
        p, c = r["precise"], r["cost_aware"]
        cells = [w, p["hit_rate"], c["hit_rate"], p["goodput_rps"], c["goodput_rps"]]
        lines.append(_row([*cells, p["ttft_p99_ms"], c["ttft_p99_ms"]]))
    st = sw["staleness"]
    ca = st["cost_aware"]
    lines += [
        "",
        f"**staleness** (shared_prefix, 1.0 x, {res['workers']} workers; cost_aware: hit "
        f"{ca['hit_rate']}, goodput {ca['goodput_rps']}, TTFT p99 {ca['ttft_p99_ms']} ms)",
        "",
        _row(["precise's events", "hit", "goodput", "TTFT p99 ms"]),
        _row(["---"] * 4),
    ]
    for d, r in st["delay_s"].items():
        lines.append(_row([f"{d} s late", r["hit_rate"], r["goodput_rps"], r["ttft_p99_ms"]]))
    for p, r in st["drop"].items():
        lost = f"{float(p):.0%} lost, unseen"
        lines.append(_row([lost, r["hit_rate"], r["goodput_rps"], r["ttft_p99_ms"]]))
    for p, r in st["drop_detected"].items():
        lost = f"{float(p):.0%} lost, seen (estimated 10 s)"
        lines.append(_row([lost, r["hit_rate"], r["goodput_rps"], r["ttft_p99_ms"]]))


def markdown(res: dict[str, Any]) -> str:
    lines: list[str] = []
    _compare(lines, res)
    _sweeps(lines, res)
    mi = res["micro"]
    ab, ro = mi["absorb"], mi["route"]
    memory = f"{mi['index_bytes_per_block']} B a block, "
    memory += f"{mi['index_mib_per_million_blocks']} MiB per million blocks"
    absorb = f"{ab['events_per_s']} events/s ({ab['us_per_event']} µs an event, "
    absorb += f"{ab['us_per_block']} µs a block)"
    keys = f"{ro['prompt_keys_us']} µs ({ro['prompt_tokens']} tokens, messages seen before; "
    keys += f"{ro['prompt_keys_cold_us']} µs first seen)"
    lines += [
        "",
        "**costs**",
        "",
        _row(["what", "figure"]),
        _row(["---", "---"]),
        _row(["index memory", memory]),
        _row(["events absorbed", absorb]),
        _row(["route + release, cost_aware", f"{ro['cost_aware_us']} µs"]),
        _row(["route + release, precise", f"{ro['precise_us']} µs ({ro['match_blocks']} blocks)"]),
        _row(["prompt -> block keys", keys]),
    ]
    return "\n".join(lines)


@dataclass
class Flags(Common):
    seed: int = flag(7, "first seed")
    seeds: int = flag(2, "seeds averaged", least=1)
    procs: int = flag(2, "worker processes", least=1)
    workers: int = flag(2, "workers in the simulator", least=1)


def _run(f: Flags) -> Outcome:
    seeds = [f.seed + i for i in range(f.seeds)]
    t0 = time.perf_counter()
    res: dict[str, Any] = {"seeds": seeds, "workers": f.workers, "quick": f.quick}
    res["micro"] = micro(f.quick)  # first: the simulations after it load the machine
    res["compare"] = run_all(
        quick=f.quick,
        seeds=seeds,
        path=str(TRACE),
        procs=f.procs,
        policies=POLICIES,
        workloads=("trace", "shared_prefix"),
        base=SimConfig(workers=f.workers),
    )
    res["sweeps"] = sweeps(f.quick, seeds, f.procs, f.workers)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return Outcome(res, f"{markdown(res)}\n\n(wall {res['wall_s']} s)")


BENCH = Bench(Flags, _run, prog="python -m bench.routing.precise", description=__doc__,
              quick_help="the simulator's quick workloads", raw_description=True,
              markdown=markdown, sigterm=False)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
