"""How the whole path's cost grows with the work: CPU per delivered token and p99 as live
sessions grow (one screen each) and as screens per session grow, at one LLM rate, for
tokenrelay and the peers that keep what they send (Centrifugo, Socket.IO with the
streams adapter), in one run of :mod:`bench.peers.pathcost` (same cluster, systems
alternating, medians of rounds; each point is one LLM-rate phase of it).

- ``sessions_<n>``: ``n`` live sessions x 1 screen, replying at ``--rate`` tokens/s with
  gaps between turns (:mod:`bench.peers.llmshape`: most live sessions are between turns,
  so this grows idle and streaming sessions together);
- ``screens_<k>``: ``--fan-sessions`` sessions x ``k`` screens each;
- ``masters_<m>``: ``--masters-sessions`` sessions x 1 screen on a cluster of ``m``
  masters (+ ``m`` replicas), each its own run of :mod:`bench.peers.pathcost` on a
  cluster started for it (the other points run on 3 masters); ``--masters ''`` leaves
  this sweep out.

``python -m bench.peers.pathscale [--quick] [--json PATH] [--seed N] [--plot PATH]``;
``--plot`` draws the curves as a PNG (matplotlib; the run says so when it is missing).
``--report PATH.json`` prints the markdown of bench/README.md.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness import Bench as Harness
from bench.harness import OnCluster, Outcome, flag
from bench.peers.llmshape import mean_rate
from bench.peers.pathcost import Config, run
from bench.peers.pathsystem import Phase

__all__ = ["main", "plan", "plot", "report"]

SYSTEMS = ("tokenrelay", "centrifugo", "socketio-streams")


def _ints(text: str, what: str, *, empty: bool = False) -> tuple[int, ...]:
    if empty and not text.strip():
        return ()
    try:
        got = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"pathscale: --{what} wants comma-separated integers") from None
    if not got or min(got) < 1:
        raise SystemExit(f"pathscale: --{what} wants integers >= 1")
    return got


def plan(
    sessions: tuple[int, ...], screens: tuple[int, ...], fan: int, rate: int, seconds: float
) -> tuple[Phase, ...]:
    """The sweep's phases, sessions first."""
    out = [Phase(f"sessions_{n}", n, 1, round(mean_rate(n, rate)), seconds, "llm", rate)
           for n in sessions]  # fmt: skip
    out += [Phase(f"screens_{k}", fan, k, round(mean_rate(fan, rate)), seconds, "llm", rate)
            for k in screens]  # fmt: skip
    return tuple(out)


def _series(res: dict[str, Any], prefix: str) -> dict[str, list[tuple[int, float, float]]]:
    """Per system, (x, µs per delivered token, p99 ms) along one sweep."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for name, by_sys in res["results"].items():
        if not name.startswith(prefix):
            continue
        x = int(name.rsplit("_", 1)[1])
        for sysname, r in by_sys.items():
            out.setdefault(sysname, []).append((x, r["us_per_token"]["whole"], r["p99_ms"]))
    return {k: sorted(v) for k, v in out.items()}


SWEEPS = (
    ("sessions_", "live sessions (1 screen each)"),
    ("screens_", "screens per session"),
    ("masters_", "Redis masters"),
)


def plot(res: dict[str, Any], path: Path) -> str:
    """The curves (per sweep in the run: CPU per token and p99) as a PNG at ``path``;
    what was written, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    sweeps = [(p, label) for p, label in SWEEPS if _series(res, p)]
    if not sweeps:
        return "no PNG: no sweep point in the run"
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5.5 * len(sweeps), 7.5), squeeze=False)
    for col, (prefix, label) in enumerate(sweeps):
        for sysname, pts in _series(res, prefix).items():
            xs = [p[0] for p in pts]
            axes[0][col].plot(xs, [p[1] for p in pts], marker="o", label=sysname)
            axes[1][col].plot(xs, [p[2] for p in pts], marker="o", label=sysname)
        for row, ylab in enumerate(("whole path µs per delivered token", "p99 ms")):
            ax = axes[row][col]
            if prefix != "masters_":
                ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(ylab)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{res['config']['llm_storm_rate']} tokens/s per replying session; "
                 f"load {' '.join(res['loadavg_start'])} at the start")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"PNG: {path}"


