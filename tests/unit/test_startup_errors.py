"""Start-up failures read as one line, never a traceback, with exit code 2: bad flags,
bad environment values, unsafe configurations, a port another program holds. Each case
runs the real ``tokenrelay`` command in a child process (which exits by itself; on a
timeout ``run_cli`` stops that child by its pid)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.support.cli import Ran, clean_env, run_cli
from tests.support.cli import tokenrelay as argv_of

K = "startup-test-secret-3b8e1f6a9c2d5e7f0a4b"  # strong: >= 32 bytes, varied


async def tokenrelay(*argv: str, env: dict[str, str] | None = None) -> Ran:
    return await run_cli(argv_of(*argv), env=env or clean_env(), timeout_s=60)


def assert_one_line(r: Ran, *words: str) -> None:
    assert r.code == 2, r.err
    assert r.err.count("\n") == 1, r.err
    assert r.err.startswith("error: "), r.err
    assert "Traceback" not in r.err + r.out
    for w in words:
        assert w in r.err, r.err


@pytest.fixture
def occupied() -> Iterator[int]:
    """A port held by another program: a listening socket of this test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


WORKER = ["worker", "--port", "0", "--redis", "redis://127.0.0.1:1",
          "--engine", "http://127.0.0.1:9"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["relay", "--port", "eighty"], {}, ["--port", "invalid int value"]),
        (["relay", "--no-such-flag"], {}, ["--no-such-flag"]),
        (["relay"], {}, ["no token secret", "--insecure-no-auth"]),
        (["relay", "--insecure-no-auth"], {"TOKENRELAY_SECRET": K}, ["choose one"]),
        (["relay"], {"TOKENRELAY_SECRET": "too-short"}, ["at least 32"]),
        (["relay", "--insecure-no-auth"], {"TOKENRELAY_PORT": "x"}, ["TOKENRELAY_PORT='x'"]),
        (["relay", "--insecure-no-auth", "--queue-frames", "0"], {}, ["--queue-frames"]),
        (WORKER, {}, ["no token secret"]),  # the relay's rule: no silent auth-off
        (
            WORKER,
            {"TOKENRELAY_SECRET": K, "TOKENRELAY_FAIL_FAST": "maybe"},
            ["TOKENRELAY_FAIL_FAST"],
        ),
        (["worker", "--insecure-no-auth", "--engine", "http://127.0.0.1:9"], {}, ["give --port"]),
        (["engine", "--port", "0", "--reply-max-tokens", "0"], {}, ["--reply-max-tokens"]),
        (["jobworker", "--redis", "redis://127.0.0.1:1"], {}, ["--amqp"]),
        (["demo", "--relays", "0"], {}, ["--relays (TOKENRELAY_DEMO_RELAYS)"]),
        (["demo"], {"TOKENRELAY_SECRET": "too-short"}, ["at least 32"]),
    ],
)
async def test_bad_configuration_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], words: list[str]
) -> None:
    assert_one_line(await tokenrelay(*argv, env=clean_env(**env)), *words)


async def test_fail_fast_is_a_flag_of_relay_and_worker() -> None:
    for cmd in ("relay", "worker"):
        r = await tokenrelay(cmd, "--help")
        assert r.code == 0
        assert "--fail-fast" in r.out
        assert "TOKENRELAY_FAIL_FAST" in r.out


async def test_demo_names_the_busy_port_and_a_free_one(occupied: int) -> None:
    r = await tokenrelay("demo", "--port", str(occupied))
    assert_one_line(r, f"port {occupied} on 127.0.0.1 is in use", "--port ")
    assert "Unclosed" not in r.err + r.out
    suggested = int(r.err.split("e.g. --port ", 1)[1].split()[0])
    assert suggested != occupied
    with socket.socket() as s:  # the suggestion is free indeed
        s.bind(("127.0.0.1", suggested))


async def test_demo_port_from_the_environment_is_checked_the_same(occupied: int) -> None:
    r = await tokenrelay("demo", env=clean_env(TOKENRELAY_DEMO_PORT=str(occupied)))
    assert_one_line(r, f"port {occupied} on 127.0.0.1 is in use")


async def test_an_engine_on_a_busy_port_says_so_in_one_line(occupied: int) -> None:
    r = await tokenrelay("engine", "--port", str(occupied))
    assert_one_line(r, f"port {occupied} on 127.0.0.1 is in use", "--port N")
