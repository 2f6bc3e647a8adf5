"""``tokenrelay capacity`` checked against a shape it was not fitted on: its prediction
beside a measurement, in one run of :mod:`bench.peers.pathcost` (tokenrelay only).

Two phases on one cluster, alternating rounds as pathcost runs them:

- ``fit_<S>x1_<R>``: ``--fit-sessions`` sessions x 1 screen at ``--fit-rate`` tokens/s
  in all (a frame per token): the shape the committed costs come from. Its figures are
  read the way ``tokenrelay capacity --from RUN.json`` reads a run
  (:func:`tokenrelay.capacity.core.costs_from_pathcost`, given only this phase);
- ``check_<S>x<V>_<R>``: ``--check-sessions`` sessions x ``--check-screens`` screens
  at ``--check-rate`` tokens/s in all: another shape (more screens per session, fewer
  sessions, another rate).

The prediction is :func:`tokenrelay.capacity.core.plan` for the check phase's target
(its screens, its measured tokens/s per session, its screens per session, a frame per
token), with the fitted costs: the cores of the relays, the Redis masters and the
workers (the publish path). The measurement is each participant's CPU seconds over the
check phase's rounds per wall second (medians; the masters' share from the run's Redis
CPU by role), over the seconds its producer published (the CPU of the round's settling
after them included). Printed: both and measured / predicted. Neither side includes the plan's
headroom (``--utilisation``): cores, not pods.

``python -m bench.peers.capcheck [--quick] [--json PATH] [--seed N]``;
``--report PATH.json`` prints the markdown of bench/README.md.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from typing import Any

from bench.harness import Bench as Harness
from bench.harness import OnCluster, Outcome, flag
from bench.peers.pathcost import Config, run
from bench.peers.pathsystem import Phase
from tokenrelay.capacity.core import Assumptions, Target, costs_from_pathcost, plan

__all__ = ["check", "main", "report"]

ROLES = (("relay", "server", "relay_cores"), ("Redis masters", "redis_masters",
         "redis_master_cores"), ("workers (publish path)", "producer", "worker_cores"))  # fmt: skip


def _seconds(r: dict[str, Any]) -> float:
    """A round's publishing seconds (its window, where the round does not say)."""
    return float(r["notes"].get("producer_seconds") or r["wall_s"] or 1.0)


def _cores(rounds: list[dict[str, Any]], key: str) -> float:
    """Median over the rounds of a participant's CPU seconds per publishing second."""
    got = []
    for r in rounds:
        wall = _seconds(r)
        cpu = r["notes"].get("redis_masters_cpu_s") if key == "redis_masters" else None
        got.append(float(cpu if cpu is not None else r["cpu_s"].get(key, 0.0)) / wall)
    return float(statistics.median(got)) if got else 0.0


def check(res: dict[str, Any], fit: str, probe: str) -> dict[str, Any]:
    """The prediction for ``probe`` from ``fit``'s costs, beside ``probe``'s measurement."""
    only_fit = {"phases": {fit: res["phases"][fit]}, "results": {fit: res["results"][fit]}}
    ph = res["phases"][probe]
    costs = costs_from_pathcost(only_fit, ph["viewers"])
    got = res["results"][probe]["tokenrelay"]
    rounds = got["rounds"]
    per_session = statistics.median(r["published"] / _seconds(r) for r in rounds) / ph["sessions"]
    target = Target(ph["sessions"] * ph["viewers"], per_session, ph["viewers"])
    p = plan(target, costs, Assumptions())
    rows = []
    for label, key, attr in ROLES:
        predicted, measured = float(getattr(p, attr)), _cores(rounds, key)
        rows.append({"participant": label, "predicted_cores": round(predicted, 3),
                     "measured_cores": round(measured, 3),
                     "ratio": round(measured / predicted, 2) if predicted else None})  # fmt: skip
    return {"fit": fit, "check": probe, "costs": costs.__dict__, "target": target.__dict__,
            "kept_up": got["kept_up"], "lost": got["lost"], "rows": rows}  # fmt: skip


def report(res: dict[str, Any]) -> str:
    c = res["check"]
    t = c["target"]
    lines = [
        f"Fitted on `{c['fit']}`, checked on `{c['check']}`: {t['viewers']:,} screens, "
        f"{t['viewers_per_session']:g} per session, {t['tokens_per_s']:.1f} tokens/s per "
        f"session (measured), a frame per token; the check phase kept up: "
        f"{'yes' if c['kept_up'] else 'no'}, lost {c['lost']}.",
        "",
        "| participant | predicted cores | measured cores | measured / predicted |",
        "|---|---|---|---|",
    ]
    for r in c["rows"]:
        lines.append(f"| {r['participant']} | {r['predicted_cores']:.3f} | "
                     f"{r['measured_cores']:.3f} | {r['ratio']} |")  # fmt: skip
    k = c["costs"]
    lines += [
        "",
        f"Fitted costs (µs per token): producer {k['producer_us']:g}, Redis masters "
        f"{k['redis_masters_us']:g} per published token, relay {k['relay_us']:g} per "
        f"delivered token ({k['source']}).",
        f"{res['config']['repeats']} round(s) of {res['config']['seconds']:g} s per phase; "
        f"{res['cpus']} CPUs, load {' '.join(res['loadavg_start'])} at the start, "
        f"{' '.join(res['loadavg_end'])} at the end.",
    ]
    return "\n".join(lines)


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "the rounds' seed")
    fit_sessions: int = flag(1000, "sessions of the fitting phase (1 screen each)",
                             quick=400, least=1)  # fmt: skip
    fit_rate: int = flag(10_000, "tokens/s of the fitting phase, all sessions together",
                         quick=4_000, least=1)  # fmt: skip
    check_sessions: int = flag(100, "sessions of the checked shape", quick=40, least=1)
    check_screens: int = flag(10, "screens per session of the checked shape", least=1)
    check_rate: int = flag(2_000, "tokens/s of the checked shape, all sessions together",
                           quick=1_000, least=1)  # fmt: skip
    seconds: float = flag(8.0, "publishing seconds per round", quick=3.0)
    repeats: int = flag(3, "rounds per phase", quick=1, least=1)


def _run(f: Flags) -> Outcome:
    fit = Phase(f"fit_{f.fit_sessions}x1_{f.fit_rate}", f.fit_sessions, 1, f.fit_rate,
                f.seconds)  # fmt: skip
    probe = Phase(f"check_{f.check_sessions}x{f.check_screens}_{f.check_rate}",
                  f.check_sessions, f.check_screens, f.check_rate, f.seconds)  # fmt: skip
    cfg = Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, systems=("tokenrelay",),
                 custom=(fit, probe))  # fmt: skip
    res = asyncio.run(run(cfg, f.redis))
    res["check"] = check(res, fit.name, probe.name)
    return Outcome(res, report(res), 0)


BENCH = Harness(
    Flags,
    _run,
    uvloop=True,
    prog="python -m bench.peers.capcheck",
    description=__doc__,
    quick_help="400 x 1 fitted, 40 x 10 checked, 1 round of 3 s each",
    markdown=report,
)
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main

if __name__ == "__main__":
    raise SystemExit(main())
