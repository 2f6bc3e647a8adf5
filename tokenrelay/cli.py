"""The ``tokenrelay`` command line.

Every subcommand (``relay``, ``worker``, ``jobworker``, ``capacity``: the product's; the
development stack's are ``python -m devstack``, the benchmarks' ``python -m bench``) is
added by the package that owns it through the entry-point group ``tokenrelay.commands``:
each entry point is a function ``register(subparsers) -> None`` that adds a parser whose
default ``func`` takes the parsed arguments and returns an exit code. This module
imports none of them directly, so no product package depends on another through the
command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

__all__ = ["ENTRY_POINT_GROUP", "OneLineParser", "build_parser", "main"]

ENTRY_POINT_GROUP = "tokenrelay.commands"


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, ``error: ...`` and a pointer to ``--help``, exit 2 (not the
    whole usage text, which runs to twenty lines for the relay). Subcommands' parsers are
    of this class too (argparse makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="tokenrelay", description="Stream LLM tokens to browsers over Redis 7 Cluster."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        register: Callable[[Any], None] = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
