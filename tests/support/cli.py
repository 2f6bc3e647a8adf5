"""A command a test runs to completion: its exit code, what it printed, what it
complained about. Started and stopped with :mod:`devstack.procs` (output to files, never
a pipe), so the event loop keeps serving while it runs (a front door in this process can
answer the command's requests) and a command that outlives its timeout is stopped by pid.

Order of use::

    ran = await run_cli([sys.executable, "-m", "tokenrelay", "relay", "--bad"], timeout_s=30)
    assert ran.code == 2 and ran.err.count("\\n") == 1   # ran.out: its stdout

With ``merge=True`` stdout and stderr are one stream, in ``ran.out`` (``ran.err`` is "").
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devstack.procs import Proc, ProcError

__all__ = ["Ran", "bench", "clean_env", "devstack", "run_cli", "tokenrelay"]


@dataclass(frozen=True)
class Ran:
    """A finished command: exit code (negative: the signal that ended it), stdout, stderr."""

    code: int
    out: str
    err: str


def tokenrelay(*args: str) -> list[str]:
    """The argv of ``tokenrelay ARGS`` run by this interpreter (so on this checkout)."""
    return [sys.executable, "-m", "tokenrelay", *args]


def devstack(*args: str) -> list[str]:
    """The argv of ``python -m devstack ARGS`` (demo, cluster, engine: not in the wheel;
    :class:`~devstack.procs.Proc` puts this checkout on the child's path)."""
    return [sys.executable, "-m", "devstack", *args]


def bench(*args: str) -> list[str]:
    """The argv of ``python -m bench ARGS`` (from this checkout, as :func:`devstack`)."""
    return [sys.executable, "-m", "bench", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``TOKENRELAY_*`` setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    return {**env, **extra}


async def run_cli(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 60.0,
    merge: bool = False,
) -> Ran:
    """Run ``argv`` until it exits; :class:`~devstack.procs.ProcError` (after stopping it
    by pid) if it still runs after ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="run-cli-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        proc = Proc.start(argv, log=out, err_log=None if merge else err, env=env, cwd=cwd)
        try:
            code = await proc.wait(timeout_s)
            if code is None:
                raise ProcError(f"{proc.name} still running after {timeout_s:g} s: {proc.why()}")
        finally:
            if proc.alive:
                await proc.stop(grace_s=5)
        return Ran(code, proc.output(), proc.output(stderr=True))
