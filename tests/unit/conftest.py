"""tests/unit holds pure tests only: no process, no socket (no server, no Redis), no real
sleep, so that ``make test-fast`` runs it in seconds and a failure here is a rule that
broke, never a slow machine.

The guard (autouse, for every test of this folder) makes each of those fail the test at
once with what it did and where such a test goes instead: starting a process
(``subprocess``, ``asyncio``'s subprocesses, ``os.fork``/``posix_spawn``/``system``),
listening on or connecting a socket (every server and client, Redis included), and
sleeping for a positive time (``time.sleep``, ``asyncio.sleep``; ``asyncio.sleep(0)``,
a yield to the loop, is allowed). A test that needs one of them belongs in
``tests/cli`` (a command run as a child process) or ``tests/integration`` (servers,
sockets, Redis, time passing).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import pytest

__all__ = ["Impure"]

T = TypeVar("T")
WHERE = "tests/cli (a command in a process) or tests/integration (servers, Redis, time)"


class Impure(AssertionError):
    """A test of tests/unit did what only a test of another folder may do."""


def _impure(what: str) -> Impure:
    return Impure(f"tests/unit holds pure tests: this test {what}; move it to {WHERE}")


def _refuse(what: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise _impure(what)

    return refuse


_real_sleep = time.sleep
_real_asleep = asyncio.sleep


def _sleep(seconds: float) -> None:
    if seconds > 0:
        raise _impure(f"sleeps {seconds:g} s (time.sleep)")
    _real_sleep(seconds)


async def _asleep(delay: float, result: T | None = None) -> T | None:
    if delay > 0:
        raise _impure(f"sleeps {delay:g} s (asyncio.sleep)")
    return await _real_asleep(0, result)


@pytest.fixture(autouse=True)
def _pure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here: a process, a socket or a real sleep fails it (see above)."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("starts a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"starts a process (os.{name})"))
    monkeypatch.setattr(socket.socket, "listen", _refuse("listens on a socket (a server)"))
    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _refuse("connects a socket (a client)"))
    monkeypatch.setattr(time, "sleep", _sleep)
    monkeypatch.setattr(asyncio, "sleep", _asleep)