def report(res: dict[str, Any]) -> str:
    head = "| sweep | x | " + " | ".join(f"{s} µs/token, p99 ms" for s in SYSTEMS) + " |"
    lines = [head, "|" + "---|" * (2 + len(SYSTEMS))]
    for prefix, _ in SWEEPS:
        by = _series(res, prefix)
        xs = sorted({p[0] for pts in by.values() for p in pts})
        for x in xs:
            cells = []
            for s in SYSTEMS:
                got = [p for p in by.get(s, []) if p[0] == x]
                cells.append(f"{got[0][1]:.1f}, {got[0][2]:.0f}" if got else "-")
            lines.append(f"| {prefix.rstrip('_')} | {x} | " + " | ".join(cells) + " |")
    missing = [f"- **{n}**: not in this run: {why}" for n, why in res["missing"].items()]
    rounds = res.get("failed_rounds", {})
    failed = [f"- **{n}** in {ph}: its round failed: {why}"
              for ph, by in rounds.items() for n, why in by.items()]  # fmt: skip
    c = res["config"]
    tail = [f"{c['repeats']} round(s) of {c['seconds']:g} s per system and point; "
            f"{res['cpus']} CPUs, load {' '.join(res['loadavg_start'])} at the start, "
            f"{' '.join(res['loadavg_end'])} at the end."]  # fmt: skip
    return "\n".join([*lines, "", *missing, *failed, *tail])


def _merge(res: dict[str, Any] | None, more: dict[str, Any], masters: int) -> dict[str, Any]:
    """A masters point's run (its own cluster) into the sweep's result (or the first)."""
    run_of = {k: more[k] for k in ("cluster", "loadavg_start", "loadavg_end", "seconds",
                                   "redis_idle_cpu_s_per_s", "server_log_tracebacks")}  # fmt: skip
    if res is None:
        res = {**more, "missing": {}, "failed_rounds": {}}
    else:
        for key in ("phases", "results"):
            res[key].update(more[key])
        res["loadavg_end"] = more["loadavg_end"]
    res["failed_rounds"].update(more.get("failed_rounds", {}))
    res["missing"].update({f"{n} ({masters} masters)": why for n, why in more["missing"].items()})
    res.setdefault("masters_runs", {})[str(masters)] = run_of
    return res


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "picks the order of the systems")
    sessions: str = flag("100,500,1000,2000,5000", "live sessions of the first sweep ('': none)",
                         quick="100,400,1000")  # fmt: skip
    screens: str = flag("1,10,30,100", "screens per session of the second sweep ('': none)",
                        quick="1,10,50")  # fmt: skip
    fan_sessions: int = flag(40, "sessions of the screens sweep", least=1)
    masters: str = flag("3,6", "Redis masters of the third sweep ('': none)")
    masters_sessions: int = flag(1000, "sessions (1 screen each) of the masters sweep",
                                 quick=400, least=1)  # fmt: skip
    rate: int = flag(60, "tokens/s of each replying session", least=1)
    seconds: float = flag(8.0, "publishing seconds per round", quick=3.0)
    repeats: int = flag(3, "rounds per system and point", quick=1, least=1)
    systems: str = flag(",".join(SYSTEMS), "comma-separated systems")
    plot: Path | None = flag(None, "where to write the plot (PNG)", metavar="PATH")


def _run(f: Flags) -> Outcome:
    custom = plan(_ints(f.sessions, "sessions", empty=True),
                  _ints(f.screens, "screens", empty=True), f.fan_sessions,
                  f.rate, f.seconds)  # fmt: skip
    systems = tuple(s.strip() for s in f.systems.split(",") if s.strip())
    cfg = Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, systems=systems,
                 custom=custom, llm_storm_rate=f.rate)  # fmt: skip
    masters = _ints(f.masters, "masters", empty=True)
    if not custom and not masters:
        raise SystemExit("pathscale: every sweep is empty (--sessions, --screens, --masters)")
    if masters and f.redis:
        raise SystemExit("pathscale: the masters sweep starts its own clusters (--masters '')")
    res = asyncio.run(run(cfg, f.redis)) if custom else None
    for m in masters:
        one = Phase(
            f"masters_{m}",
            f.masters_sessions,
            1,
            round(mean_rate(f.masters_sessions, f.rate)),
            f.seconds,
            "llm",
            f.rate,
        )
        more = asyncio.run(run(replace(cfg, custom=(one,), masters=m)))
        res = _merge(res, more, m)
    assert res is not None
    text = report(res)
    if f.plot is not None:
        res["png"] = plot(res, f.plot)
        text += "\n" + res["png"]
    return Outcome(res, text, 0)


BENCH = Harness(
    Flags,
    _run,
    uvloop=True,
    prog="python -m bench.peers.pathscale",
    description=__doc__,
    quick_help="3 sessions and 3 screen counts, 2 master counts, 1 round of 3 s each",
    markdown=report,
)
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
