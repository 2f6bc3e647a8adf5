"""The benchmarks' command line, built from :data:`bench.catalog.CATALOG`.

- ``tokenrelay bench <name> [flags]``: :func:`register`, the ``tokenrelay.commands`` entry
  point ``bench = "bench.cli:register"``; ``tokenrelay loadtest`` too
  (:func:`register_loadtest`).
- ``python -m bench``: the list; ``python -m bench <name> [flags]``: one benchmark;
  ``python -m bench --quick-all DIR``: every quick run, JSON and plots in ``DIR``, exit 1
  if any failed (``make bench``).

A benchmark's subcommand takes its module's own flags (``add_arguments``) and runs its
``run_from_args``: ``tokenrelay bench routing_sim --quick`` is ``python -m
bench.routing.sim --quick``. ``tokenrelay`` imports a benchmark's module only when that
benchmark runs (every other subcommand builds its parser without them); ``python -m
bench`` imports them all to list their flags.

Order of use: :func:`tokenrelay.cli.build_parser` calls :func:`register` with its
subparsers; ``python -m bench`` calls :func:`main`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.catalog import CATALOG, Benchmark, find
from relay.service import runtime

__all__ = ["add_benchmarks", "build_parser", "main", "register", "register_loadtest", "run_quick"]


def _add(subparsers: Any, bench: Benchmark, name: str, aliases: Sequence[str] = ()) -> None:
    add_arguments, run_from_args = bench.entry()
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, aliases=list(aliases), help=bench.help, description=bench.help
    )
    add_arguments(p)
    p.set_defaults(func=run_from_args)


def add_benchmarks(subparsers: Any) -> None:
    """One subcommand per catalogued benchmark (and one per alias), with its own flags."""
    for bench in CATALOG:
        _add(subparsers, bench, bench.name, bench.aliases)


def _deferred(prog: str, bench: Benchmark | None = None) -> Callable[[argparse.Namespace], int]:
    """A ``func`` that imports the benchmark's module only when it runs, and parses its
    flags then (``tokenrelay relay`` must not import every benchmark to build its parser)."""

    def run(args: argparse.Namespace) -> int:
        b = bench or find(args.bench_cmd)
        add_arguments, run_from_args = b.entry()
        p = argparse.ArgumentParser(prog=f"{prog} {b.name}" if bench is None else prog,
                                    description=b.help)  # fmt: skip
        add_arguments(p)
        return run_from_args(p.parse_args(args.bench_args))

    return run


def register(subparsers: Any) -> None:
    """Add ``bench NAME [flags]`` to the ``tokenrelay`` parser; NAME's module is imported,
    and its flags parsed, when it runs (``tokenrelay bench NAME --help``: its flags)."""
    names = [n for b in CATALOG for n in (b.name, *b.aliases)]
    p = subparsers.add_parser(
        "bench",
        help="benchmarks (see bench/README.md)",
        description="One benchmark of bench/catalog.py: " + ", ".join(names),
    )
    p.add_argument("bench_cmd", metavar="NAME", choices=names, help="the benchmark")
    p.add_argument(
        "bench_args", nargs=argparse.REMAINDER, metavar="FLAGS", help="its flags (NAME --help)"
    )
    p.set_defaults(func=_deferred("tokenrelay bench"))


def register_loadtest(subparsers: Any) -> None:
    """``tokenrelay loadtest``: the load test as a top-level command too (deferred too)."""
    bench = find("loadtest")
    # every word after "loadtest" is the benchmark's: no prefix character of its own, so
    # argparse reads none of them as an option of this parser (--help included)
    p = subparsers.add_parser("loadtest", help=bench.help, add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_deferred("tokenrelay loadtest", bench))


def register_capacity(subparsers: Any) -> None:
    """``tokenrelay capacity``: :mod:`bench.capacity.cli`, imported when it runs (as a
    benchmark is), its flags parsed then."""
    p = subparsers.add_parser(
        "capacity", help="the relays, Redis masters and workers a number of viewers needs",
        add_help=False, prefix_chars="\0",
    )  # fmt: skip
    p.add_argument("capacity_args", nargs=argparse.REMAINDER)

    def run(args: argparse.Namespace) -> int:
        from bench.capacity.cli import main

        return main(args.capacity_args, prog="tokenrelay capacity")

    p.set_defaults(func=run)


# -- python -m bench -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="The benchmarks (bench/catalog.py): without a name, the list.",
    )
    p.add_argument(
        "--quick-all",
        metavar="DIR",
        type=Path,
        help="run the quick version of every benchmark that has one (make bench), "
        "each in a process of its own; JSON and plots in DIR; exit 1 if any failed",
    )
    add_benchmarks(p.add_subparsers(dest="bench_cmd", metavar="NAME"))
    return p


def listing() -> str:
    """The catalog as a table, and how to run one benchmark or all quick ones."""
    names = {b.name: ", ".join((b.name, *b.aliases)) + ("" if b.quick else " *") for b in CATALOG}
    w_name = max(map(len, names.values()))
    w_mod = max(len(b.module) for b in CATALOG)
    lines = [f"{'benchmark':{w_name}}  {'module':{w_mod}}  what it answers"]
    lines += [f"{names[b.name]:{w_name}}  {b.module:{w_mod}}  {b.help}" for b in CATALOG]
    lines += [
        "* not run by make bench (no quick run in bench/catalog.py)",
        "",
        "python -m bench NAME [FLAGS]      one benchmark (NAME --help: its flags, the module's)",
        "python -m bench --quick-all DIR   the quick run of each (make bench), JSON in DIR",
    ]
    return "\n".join(lines)


def _run_child(argv: Sequence[str]) -> int:
    """Run ``argv`` on this terminal (its output is the user's, as make's recipe lines
    were, hence not :class:`devstack.procs.Proc`, which logs to a file); its exit code.

    Interrupted here, the child is stopped by its pid as a Ctrl-C stops it (every
    benchmark then stops what it started; not all of them do on SIGTERM): SIGINT, which a
    Ctrl-C on the terminal has sent it already, then SIGTERM after 15 s, SIGKILL after 5
    more."""
    child = subprocess.Popen(list(argv))
    interrupted = False
    try:
        return child.wait()
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if child.poll() is None:
            if not interrupted:
                child.send_signal(signal.SIGINT)
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.terminate()
                try:
                    child.wait(5)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()


def run_quick(out: Path, catalog: Sequence[Benchmark] = CATALOG) -> int:
    """Every quick run of ``catalog`` in turn, each ``python -m <module> <flags>`` in a
    process of its own (a fresh interpreter, as ``python -m`` gives the docs' figures);
    a failure does not stop the others. A summary at the end; 1 if any failed."""
    out.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, int, float]] = []
    for bench in catalog:
        if bench.quick is None:
            continue
        argv = [sys.executable, "-m", bench.module, *bench.quick_argv(out)]
        print(f"\n==> {bench.name}: python {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        started = time.monotonic()
        code = _run_child(argv)
        done.append((bench.name, code, time.monotonic() - started))
    width = max((len(name) for name, _, _ in done), default=0)
    print("\nquick runs:", file=sys.stderr)
    for name, code, seconds in done:
        verdict = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:{width}}  {seconds:6.0f} s  {verdict}", file=sys.stderr)
    return 1 if any(code for _, code, _ in done) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick_all is not None:
        if args.bench_cmd is not None:
            parser.error("--quick-all runs every benchmark: give it no NAME")
        runtime.exit_on_sigterm()  # SystemExit here: _run_child stops the running child
        try:
            return run_quick(args.quick_all)
        except KeyboardInterrupt:  # the running child was stopped on the way out
            return 130
    if args.bench_cmd is None:
        print(listing())
        return 0
    code: int = args.func(args)
    return code
