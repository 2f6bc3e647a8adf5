"""``tokenrelay capacity``: the I/O shell of :mod:`tokenrelay.capacity.core`; :func:`register`
is the entry point ``capacity`` of the group ``tokenrelay.commands``.

Reads the costs from a ``bench.peers.pathcost`` JSON (``--from``) or takes the committed
ones (:data:`tokenrelay.capacity.defaults.COSTS`, labelled with the command and date of their
run), and prints the cluster 10k, 100k and 1M concurrent viewers need (``--viewers``),
with its assumptions. Bad input exits with a one-line message.

``tokenrelay capacity [--from PATHCOST.json] [--tokens-per-s 30] [--viewers-per-session 1]``
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenrelay.capacity import defaults
from tokenrelay.capacity.core import Assumptions, Costs, Target, costs_from_pathcost, plan, render
from tokenrelay.capacity.defaults import COSTS

__all__ = ["add_arguments", "main", "register", "run"]


def _viewers(text: str) -> list[int]:
    try:
        out = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no viewer counts")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Assumptions()
    ap.add_argument("--from", dest="source", metavar="JSON",
                    help="costs from this bench.peers.pathcost --json result (default: "
                         "the committed run's, tokenrelay/capacity/defaults.py)")  # fmt: skip
    ap.add_argument("--viewers", type=_viewers, default=[10_000, 100_000, 1_000_000],
                    help="concurrent viewers, comma-separated (10000,100000,1000000)")  # fmt: skip
    ap.add_argument("--tokens-per-s", type=float, default=30.0, help="per session (30)")
    ap.add_argument("--viewers-per-session", type=float, default=1.0, help="(1)")
    ap.add_argument("--cores-per-pod", type=float, default=d.cores_per_pod)
    ap.add_argument("--utilisation", type=float, default=d.utilisation)
    ap.add_argument("--redis-core-ceiling", type=float, default=d.redis_core_ceiling)
    ap.add_argument("--replicas-per-master", type=int, default=d.replicas_per_master)
    ap.add_argument("--kb-per-conn", type=float, help=f"relay KB per connection ({d.kb_per_conn})")
    ap.add_argument("--pod-memory-mb", type=float, default=d.pod_memory_mb)
    ap.add_argument("--tokens-per-frame", type=float, default=d.tokens_per_frame,
                    help="coalescing: tokens per frame (1, as measured)")  # fmt: skip
    ap.add_argument("--write-defaults", metavar="LABEL",
                    help="with --from: print tokenrelay/capacity/defaults.py for those costs, "
                         "LABEL (the run's command and date) as their source")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    costs = COSTS
    if args.source:
        try:
            res: Any = json.loads(Path(args.source).read_text(encoding="utf-8"))
            costs = costs_from_pathcost(res, args.viewers_per_session)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"capacity: cannot read costs from {args.source}: {exc}") from None
        if args.write_defaults:
            print(defaults_source(replace(costs, source=f"{args.write_defaults}: {costs.source}")))
            return 0
        costs = replace(costs, source=f"{args.source}: {costs.source}")
    elif args.write_defaults:
        raise SystemExit("capacity: --write-defaults needs --from")
    a = Assumptions(
        cores_per_pod=args.cores_per_pod,
        utilisation=args.utilisation,
        redis_core_ceiling=args.redis_core_ceiling,
        replicas_per_master=args.replicas_per_master,
        pod_memory_mb=args.pod_memory_mb,
        tokens_per_frame=args.tokens_per_frame,
    )
    if args.kb_per_conn is not None:
        a = replace(a, kb_per_conn=args.kb_per_conn, kb_source="--kb-per-conn")
    try:
        plans = [plan(Target(v, args.tokens_per_s, args.viewers_per_session), costs, a)
                 for v in args.viewers]  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"capacity: {exc}") from None
    print(render(plans, costs, a))
    return 0


def defaults_source(costs: Costs) -> str:
    """The text of tokenrelay/capacity/defaults.py holding ``costs``."""
    doc = (defaults.__doc__ or "").strip()
    parts = textwrap.wrap(costs.source, 80, drop_whitespace=False)
    # double quotes, as ruff format writes them: the file is committed as printed
    source = "".join(f"\n        {json.dumps(part, ensure_ascii=False)}" for part in parts)
    return (
        f'"""{doc}"""\n\nfrom __future__ import annotations\n\n'
        "from tokenrelay.capacity.core import Costs\n\n"
        '__all__ = ["COSTS"]\n\n'
        f"COSTS = Costs(\n    producer_us={costs.producer_us!r},\n"
        f"    redis_masters_us={costs.redis_masters_us!r},\n"
        f"    redis_replicas_us={costs.redis_replicas_us!r},\n"
        f"    relay_us={costs.relay_us!r},\n    source=({source}\n    ),\n)"
    )


def register(subparsers: Any) -> None:
    """Add ``capacity`` to the ``tokenrelay`` subcommands."""
    p = subparsers.add_parser(
        "capacity", help="the relays, Redis masters and workers a number of viewers needs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None, prog: str = "tokenrelay capacity") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(ap)
    return run(ap.parse_args(argv))
