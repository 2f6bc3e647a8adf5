"""The markdown table of a :mod:`bench.peers.durable` result (``--report PATH`` prints it;
the docs paste what it prints). Pure: a result dict in, text out.

One row per system; CPU figures in µs: ``srv`` the server processes, ``redis`` every
Redis node, ``sum`` both (the reference server has no Redis: its ``redis`` is 0).
"""

from __future__ import annotations

from typing import Any

__all__ = ["table"]

HEAD = (
    "system", "appends/s", "µs/append srv+redis=sum", "catch-up MB/s",
    "SSE µs/msg srv+redis=sum", "SSE p50/p99 ms",
    "long-poll µs/msg srv+redis=sum", "long-poll p50/p99 ms",
)  # fmt: skip


def _cpu(r: dict[str, Any]) -> str:
    return f"{r['server_us']:.1f} + {r['redis_us']:.1f} = {r['total_us']:.1f}"


def _lat(r: dict[str, Any]) -> str:
    return f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"


def table(res: dict[str, Any]) -> str:
    """The result's markdown table, with the load and the run it came from under it."""
    ph = res["phases"]
    rows = [HEAD, tuple("---" for _ in HEAD)]
    for name in res["config"]["systems"]:
        a, c, s, lp = (ph[p][name] for p in ("append", "catchup", "sse", "longpoll"))
        rows.append((
            name, f"{a['appends_per_s']:,.0f}", _cpu(a), f"{c['mb_per_s']:,.1f}",
            _cpu(s), _lat(s), _cpu(lp), _lat(lp),
        ))  # fmt: skip
    cfg = res["config"]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lost = sum(ph[p][n].get("lost", 0) for p in ("sse", "longpoll") for n in cfg["systems"])
    lines.append("")
    lines.append(
        f"{cfg['repeats']} round(s) of {cfg['seconds']:g} s per phase, medians; "
        f"append: {cfg['append_conc']} in flight over {cfg['append_streams']} streams; "
        f"catch-up: {cfg['catchup_readers']} readers of a {cfg['catchup_mb']:g} MB stream; "
        f"live: {cfg['streams']} streams x {cfg['readers']} readers, "
        f"{cfg['rate']:g} appends/s; {lost} acknowledged messages not delivered within the "
        f"round's drain; {res['cpus']} CPUs, load "
        f"{' '.join(res['loadavg_start'])} at the start; reference server "
        f"{res['versions'].get('@durable-streams/server')}."
    )
    return "\n".join(lines)
