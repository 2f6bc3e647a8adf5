"""A RabbitMQ broker of this run's own: ``epmd`` and ``rabbitmq-server`` (Debian's
package) on free loopback ports, with their data, logs and Erlang cookie in a folder of
their own, stopped by pid.

The offline-jobs tests and the RabbitMQ benchmark need a broker. They never use one that
happens to run on the host (another run's, or a user's on 5672): ``make test`` starts
this one around the whole suite and passes its URL to every pytest worker in
``TOKENRELAY_TEST_AMQP``; a test run without it starts one per process (the ``amqp``
fixture of tests/conftest.py), or skips with the reason where ``rabbitmq-server`` is not
installed.

Why its own ``epmd``: the Erlang port mapper a broker needs would otherwise be started
as a daemon on 4369 and outlive the run. Here it runs in the foreground on a free port
(``ERL_EPMD_PORT``) as a child like the broker, and both are stopped by their pids
(the broker's start script stops the Erlang VM on SIGTERM and waits for it).

Order of use::

    async with local_rabbit(workdir) as url:    # amqp://guest:guest@127.0.0.1:PORT/
        ...
    python -m devstack.rabbit -- CMD ARGS       # CMD with TOKENRELAY_TEST_AMQP set
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from devstack.procs import HOST, Proc, ProcError, free_port, log_line, port_open

__all__ = ["AMQP_ENV", "RabbitMissing", "find_rabbit", "local_rabbit", "main"]

AMQP_ENV = "TOKENRELAY_TEST_AMQP"
SERVER_CANDIDATES = ("/usr/lib/rabbitmq/bin/rabbitmq-server",)
START_TIMEOUT_S = 90.0


class RabbitMissing(RuntimeError):
    """``rabbitmq-server`` or ``epmd`` is not installed; the message says what to install."""


def find_rabbit() -> tuple[str, str]:
    """The broker's start script and ``epmd``, or :class:`RabbitMissing`."""
    server = next((p for p in SERVER_CANDIDATES if os.access(p, os.X_OK)), None)
    server = server or shutil.which("rabbitmq-server")
    epmd = shutil.which("epmd")
    if server is None or epmd is None:
        raise RabbitMissing(
            "no rabbitmq-server installed (Debian/Ubuntu: `apt-get install rabbitmq-server`; "
            "`make test` installs it as root)"
        )
    return server, epmd


def _write_config(workdir: Path, amqp_port: int) -> None:
    """No plugins; AMQP on loopback only (where the default guest user may log in)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "enabled_plugins").write_text("[].\n")
    (workdir / "rabbitmq.conf").write_text(f"listeners.tcp.1 = {HOST}:{amqp_port}\n")


@contextlib.asynccontextmanager
async def local_rabbit(workdir: Path) -> AsyncIterator[str]:
    """Start a broker under ``workdir`` (created); its AMQP URL while it runs."""
    server, epmd_bin = find_rabbit()
    epmd_port, amqp_port, dist_port = free_port(), free_port(), free_port()
    _write_config(workdir, amqp_port)
    env = {
        **os.environ,
        "HOME": str(workdir),  # the Erlang cookie
        "ERL_EPMD_PORT": str(epmd_port),
        "RABBITMQ_NODENAME": f"tokenrelay-{os.getpid()}-{amqp_port}@localhost",
        "RABBITMQ_NODE_IP_ADDRESS": HOST,
        "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_MNESIA_BASE": str(workdir / "mnesia"),
        "RABBITMQ_LOG_BASE": str(workdir / "log"),
        "RABBITMQ_CONFIG_FILE": str(workdir / "rabbitmq"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
        "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(workdir / "enabled_plugins"),
        "RABBITMQ_PID_FILE": str(workdir / "rabbit.pid"),
    }
    epmd = Proc.start(
        [epmd_bin, "-port", str(epmd_port), "-address", HOST],
        log=workdir / "epmd.log", name="epmd", env=env, new_session=True,
    )  # fmt: skip
    broker: Proc | None = None
    try:
        await epmd.ready(port_open(epmd_port), timeout_s=10)
        broker = Proc.start(
            [server], log=workdir / "rabbitmq.log", name="rabbitmq-server", env=env,
            cwd=workdir, new_session=True,
        )  # fmt: skip
        await broker.ready(log_line("Starting broker... completed"), timeout_s=START_TIMEOUT_S)
        await broker.ready(port_open(amqp_port), timeout_s=10)
        yield f"amqp://guest:guest@{HOST}:{amqp_port}/"
    finally:
        if broker is not None:
            await broker.stop(grace_s=30)
        await epmd.stop(grace_s=5)


async def _run(argv: Sequence[str]) -> int:
    """Run ``argv`` with a broker of its own in ``TOKENRELAY_TEST_AMQP``; its exit code."""
    with tempfile.TemporaryDirectory(prefix="tokenrelay-rabbit-") as tmp:
        try:
            async with local_rabbit(Path(tmp)) as url:
                print(f"RabbitMQ for this run: {url} (stopped when the run ends)", flush=True)
                return await _run_child(argv, {**os.environ, AMQP_ENV: url})
        except (RabbitMissing, ProcError) as exc:
            print(f"no RabbitMQ for this run ({exc}): the jobs tests will skip", flush=True)
    return await _run_child(argv, dict(os.environ))


async def _run_child(argv: Sequence[str], env: dict[str, str]) -> int:
    """Run ``argv`` on this process's streams until it exits; SIGINT and SIGTERM sent to
    this process go to it (by its pid), so the broker is stopped only after it."""
    child = await asyncio.create_subprocess_exec(*argv, env=env)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, child.send_signal, sig)
    try:
        return await child.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.rabbit",
        description="Run a command beside a RabbitMQ broker of its own "
        f"(its URL in {AMQP_ENV}); the broker is stopped when the command ends.",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS")
    argv = list(parser.parse_args(args).command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        parser.error("no command given (python -m devstack.rabbit -- CMD ARGS)")
    return asyncio.run(_run(argv))


if __name__ == "__main__":
    sys.exit(main())
