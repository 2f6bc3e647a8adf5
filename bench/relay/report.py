"""Runs of :mod:`bench.relay.throughput` side by side, as one Markdown table.

``python -m bench.relay.report LABEL=PATH [LABEL=PATH ...]`` reads each run's ``--json``
and prints a row per headline figure that any of them measured: the figure, its target,
each run's value (``n/a`` where a run did not measure it, an older run for instance) and
whether the last run meets the target. It is how the before/after tables of
bench/README.md are made: pasted from this output, never edited by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.harness.report import markdown_table
from bench.relay.throughput import TARGETS

__all__ = ["FIGURES", "main", "table"]

# the headline figures, in the order of bench.relay.throughput's own summary
FIGURES = (
    "raw_msgs_per_s",
    "raw_hiredis_msgs_per_s",
    "relay_frames_per_s",
    "ratio",
    "ratio_hiredis",
    "bare_frames_per_s",
    "bare_ratio_hiredis",
    "relay_cpu_us_per_frame",
    "bare_cpu_us_per_frame",
    "relay_cpu_vs_bare",
    "fanout10_writes_per_s",
    "fanout_vs_raw",
    "fanout10_writes_per_relay_cpu_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_5k_p50_ms",
    "latency_5k_p99_ms",
    "bare_latency_5k_p50_ms",
    "bare_latency_5k_p99_ms",
    "loop_max_turn_ms_5k",
    "loop_max_turn_ms_20k",
    "rss_kb_per_idle_conn",
    "rss_kb_per_idle_ws_conn",
    "replay_frames_per_s",
    "replay_rss_peak_mb",
)


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and v >= 1000:
        return f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The Markdown table of ``runs`` (label, result JSON), in the order given."""
    last = runs[-1][1]
    met = last.get("targets_met", {})
    head = ["figure", "target", *(label for label, _ in runs), "met (last)?"]
    rows = []
    for key in FIGURES:
        values = [res.get(key) for _, res in runs]
        if all(v is None for v in values):
            continue
        ok = "" if key not in met else ("yes" if met[key] else "no")
        rows.append([f"`{key}`", TARGETS.get(key, ""), *(_cell(v) for v in values), ok])
    return markdown_table(head, rows)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    runs: list[tuple[str, dict[str, Any]]] = []
    for arg in args:
        label, sep, path = arg.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"expected LABEL=PATH, got {arg!r}")
        try:
            runs.append((label, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"{path}: {exc}") from None
    if not runs:
        raise SystemExit("usage: python -m bench.relay.report LABEL=PATH [LABEL=PATH ...]")
    print(table(runs))


if __name__ == "__main__":
    main()
