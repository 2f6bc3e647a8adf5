"""The one process launcher (devstack.procs) with real child processes: readiness by log
line, port and HTTP; an early exit named with its last log lines; stop by pid with
SIGTERM, then SIGKILL after the grace period."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest

from devstack.procs import (
    Proc,
    ProcError,
    free_port,
    http_ok,
    launched,
    log_line,
    port_open,
    stop_all,
)
from tests.support.cli import run_cli


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


async def test_ready_by_log_line_then_sigterm_stops_it(tmp_path: Path) -> None:
    proc = Proc.start(py(SLEEPER), log=tmp_path / "a.log", name="sleeper")
    await proc.ready(log_line("ready"), timeout_s=20)
    assert proc.alive
    assert await proc.stop(grace_s=10) == -signal.SIGTERM
    assert not proc.alive
    assert proc.tail() == "ready"


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = Proc.start(py(STUBBORN), log=tmp_path / "b.log", name="stubborn")
    await proc.ready(log_line("ready"), timeout_s=20)
    t0 = time.monotonic()
    assert await proc.stop(grace_s=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 10


async def test_an_early_exit_says_why_with_the_last_lines(tmp_path: Path) -> None:
    code = "import sys; print('line one'); print('no config here', file=sys.stderr); sys.exit(3)"
    proc = Proc.start(py(code), log=tmp_path / "c.log", name="broken")
    with pytest.raises(ProcError) as err:
        await proc.ready(log_line("never"), timeout_s=20)
    text = str(err.value)
    assert "broken" in text
    assert "exited with code 3" in text
    assert "no config here" in text
    assert str(tmp_path / "c.log") in text


async def test_a_probe_that_never_holds_times_out_and_names_the_child(tmp_path: Path) -> None:
    async with launched(py(SLEEPER), log=tmp_path / "d.log", name="quiet") as proc:
        with pytest.raises(ProcError, match=r"quiet not ready after 0.3 s.*still running"):
            await proc.ready(log_line("never"), timeout_s=0.3)
    assert not proc.alive  # stopped on the way out


async def test_port_and_http_probes_against_a_real_server(tmp_path: Path) -> None:
    port = free_port()
    server = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    assert not await port_open(port)(None)  # type: ignore[arg-type]
    async with launched(
        server, log=tmp_path / "e.log", ready=port_open(port), name="http.server"
    ) as proc:
        assert await http_ok(f"http://127.0.0.1:{port}/")(proc)
        assert not await http_ok(f"http://127.0.0.1:{port}/nothing-here")(proc)
        assert await http_ok(f"http://127.0.0.1:{port}/nothing-here", status=404)(proc)


async def test_stop_all_shares_one_grace_and_pause_resume_by_signal(tmp_path: Path) -> None:
    procs = [
        Proc.start(py(SLEEPER), log=tmp_path / "f.log", name="a"),
        Proc.start(py(STUBBORN), log=tmp_path / "g.log", name="b"),
    ]
    for p in procs:
        await p.ready(log_line("ready"), timeout_s=20)
    procs[0].send(signal.SIGSTOP)  # a paused child still stops: SIGCONT comes first
    t0 = time.monotonic()
    await stop_all(procs, grace_s=0.5)
    assert time.monotonic() - t0 < 10
    assert [p.returncode for p in procs] == [-signal.SIGTERM, -signal.SIGKILL]
    procs[0].send(signal.SIGTERM)  # exited: sending is a no-op, not an error


async def test_stderr_apart_and_the_output_so_far(tmp_path: Path) -> None:
    code = (
        "import sys, time; print('to stdout', flush=True); "
        "print('to stderr', file=sys.stderr, flush=True); time.sleep(60)"
    )
    proc = Proc.start(py(code), log=tmp_path / "h.out", err_log=tmp_path / "h.err", name="two")
    try:
        await proc.ready(log_line("to stdout"), timeout_s=20)
        async with asyncio.timeout(20):
            while "to stderr" not in proc.output(stderr=True):
                await asyncio.sleep(0.05)
        assert proc.output() == "to stdout\n"  # stdout only, read while it runs
        assert proc.output(stderr=True) == "to stderr\n"
        assert proc.tail(stderr=True) == "to stderr"
    finally:
        await proc.stop(grace_s=10)
    assert "to stderr" in proc.why()  # an error message names both files' last lines
    assert "to stdout" in proc.why()
    quiet = Proc.start(py("print('gone')"), log=None, name="quiet")
    assert await quiet.wait(20) == 0
    assert quiet.output() == quiet.output(stderr=True) == ""


async def test_run_cli_gives_code_and_both_streams_and_stops_a_command_that_hangs() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)"
    ran = await run_cli(py(code), timeout_s=20)
    assert (ran.code, ran.out, ran.err) == (4, "out\n", "err\n")
    merged = await run_cli(py(code), timeout_s=20, merge=True)
    assert (merged.code, sorted(merged.out.split()), merged.err) == (4, ["err", "out"], "")
    t0 = time.monotonic()
    with pytest.raises(ProcError, match=r"still running after 0.3 s"):
        await run_cli(py(SLEEPER), timeout_s=0.3)
    assert time.monotonic() - t0 < 10  # stopped by pid (SIGTERM), not waited out
