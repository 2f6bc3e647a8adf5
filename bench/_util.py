"""Helpers every benchmark shares: percentiles, a process's CPU and memory
from ``/proc``, the open-file limit, and (from :mod:`devstack.procs`) free ports and the
process launcher.

Pure except the ``/proc`` and file readers, which say so. Order of use: any, e.g.
``percentile(samples, 0.99)``, ``cpu_s(pid)``. A result's JSON: :mod:`bench.harness.report`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from devstack.procs import Proc, ProcError, free_port

__all__ = [
    "cpu_s",
    "free_port",
    "ns_ms",
    "percentile",
    "raise_nofile",
    "rss_kb",
    "run_json",
    "self_cpu_s",
]


@overload
def percentile(values: Sequence[float], q: float) -> float | None: ...
@overload
def percentile(values: Sequence[float], q: float, default: float) -> float: ...
def percentile(values: Sequence[float], q: float, default: float | None = None) -> float | None:
    """Nearest-rank ``q``-quantile (``q`` in 0..1: 0.5 median, 0.99 p99) of ``values``
    (sorted here; any order); ``default`` when there are none."""
    if not values:
        return default
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ns_ms(value: float | None, digits: int = 3) -> float | None:
    """Nanoseconds as milliseconds, rounded; None stays None."""
    return None if value is None else round(value / 1e6, digits)


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (or another ``/proc/<pid>/status`` field) in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    """CPU seconds this process has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def raise_nofile(need: int) -> int:
    """Raise the soft open-file limit towards ``need`` (up to the hard limit); the new
    soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def run_json(
    argv: Sequence[str], spec: Any, *, name: str, timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run a child that takes a JSON spec file (its path appended to ``argv``) and prints
    its result as the last line of JSON; that result. :class:`ProcError` (with the
    child's last lines) when it fails or outlives ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="bench-child-") as tmp:
        spec_path, log = Path(tmp) / "spec.json", Path(tmp) / "child.log"
        spec_path.write_text(json.dumps(spec))
        proc = Proc.start([*argv, str(spec_path)], log=log, name=name, env=env)
        try:
            code = await proc.wait(timeout_s)
        finally:
            await proc.stop()
        if code != 0:
            raise ProcError(proc.why())
        res: dict[str, Any] = json.loads(log.read_text().strip().splitlines()[-1])
    return res
