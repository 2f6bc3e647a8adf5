"""One benchmark on two checkouts of this repository, in alternating rounds, on one machine.

A change of structure must not cost speed: the before and after are measured side by side
in one run (A, B, A, B, ...) so a neighbour's burst moves one round of each, not a whole
side. Each round runs ``python -m MODULE ARGS --json FILE`` with ``PYTHONPATH`` set to
that round's checkout (the benchmark, and every process it starts, run that tree's code:
devstack's launcher keeps a ``PYTHONPATH`` that is set); the medians of the named JSON keys
are printed per tree with the ratio B / A.

    python -m bench.trees --a ../old-checkout --b . --rounds 3 \\
        --keys relay_cpu_us_per_frame,latency_p99_ms \\
        -- bench.relay.throughput --quick --phases latency5k

A key is a top-level key of the JSON, one of its ``results``, or a dotted path into
nested objects (``summary.1.script.x_floor``).

``--json PATH`` writes every round's figures, the medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _round(tree: Path, module: str, args: list[str], keys: list[str]) -> dict[str, float]:
    """One run of ``module`` on ``tree``; the named keys of its JSON (missing: an error)."""
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as tmp:
        out = Path(tmp) / "round.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        argv = [sys.executable, "-m", module, *args, "--json", str(out)]
        done = subprocess.run(argv, env=env, cwd=tree, check=False)
        if done.returncode != 0:
            raise SystemExit(f"error: {module} on {tree} exited with code {done.returncode}")
        data: dict[str, Any] = json.loads(out.read_text())
    got: dict[str, float] = {}
    for key in keys:
        value = data.get(key, data.get("results", {}).get(key))
        if value is None and "." in key:  # a path into nested objects: summary.1.script.x
            value = data
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, int | float):
            raise SystemExit(f"error: {module}'s JSON has no number under {key!r}")
        got[key] = float(value)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trees", description=__doc__)
    parser.add_argument("--a", type=Path, required=True, help="the checkout before")
    parser.add_argument("--b", type=Path, required=True, help="the checkout after")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree (3)")
    parser.add_argument("--keys", required=True, help="comma-separated JSON keys to compare")
    parser.add_argument("--json", type=Path, help="write the rounds, medians and ratios here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE ARGS")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no benchmark given (-- MODULE ARGS)")
    if ns.rounds < 1:
        parser.error("--rounds must be at least 1")
    keys = [k for k in ns.keys.split(",") if k]
    trees = {"a": ns.a.resolve(), "b": ns.b.resolve()}
    for name, tree in trees.items():
        if not (tree / "relay").is_dir():
            parser.error(f"--{name} {tree} is not a checkout of this repository")
    rounds: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for i in range(ns.rounds):
        for name in ("a", "b"):
            print(f"round {i + 1}/{ns.rounds}: {name} = {trees[name]}", flush=True)
            rounds[name].append(_round(trees[name], command[0], command[1:], keys))
    medians = {n: {k: statistics.median(r[k] for r in rounds[n]) for k in keys} for n in rounds}
    ratios = {k: round(medians["b"][k] / medians["a"][k], 3) if medians["a"][k] else None
              for k in keys}  # fmt: skip
    print(f"{'key':32} {'a (median)':>12} {'b (median)':>12} {'b / a':>8}")
    for k in keys:
        print(f"{k:32} {medians['a'][k]:>12.2f} {medians['b'][k]:>12.2f} {ratios[k]!s:>8}")
    if ns.json is not None:
        ns.json.write_text(json.dumps(
            {"trees": {n: str(t) for n, t in trees.items()}, "command": command,
             "rounds": rounds, "medians": medians, "ratios": ratios}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
