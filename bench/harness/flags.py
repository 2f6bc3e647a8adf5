"""A benchmark's flags from a dataclass: one declaration per option (its help, its default
and its quick value), and ``--json PATH``, ``--quick`` and ``--seed`` common to all.

Order of use::

    @dataclass
    class Flags(Common):
        sessions: int = flag(50, "concurrent sessions", quick=10, least=1)
        redis: str | None = flag(None, "a running cluster's URL (default: start one)")

    def measure(f: Flags) -> Outcome: ...      # the run: its result, text and exit code

    BENCH = Bench(Flags, measure, prog="python -m bench.x.y", description=__doc__)
    add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main

A flag is ``--<field name with dashes>``; its type is the field's (``int``, ``float``,
``str``, ``Path``, ``bool`` as ``store_true``, ``list[str]`` as a repeatable flag, each
``| None``). A value not given on the command line is the quick value under ``--quick``
(where the field has one), else the default: a given value always wins. ``least``
refuses a smaller number (exit 2, as every benchmark did by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.harness.report import read_result, write_result
from relay.service import runtime

__all__ = ["Bench", "Common", "OnCluster", "Outcome", "flag", "parse_flags"]

_MISSING: Any = object()


def flag(
    default: Any,
    help: str = "",
    *,
    quick: Any = _MISSING,
    least: float | None = None,
    above: float | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    name: str | None = None,
    hidden: bool = False,
    nargs: int | None = None,
) -> Any:
    """One option of a benchmark: a dataclass field holding its flag's help, default, the
    value of a quick run and the smallest number it takes (``least``: >=, ``above``: >).
    ``name``: the flag when it is not ``--<field>``; ``hidden``: not in ``--help``;
    ``nargs``: a ``list[str]`` flag that takes this many values at once."""
    meta = {"help": help, "quick": quick, "least": least, "above": above,
            "choices": choices, "metavar": metavar, "name": name, "hidden": hidden,
            "nargs": nargs}  # fmt: skip
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Common:
    """The flags every benchmark takes; a benchmark's own flags extend it (and may declare
    ``seed`` again for its own default and help)."""

    json: Path | None = flag(None, "write the results as JSON", metavar="PATH")
    quick: bool = flag(False, "a short run (make bench)")
    seed: int = flag(0, "accepted for symmetry; no randomness")


@dataclass
class OnCluster(Common):
    """The flags of a benchmark on a Redis Cluster: ``--redis URL`` of a running one, or
    none for one started by its stack (:meth:`bench.harness.stack.BenchStack.cluster`)."""

    redis: str | None = flag(None, "redis://host:port of a running cluster (default: start one)")


F = TypeVar("F", bound=Common)


@dataclass
class Outcome:
    """What a run gives back: its result (written to ``--json``), what it prints (the text
    table, the Markdown table) and its exit code."""

    result: dict[str, Any]
    text: str = ""
    code: int = 0


def _base(hint: Any) -> tuple[Any, bool]:
    """The type under ``X | None`` and whether None is allowed."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return hint, False


def _flag_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("name") or "--" + f.name.replace("_", "-"))


def _help(f: dataclasses.Field[Any], default: Any) -> str:
    meta = f.metadata
    if meta.get("hidden"):
        return argparse.SUPPRESS
    text = str(meta.get("help", ""))
    if isinstance(default, bool) or f.name in ("json", "quick"):
        return text
    notes = []
    if default not in (None, [], ""):
        notes.append(f"default {default}")
    if meta.get("quick", _MISSING) is not _MISSING:
        notes.append(f"quick {meta['quick']}")
    if notes and "default" not in text:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
    return text.replace("%", "%%")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name}: a benchmark's flag needs a default")


