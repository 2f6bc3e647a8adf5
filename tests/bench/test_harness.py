"""``bench.harness``: a benchmark's flags from its dataclass (quick values, a given value
winning, the refusal of a number below its least), the one JSON writer (the run's
settings, seed, machine and commit beside the result's own keys), the tables, and the
stack that stops every process it started by pid, an exception on the way out included."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.harness import Bench, Common, Outcome, bench_stack, flag, markdown_table, text_table
from bench.harness.report import RUN_KEY
from devstack.procs import file_exists


@dataclass
class Flags(Common):
    sessions: int = flag(50, "concurrent sessions", quick=10, least=1)
    rate: float = flag(5.0, "tokens/s", above=0)
    redis: str | None = flag(None, "a running cluster")
    only: list[str] = flag([], "run only this", choices=("a", "b"))
    seed: int = flag(7, "first seed")
    verbose: bool = flag(False, "say more")


def _bench(seen: list[Flags], code: int = 0) -> Bench[Flags]:
    def measure(f: Flags) -> Outcome:
        seen.append(f)
        return Outcome({"sessions": f.sessions, "paths": {"x": 1}}, "| a |\n|---|", code)

    return Bench(Flags, measure, prog="python -m bench.x.demo", description="a demo",
                 quick_help="10 sessions")  # fmt: skip


def test_defaults_quick_values_and_given_values() -> None:
    seen: list[Flags] = []
    b = _bench(seen)
    assert b.main([]) == 0
    assert b.main(["--quick"]) == 0
    assert b.main(["--quick", "--sessions", "3", "--only", "a", "--only", "b", "--verbose"]) == 0
    plain, quick, given = seen
    assert (plain.sessions, plain.seed, plain.quick, plain.rate, plain.only) == (
        50,
        7,
        False,
        5.0,
        [],
    )
    assert (quick.sessions, quick.quick) == (10, True)
    assert (given.sessions, given.only, given.verbose) == (3, ["a", "b"], True)


def test_a_number_below_its_least_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Flags] = []
    assert _bench(seen).main(["--sessions", "0"]) == 2
    assert _bench(seen).main(["--rate", "0"]) == 2
    assert not seen
    err = capsys.readouterr().err
    assert "--sessions must be >= 1" in err
    assert "--rate must be > 0" in err


def test_help_names_default_and_quick_value() -> None:
    text = _bench([]).parser().format_help()
    assert "concurrent sessions (default 50; quick 10)" in text
    assert "--quick" in text
    assert "10 sessions" in text


def test_the_json_has_the_results_keys_and_the_runs_settings(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "r.json"
    assert _bench([], code=1).main(["--quick", "--seed", "3", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["sessions"] == 10
    assert doc["paths"] == {"x": 1}
    run = doc[RUN_KEY]
    assert run["bench"] == "bench.x.demo"
    assert run["seed"] == 3
    assert run["quick"] is True
    assert run["settings"]["sessions"] == 10
    assert run["settings"]["json"] == str(out)
    assert run["machine"]["cpus"] == os.cpu_count()
    assert run["commit"] is None or len(run["commit"].split("+")[0]) == 40


def test_report_prints_a_stored_runs_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b = _bench([])
    b.markdown = lambda r: f"| sessions |\n|---|\n| {r['sessions']} |"
    (tmp_path / "ok.json").write_text(json.dumps({"sessions": 4}))
    (tmp_path / "bad.json").write_text("[]")
    parser = argparse.ArgumentParser()
    b.add_arguments(parser)
    assert b.run_from_args(parser.parse_args(["--report", str(tmp_path / "ok.json")])) == 0
    assert "| 4 |" in capsys.readouterr().out
    assert b.run_from_args(parser.parse_args(["--report", str(tmp_path / "bad.json")])) == 2
    assert capsys.readouterr().err.startswith("demo: cannot read")


def test_tables() -> None:
    assert markdown_table(["a", "b"], [["x", 1234], ["y", 0.5]]) == (
        "| a | b |\n|---|---|\n| x | 1,234 |\n| y | 0.50 |"
    )
    assert text_table(["name", "n"], [["ab", 1], ["c", 22]]).splitlines() == [
        "name   n",
        "ab     1",
        "c     22",
    ]


async def _fail_with_a_process(ready: Path, pids: list[int]) -> None:
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    async with bench_stack("harness-test-") as st:
        proc = await st.start("sleeper", [sys.executable, "-c", code], ready=file_exists(ready))
        pids.append(proc.pid)
        assert proc.alive
        raise RuntimeError("the run failed")


async def test_the_stack_stops_its_processes_by_pid_when_the_run_fails(tmp_path: Path) -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="the run failed"):
        await _fail_with_a_process(tmp_path / "ready", pids)
    assert pids
    gone = not Path(f"/proc/{pids[0]}").exists()
    assert gone or "zombie" in Path(f"/proc/{pids[0]}/status").read_text()
