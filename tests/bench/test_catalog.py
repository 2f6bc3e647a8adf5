"""``bench/catalog.py``: the one list of benchmarks that ``make bench`` and ``python -m
bench`` read. No benchmark runs here: the quick runs are checked against
two stand-in modules."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.catalog import CATALOG, Benchmark, find
from bench.cli import build_parser as bench_parser
from bench.cli import listing, main, run_quick
from devstack.procs import Proc, file_exists

ROOT = Path(__file__).resolve().parents[2]
DOCS = (
    ROOT / "README.md",
    ROOT / "RELIABILITY.md",
    ROOT / "bench/README.md",
    *ROOT.glob("docs/*.md"),
)
RUNS = re.compile(r"python -m bench ([a-z_]+)")
BY_NAME = pytest.mark.parametrize("bench", CATALOG, ids=[b.name for b in CATALOG])


def test_names_and_aliases_are_unique() -> None:
    names = [n for b in CATALOG for n in (b.name, *b.aliases)]
    assert len(names) == len(set(names))
    assert all(find(n).name in names for n in names)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names)  # artifacts/<name>.json


@BY_NAME
def test_every_module_exists_runs_as_python_m_and_has_the_entry_point(bench: Benchmark) -> None:
    spec = importlib.util.find_spec(bench.module)
    assert spec is not None, f"{bench.module}: no such module"
    assert spec.origin is not None
    assert 'if __name__ == "__main__":' in Path(spec.origin).read_text(), (
        f"{bench.module} does not run as python -m {bench.module}"
    )
    add_arguments, run_from_args = bench.entry()
    assert callable(add_arguments)
    assert callable(run_from_args)


@BY_NAME
def test_the_quick_run_is_the_modules_own_flags(bench: Benchmark, tmp_path: Path) -> None:
    add_arguments, _ = bench.entry()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if bench.quick is None:
        with pytest.raises(ValueError, match="no quick run"):
            bench.quick_argv(tmp_path)
        return
    args = vars(parser.parse_args(bench.quick_argv(tmp_path)))
    assert args["quick"] is True
    given = {str(v) for v in args.values() if v is not None}
    assert str(tmp_path / f"{bench.name}.json") in given
    assert (str(tmp_path / f"{bench.name}.png") in given) == bench.plot


def test_make_bench_runs_the_catalog_not_a_list_of_its_own() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.strip() for line in recipe] == ["$(BIN)/python -m bench --quick-all artifacts"]
    quick_lines = [ln for ln in makefile.splitlines() if "-m bench." in ln and "--quick" in ln]
    assert not quick_lines, f"the Makefile spells out quick runs: {quick_lines}"


def test_python_m_bench_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.strip() == listing()
    for bench in CATALOG:
        row = next(line for line in out.splitlines() if line.startswith(bench.name))
        assert bench.module in row
        assert bench.help in row
        assert row.split("  ")[0].endswith("*") == (bench.quick is None)


@BY_NAME
def test_python_m_bench_offers_it_with_its_flags(bench: Benchmark, tmp_path: Path) -> None:
    _, run_from_args = bench.entry()
    flags = bench.quick_argv(tmp_path) if bench.quick else []
    for name in (bench.name, *bench.aliases):
        assert bench_parser().parse_args([name, *flags]).func is run_from_args


def test_tokenrelay_builds_its_parser_without_bench_or_devstack() -> None:
    # neither is in the wheel: no subcommand of tokenrelay may need them
    code = (
        "import sys; from tokenrelay.cli import build_parser; build_parser(); "
        "mods = sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'devstack')); "
        "print(mods); sys.exit(1 if mods else 0)"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_the_docs_name_only_catalogued_benchmarks() -> None:
    names = {n for b in CATALOG for n in (b.name, *b.aliases)}
    bad = [
        f"{doc.relative_to(ROOT)}: {m[0]}"
        for doc in DOCS
        for m in RUNS.finditer(doc.read_text())
        if m[1] not in names
    ]
    assert not bad, "the docs run benchmarks the catalog does not have:\n" + "\n".join(bad)


def test_quick_all_runs_every_quick_entry_and_fails_if_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "stand_in_ok.py").write_text(
        "import sys\n"
        "if __name__ == '__main__':\n"
        "    open(sys.argv[sys.argv.index('--json') + 1], 'w').write(repr(sys.argv[1:]))\n"
    )
    (tmp_path / "stand_in_bad.py").write_text(
        "if __name__ == '__main__':\n    raise SystemExit(3)\n"
    )
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), path) if p))
    out = tmp_path / "artifacts"
    catalog = (
        Benchmark("bad", "stand_in_bad", "exits 3"),
        Benchmark("ok", "stand_in_ok", "writes its JSON", quick=("--quick", "--x"), plot=True),
        Benchmark("never", "stand_in_missing", "no quick run", quick=None),
    )
    assert run_quick(out, catalog) == 1
    assert (out / "ok.json").read_text() == repr(
        ["--quick", "--x", "--json", str(out / "ok.json"), "--plot", str(out / "ok.png")]
    )  # it ran after the failure, with its own flags
    err = capfd.readouterr().err
    assert "bad" in err
    assert "FAILED (exit 3)" in err
    assert "never" not in err
    assert run_quick(out, catalog[1:]) == 0


async def test_quick_all_stopped_stops_the_running_benchmark_as_a_ctrl_c_does(
    tmp_path: Path,
) -> None:
    (tmp_path / "stand_in_slow.py").write_text(
        "import pathlib, sys, time\n"
        "if __name__ == '__main__':\n"
        "    here = pathlib.Path(sys.argv[sys.argv.index('--json') + 1]).parent\n"
        "    (here / 'started').touch()\n"
        "    try:\n"
        "        time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        "        (here / 'cleaned_up').touch()\n"
        "        raise SystemExit(130)\n"
    )
    (tmp_path / "driver.py").write_text(
        "import pathlib, sys\n"
        "from bench.catalog import Benchmark\n"
        "from bench.cli import run_quick\n"
        "from relay.service import runtime\n"
        "runtime.exit_on_sigterm()\n"
        "slow = Benchmark('slow', 'stand_in_slow', 'sleeps until stopped')\n"
        "sys.exit(run_quick(pathlib.Path(sys.argv[1]), [slow]))\n"
    )
    out = tmp_path / "artifacts"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    driver = Proc.start(
        [sys.executable, str(tmp_path / "driver.py"), str(out)], log=tmp_path / "log", env=env
    )
    try:
        await driver.ready(file_exists(out / "started"), timeout_s=30)
        driver.send(signal.SIGTERM)  # as a killed make would
        assert await driver.wait(20) == 128 + signal.SIGTERM
    finally:
        await driver.stop()
    assert (out / "cleaned_up").exists(), driver.tail()
