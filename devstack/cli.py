"""``python -m devstack demo|cluster|engine``: the development stack's commands.

The development stack is not in the wheel: these run from a checkout (``make demo`` runs
``python -m devstack demo``), with the flags, the environment and the one-line refusals
the same commands had as ``tokenrelay`` subcommands. Each package adds its subcommand
with its own ``register(subparsers)``: :mod:`devstack.demo.cli`,
:mod:`devstack.cluster.cli`, :mod:`devstack.mockengine.cli`.

Order of use: ``python -m devstack`` calls :func:`main`; tests build the parser with
:func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from devstack.cluster.cli import register as register_cluster
from devstack.demo.cli import register as register_demo
from devstack.llama.cli import register as register_llama
from devstack.mockengine.cli import register as register_engine

__all__ = ["PROG", "build_parser", "main"]

PROG = "python -m devstack"
REGISTERS: tuple[Callable[[Any], None], ...] = (
    register_cluster,
    register_demo,
    register_engine,
    register_llama,
)


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line and a pointer to ``--help``, exit 2, as ``tokenrelay``'s
    parser says it (devstack may not import the command line: CONTRIBUTING.md)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description="The development stack, from a checkout: the demo, a local Redis "
        "Cluster, a mock inference engine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTERS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)
