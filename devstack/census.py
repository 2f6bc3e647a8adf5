"""A census of a checkout's structure: the figures a change of structure is judged by,
read from the files of any tree (this one or another's, for a before and after).

- ``redis_importers``: the modules of the wheel's packages that import redis outside the
  Redis store package (``relay/broker/rediscluster/``), read from their syntax trees;
- ``lines``: lines of Python in bench/, in devstack/ and in the packages pyproject.toml
  puts in the wheel (``[tool.setuptools.packages.find] include``), and which of bench and
  devstack the wheel holds;
- ``dependencies``: the names an install without extras pulls (``[project]
  dependencies``), and the extras.

Order of use: ``python -m devstack.census [--root TREE] [--json PATH]``; fronts reachable
through each front door are ``python -m devstack.doors`` (same ``--root``-style flags).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Final

__all__ = ["census", "main"]

STORE: Final = "relay/broker/rediscluster/"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _py(root: Path, folder: str) -> list[Path]:
    return sorted(p for p in (root / folder).rglob("*.py") if "node_modules" not in p.parts)


def _lines(paths: list[Path]) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in paths)


def _imports_redis(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] == "redis" for name in names):
            return True
    return False


def census(root: Path) -> dict[str, Any]:
    """The figures of the tree at ``root`` (see the module docstring)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(
        d.name
        for d in root.iterdir()
        if (d / "__init__.py").is_file() and any(fnmatch.fnmatch(d.name, pat) for pat in include)
    )
    wheel = [p for pkg in packages for p in _py(root, pkg)]
    importers = sorted(
        str(p.relative_to(root))
        for p in wheel
        if not str(p.relative_to(root)).startswith(STORE) and _imports_redis(p)
    )
    deps = project["project"]["dependencies"]
    return {
        "redis_importers": importers,
        "wheel_packages": packages,
        "lines": {
            "wheel": _lines(wheel),
            "bench": _lines(_py(root, "bench")),
            "devstack": _lines(_py(root, "devstack")),
        },
        "dependencies": sorted(m.group(0) for d in deps if (m := _NAME.match(d))),
        "extras": sorted(project["project"].get("optional-dependencies", {})),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.census", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("."), help="the tree (this one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    ns = parser.parse_args(argv)
    if not (ns.root / "pyproject.toml").is_file():
        print(f"error: {ns.root} has no pyproject.toml: not a checkout", file=sys.stderr)
        return 2
    got = census(ns.root)
    if ns.json:
        ns.json.write_text(json.dumps(got, indent=2) + "\n")
    lines = got["lines"]
    print(f"wheel packages: {', '.join(got['wheel_packages'])}")
    print(f"lines of Python: wheel {lines['wheel']:,}, bench {lines['bench']:,}, "
          f"devstack {lines['devstack']:,}")  # fmt: skip
    print(f"modules importing redis outside {STORE}: {len(got['redis_importers'])}")
    for name in got["redis_importers"]:
        print(f"  {name}")
    print(f"dependencies: {', '.join(got['dependencies'])}")
    print(f"extras: {', '.join(got['extras'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
