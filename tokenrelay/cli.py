"""The ``tokenrelay`` command line.

Every subcommand (``relay``, ``worker``, ``jobworker``, ``capacity``: the product's; the
development stack's are ``python -m devstack``, the benchmarks' ``python -m bench``) is
added by the package that owns it through the entry-point group ``tokenrelay.commands``:
each entry point is a function ``register(subparsers) -> None`` that adds a parser whose
default ``func`` takes the parsed arguments and returns an exit code. This module
imports none of them directly, so no product package depends on another through the
command line.

An app's install (``pip install tokenrelay``: the producer API) leaves the servers'
dependencies out (the ``server`` extra, pyproject.toml): a subcommand whose module cannot
be imported for want of one is still listed, and running it is one line naming the extra
to install (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, requires
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


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def extra_providing(module: str) -> str | None:
    """The extra of this distribution whose requirements install ``module`` (a top-level
    import name: ``aiohttp`` -> ``server``), or None."""
    try:
        reqs = requires("tokenrelay") or []
    except PackageNotFoundError:
        return None
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+).*;.*\bextra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if m and _normal(m.group(1)) == _normal(module):
            return m.group(2)
    return None


def _missing(command: str, module: str) -> Callable[[argparse.Namespace], int]:
    extra = extra_providing(module)
    fix = f"pip install 'tokenrelay[{extra}]'" if extra else f"pip install {module}"
    line = f"error: tokenrelay {command} needs {module}, which is not installed: {fix}"

    def refuse(_args: argparse.Namespace) -> int:
        print(line, file=sys.stderr)
        return 2

    return refuse


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="tokenrelay", description="Stream LLM tokens to browsers over Redis 7 Cluster."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            register: Callable[[Any], None] = ep.load()
        except ModuleNotFoundError as exc:  # a dependency of an extra that is not installed
            if not exc.name or exc.name.split(".")[0] in ("relay", "worker", "tokenrelay"):
                raise
            top = exc.name.split(".")[0]
            p = sub.add_parser(ep.name, help=f"(not installed: needs {top})", add_help=False)
            p.set_defaults(func=_missing(ep.name, top), refused=True)
            continue
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "refused", False):
        args = parser.parse_args(argv)  # the one-line error about the unknown flags
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
