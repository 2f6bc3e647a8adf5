"""Start-up failures read as one line, never a traceback, with exit code 2: bad flags,
bad environment values, unsafe configurations, a port another program holds. Each case
runs the real command in a child process (which exits by itself; on a timeout
``run_cli`` stops that child by its pid): ``tokenrelay`` for the product's subcommands,
``python -m devstack`` for the development stack's (demo, cluster, engine) and
``python -m bench`` for the benchmarks'."""

from __future__ import annotations

import argparse
import random
import socket
from collections.abc import Iterator

import pytest

from devstack.cli import build_parser as devstack_parser
from tests.support.cli import Ran, bench, clean_env, devstack, run_cli
from tests.support.cli import tokenrelay as product

K = "startup-test-secret-3b8e1f6a9c2d5e7f0a4b"  # strong: >= 32 bytes, varied


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


DEVSTACK = _subcommands(devstack_parser())  # demo, cluster, engine, llama


def argv_of(*argv: str) -> list[str]:
    """``argv`` of the program its first word belongs to: ``python -m devstack`` (the
    development stack's commands), ``python -m bench`` (``bench NAME ...``), else
    ``tokenrelay``."""
    if argv[0] in DEVSTACK:
        return devstack(*argv)
    if argv[0] == "bench":
        return bench(*argv[1:])
    return product(*argv)


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
    """A port held by another program: a listening socket of this test, below 55536 (a
    cluster node's bus port is its port + 10000)."""
    for port in random.sample(range(20000, 55000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            s.listen()
            yield port
            return
    raise RuntimeError("no free port in 20000..55000")


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
        (["demo", "--log-dir", "/dev/null/logs"], {}, ["--log-dir /dev/null/logs", "cannot make"]),
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


# -- every subcommand, every common mistake ----------------------------------------------
#
# For each subcommand of pyproject.toml's entry-point group, of ``python -m devstack`` and
# for ``python -m bench`` (its load test: the benchmark that takes a stack's URLs), what
# each mistake is for it:
# an argv (``{port}``: a port held by another program, ``{dir}``: an empty folder), the
# environment and the words its one line must hold; or, where the mistake cannot be made
# with that subcommand, why not. A new subcommand fails the test until it has a row.

BAD_URL = "redis://bad:host:x"  # a port that is no number
DOWN = "redis://127.0.0.1:1"  # nothing listens there
ENGINE = ["--engine", "http://127.0.0.1:9"]
AMQP = ["--amqp", "amqp://guest:guest@127.0.0.1:1/"]
STACK = ["--relay", "http://127.0.0.1:1", "--worker", "http://127.0.0.1:1"]
SECRET = {"TOKENRELAY_SECRET": K}
BUSY = "is in use by another program"
NO_PORT = "has no valid port"
UNREACHABLE = "cannot connect to Redis at redis://127.0.0.1:1"

Case = tuple[list[str], dict[str, str], list[str]] | str
MISTAKES: dict[str, dict[str, Case]] = {
    "relay": {
        "busy port": (["relay", "--port", "{port}", "--redis", DOWN], SECRET, [BUSY, "--port N"]),
        "bad Redis URL": (["relay", "--port", "0", "--redis", BAD_URL], SECRET, [NO_PORT]),
        "Redis down": (["relay", "--port", "0", "--redis", DOWN, "--fail-fast"], SECRET,
                       [UNREACHABLE]),
        "no secret": (["relay", "--port", "0", "--redis", DOWN], {}, ["no token secret"]),
    },
    "worker": {
        "busy port": (["worker", "--port", "{port}", "--redis", DOWN, *ENGINE], SECRET, [BUSY]),
        "bad Redis URL": (["worker", "--port", "0", "--redis", BAD_URL, *ENGINE], SECRET,
                          [NO_PORT]),
        "Redis down": (["worker", "--port", "0", "--redis", DOWN, *ENGINE, "--fail-fast"],
                       SECRET, [UNREACHABLE]),
        "no secret": (["worker", "--port", "0", "--redis", DOWN, *ENGINE], {},
                      ["no token secret"]),
    },
    "engine": {
        "busy port": (["engine", "--port", "{port}"], {}, [BUSY]),
        "bad Redis URL": (["engine", "--port", "7", "--redis", BAD_URL], {}, [NO_PORT]),
        "Redis down": "an engine serves without Redis: its announcement retries meanwhile",
        "no secret": "an engine checks no token",
    },
    "llama": {
        "busy port": "it builds and fetches files: it listens on no port",
        "bad Redis URL": "it builds and fetches files: it takes no Redis URL",
        "Redis down": "it builds and fetches files: it takes no Redis URL",
        "no secret": "it builds and fetches files: it checks no token",
    },
    "demo": {
        "busy port": (["demo", "--port", "{port}"], {}, [BUSY, "e.g. --port"]),
        "bad Redis URL": "the demo starts its own cluster: it takes no Redis URL",
        "Redis down": "the demo starts its own cluster: it takes no Redis URL",
        "no secret": (["demo"], {"TOKENRELAY_SECRET": "too-short"}, ["at least 32"]),
    },
    "jobworker": {
        "busy port": "a job worker listens on no port",
        "bad Redis URL": (["jobworker", "--redis", BAD_URL, *AMQP, *ENGINE], {}, [NO_PORT]),
        "Redis down": (["jobworker", "--redis", DOWN, *AMQP, *ENGINE], {}, [UNREACHABLE]),
        "no secret": "a job worker mints and checks no token",
    },
    "cluster": {
        "busy port": (["cluster", "up", "--port", "{port}", "--dir", "{dir}"], {},
                      ["is busy", "another --port"]),
        "bad Redis URL": "cluster up starts its own nodes: it takes no Redis URL",
        "Redis down": (["cluster", "status", "--dir", "{dir}"], {}, ["no cluster state"]),
        "no secret": "a cluster takes no token secret",
    },
    "bench": {
        "busy port": "each benchmark listens on free ports it picks",
        "bad Redis URL": (["bench", "loadtest", *STACK, "--redis", BAD_URL], {}, [NO_PORT]),
        "Redis down": (["bench", "loadtest", "--quick", "--no-progress", *STACK, "--redis", DOWN],
                       {}, ["cannot reach"]),
        "no secret": "a benchmark's stack gets a random secret of its own",
    },
    "capacity": {
        "busy port": "it listens on no port: arithmetic on measured costs",
        "bad Redis URL": "it reads no Redis",
        "Redis down": "it reads no Redis",
        "no secret": "it serves nothing",
    },
}  # fmt: skip
MISTAKE_NAMES = ("busy port", "bad Redis URL", "Redis down", "no secret")


def test_every_subcommand_has_a_row_for_every_mistake() -> None:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    group = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["tokenrelay.commands"]
    assert sorted(MISTAKES) == sorted([*group, *DEVSTACK, "bench"])
    for name, row in MISTAKES.items():
        assert sorted(row) == sorted(MISTAKE_NAMES), name


@pytest.mark.parametrize(
    ("command", "mistake"),
    [(c, m) for c, row in MISTAKES.items() for m, case in row.items() if not isinstance(case, str)],
)
async def test_each_subcommand_says_each_mistake_in_one_line(
    command: str, mistake: str, occupied: int, tmp_path: object
) -> None:
    case = MISTAKES[command][mistake]
    assert not isinstance(case, str)
    argv, env, words = case
    argv = [a.format(port=occupied, dir=tmp_path) for a in argv]
    r = await tokenrelay(*argv, env=clean_env(**env))
    assert r.code != 0, (argv, r.out, r.err)
    assert r.err.count("\n") == 1, (argv, r.err)
    assert r.err.startswith("error: "), (argv, r.err)
    assert "Traceback" not in r.err + r.out, argv
    for w in words:
        assert w.format(port=occupied) in r.err, (argv, r.err)
