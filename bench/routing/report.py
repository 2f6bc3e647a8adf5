"""The routing simulator's results as the Markdown tables docs/ROUTING.md quotes.

What it is for: every figure in the docs comes from a command's output, never from a
hand edit. ``python -m bench.routing.sim`` prints :func:`markdown` after its plain table;
the docs paste it. Per workload: goodput by load (mean of the seeds, min-max), one table
per load with every metric, each policy's TTFT p99 seed by seed with how many seeds
put it below sticky sessions', and for the trace the default policy against the aims
(goodput against the best other policy, sticky sessions and round robin; hit rate
against sticky sessions').
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["markdown"]

_COLS: Final = (
    ("goodput req/s", "goodput_rps", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:,.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:,.0f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:,.0f}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("preemptions", "preemptions", "{:,.0f}"),
    ("rejected", "rejected", "{:,.0f}"),
    ("max/mean load", "max_mean_load", "{:.2f}"),
)
_AIM_LEVELS: Final = ("native", "0.5", "0.75", "1.0")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _goodput(res: dict[str, Any], w: dict[str, Any]) -> list[str]:
    levels = list(w["levels"])
    out = [
        _row(["policy", *(f"goodput at {lv}" for lv in levels)]),
        _row(["---"] * (len(levels) + 1)),
    ]
    for pol in w["levels"][levels[0]]:
        cells = [pol]
        for lv in levels:
            r = w["levels"][lv][pol]
            lo, hi = r["spread"]["goodput_rps"]
            cells.append(f"{r['goodput_rps']:.2f} ({lo:.2f}–{hi:.2f})")
        out.append(_row(cells))
    return out


def _level(rows: dict[str, Any], seeds: list[int]) -> list[str]:
    out = [_row(["policy", *(c[0] for c in _COLS)]), _row(["---"] * (len(_COLS) + 1))]
    for pol, r in rows.items():
        out.append(_row([pol, *(fmt.format(r[key]) for _, key, fmt in _COLS)]))
    if len(seeds) > 1 and all("by_seed" in r for r in rows.values()):
        out += ["", f"TTFT p99 ms by seed ({', '.join(map(str, seeds))}):", ""]
        out += [_row(["policy", *map(str, seeds)]), _row(["---"] * (len(seeds) + 1))]
        for pol, r in rows.items():
            out.append(_row([pol, *(f"{x:,.0f}" for x in r["by_seed"]["ttft_p99_ms"])]))
        caps = next(iter(rows.values()))["by_seed"].get("cap")
        if caps:
            out += ["", f"KV-derived cap per engine by seed: {', '.join(map(str, caps))}; most "
                    "requests on one engine at once (mean of seeds): "
                    + ", ".join(f"{pol} {sum(r['by_seed']['peak_load']) / len(seeds):,.0f}"
                                for pol, r in rows.items())]  # fmt: skip
        sticky = rows.get("sticky_session")
        if sticky is not None:
            theirs = sticky["by_seed"]["ttft_p99_ms"]
            below = []
            for pol, r in rows.items():
                ours = r["by_seed"]["ttft_p99_ms"]
                if pol != "sticky_session":
                    below.append(f"{pol} {sum(a < b for a, b in zip(ours, theirs, strict=True))}")
            out += ["", f"seeds (of {len(seeds)}) with TTFT p99 below sticky_session's: "
                    + ", ".join(below)]  # fmt: skip
    return out


def _aims(res: dict[str, Any], w: dict[str, Any]) -> list[str]:
    default = res["default_policy"]
    levels = [lv for lv in _AIM_LEVELS if lv in w["levels"]]
    rows = [w["levels"][lv] for lv in levels]
    if not levels or any(default not in r for r in rows):
        return []

    def ratio(num: float, den: float) -> str:
        return f"{num / den:.2f} x" if den else "-"

    def best_other(r: dict[str, Any]) -> float:
        return max((v["goodput_rps"] for p, v in r.items() if p != default), default=0.0)

    out = [_row([f"{default} against", *levels]), _row(["---"] * (len(levels) + 1))]
    out.append(_row(["goodput / best other policy's",
                     *(ratio(r[default]["goodput_rps"], best_other(r))
                       for r in rows)]))  # fmt: skip
    for other in ("sticky_session", "round_robin"):
        if all(other in r for r in rows):
            out.append(_row([f"goodput / {other}'s",
                             *(ratio(r[default]["goodput_rps"], r[other]["goodput_rps"])
                               for r in rows)]))  # fmt: skip
    if all("sticky_session" in r for r in rows):
        out.append(_row(["hit rate / sticky_session's",
                         *(ratio(r[default]["hit_rate"], r["sticky_session"]["hit_rate"])
                           for r in rows)]))  # fmt: skip
    return out


def markdown(res: dict[str, Any]) -> str:
    """Every table of one :func:`bench.routing.sim.run_all` result, in Markdown."""
    lines: list[str] = []
    seeds = list(res["seeds"])
    for kind, w in res["workloads"].items():
        lines += [f"### {kind}: goodput (req/s, mean of seeds {seeds}, min–max)", ""]
        lines += _goodput(res, w)
        for level, rows in w["levels"].items():
            lines += ["", f"{kind}, load {level}:", ""]
            lines += _level(rows, seeds)
        if kind == "trace" and (aims := _aims(res, w)):
            lines += ["", f"{kind}: the default ({res['default_policy']}) against the aims:", ""]
            lines += aims
        lines.append("")
    return "\n".join(lines)
