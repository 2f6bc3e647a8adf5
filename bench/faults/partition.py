"""A network partition on loopback: drop every packet to and from one local TCP port.

For the ``partition`` fault drill (:mod:`bench.faults.drills`): a Redis master's client port
stops answering in both directions while the process itself runs on (its cluster bus,
on port + 10000, is untouched, so the cluster does not fail over). Needs root and a
working ``iptables`` (``make test`` installs Debian's as it installs Chromium);
:func:`unsupported` says why not otherwise, and the drill then fails with that reason
unless it was asked to be skipped. Only loopback traffic is matched (``-i lo``,
127.0.0.1).

Order of use::

    reason = unsupported()          # None: usable
    with dropped(port):             # rules inserted
        ...                         # rules removed on exit, whatever happened
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["dropped", "rules", "unsupported"]


def rules(port: int) -> list[list[str]]:
    """The rule specs (without the -I/-D verb): packets to the port and from it, on the
    loopback interface only. Both go through INPUT on loopback, so two rules cover both
    directions."""
    base = ["INPUT", "-i", "lo", "-s", "127.0.0.1", "-d", "127.0.0.1", "-p", "tcp"]
    return [[*base, flag, str(port), "-j", "DROP"] for flag in ("--dport", "--sport")]


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, timeout=10)


def unsupported() -> str | None:
    """None where a partition can be made here, else the reason (one sentence)."""
    if os.geteuid() != 0:
        return "needs root (iptables)"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables; make test does it as root)"
    try:
        probe = _iptables("-S", "INPUT")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables does not run: {exc}"
    if probe.returncode != 0:
        return f"iptables does not work here: {probe.stderr.strip()[:200]}"
    return None


@contextlib.contextmanager
def dropped(port: int) -> Iterator[None]:
    """Drop all loopback TCP packets to and from ``port`` inside the block."""
    if not 1 <= port <= 65535:
        raise ValueError(f"bad port {port}")
    added: list[list[str]] = []
    try:
        for spec in rules(port):
            res = _iptables("-I", *spec)
            if res.returncode != 0:
                raise RuntimeError(f"iptables -I failed: {res.stderr.strip()[:200]}")
            added.append(spec)
        yield
    finally:
        for spec in reversed(added):
            _iptables("-D", *spec)
