"""``python -m bench.fuzz``: fuzz the parsers that read hostile input, a million cases.

Targets and their contracts: :mod:`bench.fuzz.props` (frame decoder, session id parser
and keys, resume-offset parser, token verifier). Three engines, per target:

1. ``random``: a plain loop over :meth:`Target.generate` (random bytes, or 1-4
   mutations of a valid encoding) with a seeded ``random.Random``: the throughput part,
   ``--cases`` in total split evenly across the targets;
2. ``hypothesis`` (when installed): structured inputs, ``--hypothesis-examples`` per
   target;
3. ``atheris`` (optional, coverage-guided libFuzzer; ``pip install atheris``): one child
   process per target (``atheris.Fuzz`` exits its process), ``--atheris-runs`` each;
   skipped with a note when atheris does not import.

Every exception that is not the parser's documented error is a failure; the report
keeps the first few failing inputs. Output: one JSON object (stdout, and ``--json
PATH``) with cases, seconds, cases/s and failures per target and engine; exit 1 if
any failure. ``--quick``: 20,000 random cases, 200 hypothesis examples, no atheris.

Order of use: ``main(argv)`` (or :func:`add_arguments` and :func:`run_from_args`, as
``python -m bench fuzz`` does) -> :func:`run_random` / :func:`run_hypothesis` /
:func:`run_atheris` per target -> JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.fuzz.props import SEEDS, TARGETS, Target
from bench.harness import Bench, Common, Outcome, flag

__all__ = ["add_arguments", "main", "run_atheris", "run_from_args", "run_hypothesis", "run_random"]

_KEEP = 5  # failing inputs kept per target and engine


def _result(
    engine: str, cases: int, seconds: float, failures: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "engine": engine,
        "cases": cases,
        "seconds": round(seconds, 3),
        "cases_per_s": round(cases / seconds) if seconds > 0 else None,
        "failures": len(failures),
        "examples": failures[:_KEEP],
    }


def _failure(data: bytes, exc: BaseException) -> dict[str, str]:
    return {"input": repr(data[:200]), "error": f"{type(exc).__name__}: {exc}"[:300]}


def run_random(target: Target, cases: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{target.name}")
    gen, check = target.generate, target.check
    failures: list[dict[str, str]] = []
    nfail = 0
    start = time.perf_counter()
    for _ in range(cases):
        data = gen(rng)
        try:
            check(data)
        except Exception as exc:
            nfail += 1
            if len(failures) < _KEEP:
                failures.append(_failure(data, exc))
    out = _result("random", cases, time.perf_counter() - start, failures)
    out["failures"] = nfail
    return out


def run_hypothesis(target: Target, examples: int) -> dict[str, Any]:
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        return {"engine": "hypothesis", "skipped": "hypothesis is not installed"}
    seeds = SEEDS[target.name]
    strategy = st.binary(max_size=256) | st.sampled_from(seeds).flatmap(
        lambda s: st.tuples(st.integers(0, len(s)), st.integers(0, 8), st.binary(max_size=16)).map(
            lambda t: s[: t[0]] + t[2] + s[t[0] + t[1] :]
        )
    )
    seen: list[int] = [0]
    failures: list[dict[str, str]] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(strategy)
    def prop(data: bytes) -> None:
        seen[0] += 1
        target.check(data)

    start = time.perf_counter()
    try:
        prop()
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        failures.append(
            {"input": "(see the error: hypothesis shrank it)", "error": repr(exc)[:300]}
        )
    return _result("hypothesis", seen[0], time.perf_counter() - start, failures)


def run_atheris(target: Target, runs: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """One child process (``atheris.Fuzz`` ends its process); counts from its exit."""
    try:
        import atheris  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return {"engine": "atheris", "skipped": "atheris is not installed (pip install atheris)"}
    argv = [sys.executable, "-m", "bench.fuzz.run", "--atheris-child", target.name, str(runs)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"engine": "atheris", "skipped": f"did not finish in {timeout_s:.0f}s"}
    seconds = time.perf_counter() - start
    err = proc.stderr.decode(errors="replace")
    failures = [] if proc.returncode == 0 else [{"input": "(libFuzzer crash file)",
                                                 "error": err[-600:]}]  # fmt: skip
    done = runs
    for line in err.splitlines():  # "#123456\tDONE   cov: ..." is libFuzzer's last line
        if "DONE" in line and line.startswith("#"):
            done = int(line[1:].split()[0])
    return _result("atheris", done, seconds, failures)


def _atheris_child(name: str, runs: int) -> None:
    import atheris

    with atheris.instrument_imports():
        from bench.fuzz import props as fuzz_props
    target = fuzz_props.TARGETS[name]
    corpus = os.environ.get("TOKENRELAY_FUZZ_CORPUS")
    args = [sys.argv[0], f"-runs={runs}", "-max_len=512", "-seed=1"]
    if corpus:
        args.append(corpus)
    atheris.Setup(args, target.check)
    atheris.Fuzz()


def _targets(text: str) -> list[str]:
    """``--targets``: comma-separated names of :data:`bench.fuzz.props.TARGETS`."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if not names:
        raise argparse.ArgumentTypeError(f"no target; choose from {list(TARGETS)}")
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    return names


