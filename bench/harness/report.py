"""One report writer for every benchmark: the JSON result with the run's settings, seed,
machine and git commit; the text table; the Markdown table that bench/README.md's tables
are pasted from (never edited by hand).

Order of use: ``write_result(path, result, flags, bench=...)`` (:class:`~bench.harness.
flags.Bench` calls it for ``--json``); ``text_table(head, rows)`` and
``markdown_table(head, rows)`` for what a run prints; ``read_result(path)`` for a
``--report PATH`` that prints a stored run's Markdown table again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RUN_KEY", "cell", "logger", "markdown_table", "progress", "read_result", "run_info",
           "text_table", "write_result"]  # fmt: skip

RUN_KEY = "run"  # the key of the run's settings in every JSON result
ROOT = Path(__file__).resolve().parents[2]


def _out(argv: list[str]) -> str:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def _commit() -> str | None:
    """The checkout's commit, ``+dirty`` when it has uncommitted changes; None outside git."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = _out([*git, "rev-parse", "HEAD"])
        dirty = _out([*git, "status", "--porcelain", "--untracked-files=no"])
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _loadavg() -> list[str] | None:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_info(flags: Any, bench: str) -> dict[str, Any]:
    """The run's settings (every flag's value), seed, machine and git commit."""
    settings = {f.name: _plain(getattr(flags, f.name)) for f in dataclasses.fields(flags)}
    return {
        "bench": bench,
        "argv": sys.argv[1:],
        "settings": settings,
        "seed": settings.get("seed"),
        "quick": settings.get("quick"),
        "machine": {
            "cpus": os.cpu_count(),
            "arch": platform.machine(),
            "system": platform.system(),
            "python": platform.python_version(),
            "loadavg_end": _loadavg(),
        },
        "commit": _commit(),
    }


def write_result(path: str | Path, result: dict[str, Any], flags: Any, *, bench: str) -> None:
    """``result`` as indented JSON at ``path`` (its folder made), with :func:`run_info`
    under :data:`RUN_KEY` (a result that has that key keeps its own)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = result if RUN_KEY in result else {**result, RUN_KEY: run_info(flags, bench)}
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def read_result(path: str | Path) -> dict[str, Any]:
    """A stored result (``--json``), for ``--report``. ``ValueError`` when it is not one."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a benchmark's JSON result")
    return doc


def logger(name: str) -> Callable[[str], None]:
    """A run's progress lines on stderr, ``[name HH:MM:SS] message``."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def progress(started: float, msg: str) -> None:
    """A progress line on stderr, ``[  12.3s] message``: seconds since ``started``
    (``time.monotonic()``)."""
    print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)


def cell(value: Any, none: str = "-", digits: int = 2, grouped: bool = True) -> str:
    """A table cell: thousands separated, floats to ``digits`` places (``grouped``: with
    the separator too), None as ``none``."""
    if value is None:
        return none
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if grouped else f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (cells already formatted, or through :func:`cell`)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else cell(c) for c in r) + " |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def text_table(head: Sequence[str], rows: Iterable[Sequence[Any]], first_left: bool = True) -> str:
    """A plain text table, columns right-aligned to their widest cell (the first one left)."""
    body = [[c if isinstance(c, str) else cell(c) for c in r] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{c:<{w}}" if i == 0 and first_left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return "\n".join([line(list(head)), *(line(r) for r in body)])