def add_flags(parser: argparse.ArgumentParser, cls: type[Common], quick_help: str = "") -> None:
    """One ``add_argument`` per field of ``cls``. Every value's parser default is None (or
    False): :func:`parse_flags` then knows which flags were given."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, _ = _base(hints[f.name])
        default = _default(f)
        helptext = quick_help if f.name == "quick" and quick_help else _help(f, default)
        kwargs: dict[str, Any] = {"dest": f.name, "help": helptext}
        if kind is bool:
            parser.add_argument(_flag_name(f), action="store_true", default=None, **kwargs)
            continue
        if typing.get_origin(kind) is list:
            if f.metadata.get("nargs"):
                kwargs["nargs"] = f.metadata["nargs"]
            else:
                kwargs["action"] = "append"
            kind = typing.get_args(kind)[0]
        kwargs["type"] = kind if kind in (int, float, Path) else str
        if f.metadata.get("choices"):
            kwargs["choices"] = list(f.metadata["choices"])
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        parser.add_argument(_flag_name(f), default=None, **kwargs)


class FlagError(ValueError):
    """A value the benchmark refuses (below its ``least``)."""


def parse_flags(cls: type[F], args: argparse.Namespace) -> F:
    """The dataclass of ``args``: each value as given, else the quick value under
    ``--quick``, else the default. :class:`FlagError` for a number below its least."""
    quick = bool(getattr(args, "quick", False))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        given = getattr(args, f.name, None)
        if given is None:
            q = f.metadata.get("quick", _MISSING)
            given = q if quick and q is not _MISSING else _default(f)
            if isinstance(given, list):
                given = list(given)
        else:
            least, above = f.metadata.get("least"), f.metadata.get("above")
            if least is not None and given < least:
                raise FlagError(f"{_flag_name(f)} must be >= {least:g}")
            if above is not None and given <= above:
                raise FlagError(f"{_flag_name(f)} must be > {above:g}")
        values[f.name] = given
    return cls(**values)


class Bench(Generic[F]):
    """A benchmark's command line: its flags (``cls``), its run (``measure``, which gets
    the flags and gives an :class:`Outcome`, or an exit code when it wrote nothing), and
    the entry points :mod:`bench.catalog` asks for.

    ``run_from_args`` prints the outcome's text, writes its result to ``--json`` with the
    run's settings (:func:`bench.harness.report.write_result`) and returns its code.
    ``sigterm``: a SIGTERM unwinds the run (its stack stops every process it started);
    ``uvloop``: the run's event loops are uvloop's where it is installed; ``markdown``: the
    Markdown table of a result, printed again from a stored run by ``--report PATH``."""

    def __init__(
        self,
        cls: type[F],
        measure: Callable[[F], Outcome | int],
        *,
        prog: str,
        description: str | None,
        quick_help: str = "",
        sigterm: bool = True,
        raw_description: bool = False,
        markdown: Callable[[dict[str, Any]], str] | None = None,
        uvloop: bool = False,
    ) -> None:
        self.cls = cls
        self.measure = measure
        self.prog = prog
        self.description = description
        self.quick_help = quick_help
        self.sigterm = sigterm
        self.raw_description = raw_description
        self.markdown = markdown
        self.uvloop = uvloop

    @property
    def module(self) -> str:
        return self.prog.removeprefix("python -m ")

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, self.cls, self.quick_help)
        if self.markdown is not None:
            parser.add_argument(
                "--report", metavar="PATH", help="print the Markdown table of a --json result"
            )

    def flags(self, args: argparse.Namespace) -> F:
        return parse_flags(self.cls, args)

    def run_from_args(self, args: argparse.Namespace) -> int:
        if self.markdown is not None and getattr(args, "report", None):
            try:
                print(self.markdown(read_result(args.report)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"{self.name}: cannot read {args.report}: {exc!r}", file=sys.stderr)
                return 2
            return 0
        if self.sigterm:
            runtime.exit_on_sigterm()  # a killed run still stops what it started
        try:
            flags = self.flags(args)
        except FlagError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if self.uvloop:  # the clients on uvloop where it is installed
            with contextlib.suppress(ImportError):
                import uvloop

                uvloop.install()
        out = self.measure(flags)
        if isinstance(out, int):
            return out
        if out.text:
            print(out.text, flush=True)
        if flags.json is not None:
            write_result(flags.json, out.result, flags, bench=self.module)
        return out.code

    def parser(self) -> argparse.ArgumentParser:
        fmt = (
            argparse.RawDescriptionHelpFormatter if self.raw_description else argparse.HelpFormatter
        )
        ap = argparse.ArgumentParser(
            prog=self.prog, description=self.description, formatter_class=fmt
        )
        self.add_arguments(ap)
        return ap

    def main(self, argv: Sequence[str] | None = None) -> int:
        return self.run_from_args(self.parser().parse_args(argv))
