"""The guard of tests/unit (its conftest.py) refuses what a pure test may not do, and
lets a yield to the loop through."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from tests.unit.conftest import Impure


def test_a_process_is_refused() -> None:
    with pytest.raises(Impure, match="starts a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


async def test_an_asyncio_subprocess_is_refused() -> None:
    with pytest.raises(Impure, match="starts a process"):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


def test_a_server_and_a_client_socket_are_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # binding alone opens nothing
        with pytest.raises(Impure, match="listens"):
            s.listen()
    with socket.socket() as c, pytest.raises(Impure, match="connects"):
        c.connect(("127.0.0.1", 9))


def test_a_real_sleep_is_refused() -> None:
    with pytest.raises(Impure, match="sleeps"):
        time.sleep(0.001)


async def test_a_real_asyncio_sleep_is_refused_and_a_yield_is_not() -> None:
    with pytest.raises(Impure, match="sleeps"):
        await asyncio.sleep(0.001)
    assert await asyncio.sleep(0, "yielded") == "yielded"
