"""The benchmarks' command line, built from :data:`bench.catalog.CATALOG`, run from a
checkout (the benchmarks are not in the wheel):

- ``python -m bench``: the list; ``python -m bench <name> [flags]``: one benchmark;
  ``python -m bench --quick-all DIR``: every quick run, JSON and plots in ``DIR``, exit 1
  if any failed (``make bench``).

A benchmark's subcommand takes its module's own flags (``add_arguments``) and runs its
``run_from_args``: ``python -m bench routing_sim --quick`` is ``python -m
bench.routing.sim --quick``.

Order of use: ``python -m bench`` calls :func:`main`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.catalog import CATALOG, Benchmark
from relay.service import runtime

__all__ = ["add_benchmarks", "build_parser", "main", "run_quick"]


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