def _command() -> str:
    """This run's command line as typed: ``python -m bench.fuzz ...``, or ``tokenrelay
    bench fuzz ...`` (a console script, named without its directory)."""
    argv = sys.orig_argv[1:]
    if argv and not argv[0].startswith("-"):
        return " ".join([os.path.basename(argv[0]), *argv[1:]])
    return " ".join(["python", *argv])


@dataclass
class Flags(Common):
    cases: int = flag(1_000_000, "random cases, all targets", quick=20_000, least=1)
    hypothesis_examples: int = flag(2_000, "per target", quick=200, least=0)
    atheris_runs: int = flag(50_000, "per target (0: skip)", quick=0, least=0)
    targets: str = flag(",".join(TARGETS), "comma-separated")
    seed: int = flag(1, "the random cases")
    atheris_child: list[str] | None = flag(None, "", nargs=2, hidden=True)


def _run(args: Flags) -> Outcome | int:
    if args.atheris_child:
        _atheris_child(args.atheris_child[0], int(args.atheris_child[1]))
        return Outcome({})
    try:
        names = _targets(args.targets)
    except argparse.ArgumentTypeError as exc:
        print(f"error: --targets: {exc}", file=sys.stderr)
        return 2
    per_target = max(args.cases // len(names), 1)
    python = sys.version.split()[0]
    report: dict[str, Any] = {"command": _command(), "python": python, "targets": {}}
    total_cases = total_failures = 0
    for name in names:
        target = TARGETS[name]
        rows = [run_random(target, per_target, args.seed)]
        if args.hypothesis_examples > 0:
            rows.append(run_hypothesis(target, args.hypothesis_examples))
        if args.atheris_runs > 0:
            rows.append(run_atheris(target, args.atheris_runs))
        report["targets"][name] = rows
        for row in rows:
            total_cases += row.get("cases", 0)
            total_failures += row.get("failures", 0)
        print(f"{name}: " + "; ".join(_line(r) for r in rows), file=sys.stderr)
    report["total_cases"] = total_cases
    report["total_failures"] = total_failures
    return Outcome(report, json.dumps(report, indent=2), 1 if total_failures else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.fuzz", description=(__doc__ or "").split("\n")[0],
              quick_help="20k cases, 200 examples, no atheris", sigterm=False)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


def _line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"{row['engine']} skipped ({row['skipped']})"
    return (
        f"{row['engine']} {row['cases']:,} cases, {row['cases_per_s'] or 0:,}/s, "
        f"{row['failures']} failures"
    )


if __name__ == "__main__":
    sys.exit(main())
