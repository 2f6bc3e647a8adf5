"""The layout's rules, checked by reading the source (ast only: no import, no I/O).

What is checked, and where the rule is written down:

- which package may import which (CONTRIBUTING.md, "Which package may import which"),
  and inside relay which layer may import which (the broker below the edge; the edge's
  core <- fanout <- conn <- http, only http knowing the Redis broker);
  each front is a unit: a front's folder (``relay/fronts/<front>/``, ``worker/fronts/<front>/``,
  ``relay/durable/``) imports no other front, and only the apps import a front (the worker's
  side of a front may import the relay's side of the same front, for its pure wire); a
  front's folder is named by the route table's ``Front``;
  ``relay`` never imports ``worker``, ``devstack``, ``tokenrelay``, ``bench`` or ``tests``;
  ``worker`` never imports ``devstack``, ``tokenrelay``, ``bench`` or ``tests``; no
  product package imports ``bench`` or ``tests``; ``relay/protocol`` imports nothing
  outside itself but the standard library and its few small dependencies;
- the pure cores (the modules the Layout map (docs/LAYOUT.md) marks ``pure``) import no I/O
  library and read no time of day;
- no import cycle between product modules, counting every import (``from pkg import
  mod`` included): one under ``TYPE_CHECKING`` or deferred into a function dodges the
  circular import at run time but leaves two modules that cannot be read, tested or
  moved one without the other;
- no module in ``relay/`` or ``worker/`` over 500 lines unless the Layout map
  (docs/LAYOUT.md) names it with a reason;
- every product package and module that the Layout map, docs/ARCHITECTURE.md and
  the other docs name exists (a backticked ``relay.edge.fanout.hub.Hub.open`` down to the
  method, a path to a ``.py`` file anywhere), and every product package and module
  appears in the Layout map (a new module cannot land without its line there).

Every rule reports every offender at once, with the file and line.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("relay", "worker", "devstack", "tokenrelay")
MAX_LINES = 500

# Who may not import whom (every import counts, wherever it is in the module).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "relay": ("worker", "devstack", "tokenrelay", "bench", "tests"),
    "worker": ("devstack", "tokenrelay", "bench", "tests"),
    "devstack": ("tokenrelay", "bench", "tests"),
    "tokenrelay": ("relay", "worker", "devstack", "bench", "tests"),
}
# Inside relay, what may not import what (CONTRIBUTING.md, "Inside relay"): the store is
# below the edge; the edge's layers go core <- fanout <- conn <- http, and only the app
# (http) knows which broker it runs on.
INSIDE_RELAY: dict[str, tuple[str, ...]] = {
    "relay.broker": ("relay.edge", "relay.client", "relay.fronts", "relay.durable"),
    "relay.edge.core": ("relay.edge.fanout", "relay.edge.conn", "relay.edge.http",
                        "relay.broker", "relay.fronts", "relay.durable"),
    "relay.edge.fanout": ("relay.edge.conn", "relay.edge.http", "relay.broker.rediscluster",
                          "relay.broker.memory", "relay.fronts", "relay.durable"),
    "relay.edge.conn": ("relay.edge.http", "relay.broker.rediscluster", "relay.broker.memory",
                        "relay.fronts", "relay.durable"),
    "relay.fronts": ("relay.edge.http.app",),
    "relay.durable": ("relay.edge.http.app",),
}  # fmt: skip
# The fronts (CONTRIBUTING.md, "The fronts"): one folder per front and side, named by the
# route table's Front; these modules register them, and only they may import a front.
FRONT_ROOTS = ("relay.fronts", "worker.fronts")
FRONT_APPS = ("relay.edge.http.app", "worker.api")
DURABLE_FRONT = "relay.durable"  # Durable Streams: one folder, read and write, on the relays
# relay/protocol: the standard library, relay.protocol itself, and these.
PROTOCOL_DEPS = ("msgspec", "jwt", "cryptography", "redis.crc")
# A pure module imports none of these (redis.crc is the cluster's CRC16: a pure function).
IO_MODULES = (
    "asyncio", "aiohttp", "aio_pika", "aiormq", "redis", "hiredis", "httpx", "requests",
    "websockets", "uvloop", "socket", "ssl", "selectors", "subprocess", "signal",
    "threading", "multiprocessing", "concurrent", "http", "urllib.request", "os",
    "pathlib", "shutil", "tempfile", "logging", "prometheus_client",
)  # fmt: skip
IO_ALLOWED = ("redis.crc",)
# Reading the time of day; a pure core takes ``now`` as an argument (monotonic clocks,
# which are not the time of day, are for shells too).
WALL_CLOCK = {
    ("time", "time"), ("time", "time_ns"), ("time", "localtime"), ("time", "gmtime"),
    ("time", "ctime"), ("time", "asctime"), ("time", "strftime"),
    ("datetime", "now"), ("datetime", "utcnow"), ("datetime", "today"), ("date", "today"),
}  # fmt: skip
# The only functions of pure modules that read the time of day, and why.
WALL_CLOCK_ALLOWED: dict[tuple[str, str], str] = {
    ("relay.protocol.frame", "now_ms"): "a frame's ts is wall-clock Unix ms by contract",
    ("worker.fronts.openai.wire", "completion"): "OpenAI's created is Unix seconds",
}
# Backticked names in the docs that look like modules but are not: the entry-point
# group, the job queues' names.
NOT_MODULES = {"tokenrelay.commands", "tokenrelay.jobs", "tokenrelay.jobs.dead"}


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (dotted), resolved against the tree
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def sources() -> dict[str, Path]:
    """Every module of the product packages, bench and tests, by dotted name."""
    out: dict[str, Path] = {}
    for top in (*PRODUCT, "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not (path.parent / "__init__.py").exists():
                continue  # data shipped beside a package (demo static files, fixtures)
            out[_module_name(path)] = path
    return out


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = module.split(".")
    if sources()[module].name != "__init__.py":
        pkg = pkg[:-1]
    pkg = pkg[: len(pkg) - (node.level - 1)]
    return ".".join([*pkg, node.module] if node.module else pkg)


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(sources()[module].read_text(), str(sources()[module]))


@cache
def imports(module: str) -> tuple[Import, ...]:
    """Every import statement of ``module``, wherever it is (module level, under
    ``TYPE_CHECKING``, inside a function)."""
    out: list[Import] = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            out += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(Import(sub if _is_module(sub) else base, node.lineno))
    return tuple(sorted(set(out), key=lambda i: (i.line, i.target)))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _where(module: str, line: int) -> str:
    return f"{sources()[module].relative_to(ROOT)}:{line}"


def product_modules() -> list[str]:
    return [m for m in sources() if m.split(".")[0] in PRODUCT]


# -- which package may import which ---------------------------------------------------


def test_packages_import_only_what_they_may() -> None:
    bad = [
        f"{_where(m, imp.line)}: {m} imports {imp.target}"
        for m in product_modules()
        for imp in imports(m)
        for other in FORBIDDEN[m.split(".")[0]]
        if _under(imp.target, other)
    ]
    assert not bad, "imports against the layout (CONTRIBUTING.md):\n" + "\n".join(bad)


def test_inside_relay_the_layers_import_only_downwards() -> None:
    bad = [
        f"{_where(m, imp.line)}: {m} imports {imp.target}"
        for m in product_modules()
        for layer, banned in INSIDE_RELAY.items()
        if _under(m, layer)
        for imp in imports(m)
        for other in banned
        if _under(imp.target, other)
    ]
    assert not bad, "imports against relay's layers (CONTRIBUTING.md):\n" + "\n".join(bad)


# Only the Redis store imports redis-py in relay and worker (and the protocol's slot map
# its CRC16): everything else reaches the store through its port.
REDIS_ALLOWED = ("relay.broker.rediscluster",)


def test_only_the_redis_store_imports_redis() -> None:
    bad = [
        f"{_where(m, imp.line)}: {m} imports {imp.target}"
        for m in product_modules()
        if m.split(".")[0] in ("relay", "worker") and not any(_under(m, ok) for ok in REDIS_ALLOWED)
        for imp in imports(m)
        if _under(imp.target, "redis")
    ]
    assert not bad, "redis imported outside the Redis store:\n" + "\n".join(bad)


def front_packages() -> list[str]:
    """Every front's folder, as a dotted package: relay.fronts.aisdk, worker.fronts.openai, ..."""
    out = [DURABLE_FRONT]
    for root in FRONT_ROOTS:
        base = ROOT.joinpath(*root.split("."))
        out += [f"{root}.{p.parent.name}" for p in sorted(base.glob("*/__init__.py"))]
    return out


def _front_of(module: str) -> str | None:
    return next((f for f in front_packages() if _under(module, f)), None)


def _may_import_front(module: str, front: str) -> bool:
    """A front is imported by itself, by the apps that register it, and by the worker's
    side of the same front (the relay's side holds the pure wire both write)."""
    if _under(module, front) or module in FRONT_APPS:
        return True
    mine = _front_of(module)
    return (
        mine is not None
        and mine.startswith("worker.fronts.")
        and front == "relay.fronts." + mine.rsplit(".", 1)[1]
    )


def test_a_front_is_a_unit_imported_only_by_the_apps() -> None:
    fronts = front_packages()
    assert {"relay.fronts.aisdk", "relay.fronts.responses", "worker.fronts.openai"} <= set(fronts)
    bad = [
        f"{_where(m, imp.line)}: {m} imports {imp.target} (the front {front})"
        for m in product_modules()
        for imp in imports(m)
        if (front := _front_of(imp.target)) is not None and not _may_import_front(m, front)
    ]
    assert not bad, "a front imported outside its apps (CONTRIBUTING.md):\n" + "\n".join(bad)


def _route_table_fronts() -> set[str]:
    """The values of relay.service.routes.Front, read from its source."""
    for node in tree("relay.service.routes").body:
        if isinstance(node, ast.ClassDef) and node.name == "Front":
            return {
                str(stmt.value.value)
                for stmt in node.body
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
            }
    raise AssertionError("relay/service/routes.py has no class Front")


def test_a_front_folder_is_named_by_the_route_table() -> None:
    names = _route_table_fronts()
    bad = [f for f in front_packages() if f != DURABLE_FRONT and f.rsplit(".", 1)[1] not in names]
    assert not bad, f"front folders the route table's Front does not name ({sorted(names)}): {bad}"


def _stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


def test_protocol_imports_only_itself_the_standard_library_and_its_small_deps() -> None:
    protocol = [m for m in sources() if _under(m, "relay.protocol")]
    assert len(protocol) > 3
    bad = [
        f"{_where(m, imp.line)}: {m} imports {imp.target}"
        for m in protocol
        for imp in imports(m)
        if not _stdlib(imp.target)
        and not _under(imp.target, "relay.protocol")
        and not any(_under(imp.target, d) for d in PROTOCOL_DEPS)
    ]
    assert not bad, "relay/protocol reaches outside itself:\n" + "\n".join(bad)


# -- pure cores -----------------------------------------------------------------------


LAYOUT = "docs/LAYOUT.md"


def _layout() -> str:
    text = (ROOT / LAYOUT).read_text()
    assert text.startswith("# Layout\n"), f"{LAYOUT} does not start with its # Layout title"
    return text.split("\n", 1)[1]


@dataclass(frozen=True)
class MapEntry:
    path: str  # repository-relative, "relay/edge/" for a package, "relay/edge/fanout/hub.py"
    pure: bool
    line: str


def layout_map() -> list[MapEntry]:
    """The entries of the first code block of docs/LAYOUT.md.

    An indented line that starts with ``name/`` is a folder inside the folder above it;
    ``name.py`` words on a line are modules of the folder the line sits in (a word with
    a ``/`` is a path from the repository root). A line whose description (after two or
    more spaces) starts with ``pure`` declares its modules pure cores.
    """
    block = _layout().split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    out: list[MapEntry] = []
    for raw in block.splitlines()[1:]:
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        here = stack[-1][1] if stack else ""
        names, _, desc = raw.strip().partition("  ")
        words = names.split()
        if words and words[0].endswith("/") and not words[0].startswith("."):
            here = here + words[0]
            stack.append((indent, here))
            out.append(MapEntry(here, False, raw))
            words = words[1:]
        pure = desc.strip().startswith("pure")
        for w in words:
            if w.endswith(".py"):
                out.append(MapEntry(w if "/" in w else here + w, pure, raw))
    return out


def pure_modules() -> list[str]:
    return [_module_name(ROOT / e.path) for e in layout_map() if e.pure]


def test_the_layout_map_declares_pure_cores() -> None:
    pure = pure_modules()
    assert len(pure) >= 10, f"the Layout map (docs/LAYOUT.md) marks too few modules pure: {pure}"
    assert {"relay.protocol.frame", "relay.edge.core.resume", "relay.edge.core.watch"} <= set(pure)


def _wall_clock_reads(module: str) -> Iterator[tuple[int, str]]:
    """(line, enclosing function) of every time-of-day read in ``module``."""

    def visit(node: ast.AST, func: str) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and isinstance(child.func.value, ast.Name | ast.Attribute)
            ):
                owner = child.func.value
                owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr
                if (owner_name, child.func.attr) in WALL_CLOCK:
                    yield child.lineno, func
            if isinstance(child, ast.ImportFrom) and child.module in ("time", "datetime"):
                for alias in child.names:
                    if (child.module, alias.name) in WALL_CLOCK:
                        yield child.lineno, func
            yield from visit(child, name)

    yield from visit(tree(module), "")


def test_pure_cores_do_no_io_and_read_no_time_of_day() -> None:
    bad = []
    for m in pure_modules():
        assert m in sources(), f"the Layout map marks {m} pure, but there is no such module"
        for imp in imports(m):
            if any(_under(imp.target, io) for io in IO_MODULES) and not any(
                _under(imp.target, ok) for ok in IO_ALLOWED
            ):
                bad.append(f"{_where(m, imp.line)}: pure {m} imports {imp.target}")
        for line, func in _wall_clock_reads(m):
            if (m, func) not in WALL_CLOCK_ALLOWED:
                where = f"in {func}()" if func else "at module level"
                bad.append(f"{_where(m, line)}: pure {m} reads the time of day {where}")
    assert not bad, "pure cores doing I/O:\n" + "\n".join(bad)


# -- cycles ---------------------------------------------------------------------------


def import_graph() -> dict[str, set[str]]:
    mods = set(product_modules())
    return {m: {i.target for i in imports(m) if i.target in mods and i.target != m} for m in mods}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph[root]))))
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_product_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles between product modules:\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


# -- sizes ----------------------------------------------------------------------------


def over_limit_reasons() -> dict[str, str]:
    """Modules the Layout allows past the limit: after a line "Over 500 lines", bullets
    ``- `path`: reason`` (until a blank line)."""
    text = _layout()
    out: dict[str, str] = {}
    if (at := text.find(f"Over {MAX_LINES} lines")) < 0:
        return out
    for line in text[at:].split("\n\n", 1)[0].splitlines()[1:]:
        if m := re.match(r"- `([^`]+\.py)`[^:]*:\s*(\S.*)", line.strip()):
            out[m[1]] = m[2]
    return out


def test_no_module_in_relay_or_worker_is_over_the_limit_without_a_reason() -> None:
    allowed = over_limit_reasons()
    long = {
        str(p.relative_to(ROOT)): n
        for m, p in sources().items()
        if m.split(".")[0] in ("relay", "worker")
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    bad = [f"{p}: {n} lines" for p, n in sorted(long.items()) if p not in allowed]
    assert not bad, (
        f"modules over {MAX_LINES} lines that the Layout (docs/LAYOUT.md) does not explain:\n"
        + "\n".join(bad)
    )
    stale = sorted(set(allowed) - set(long))
    assert not stale, f"the Layout explains a length these modules no longer have: {stale}"


# -- the docs name what exists --------------------------------------------------------


DOCS = (
    "docs/LAYOUT.md#map",
    "README.md",
    "docs/OVERVIEW.md",
    "docs/HTTP.md",
    "docs/DEMO.md",
    "docs/DEPLOY.md",
    "docs/METRICS.md",
    "docs/DEVELOPMENT.md",
    "docs/ARCHITECTURE.md",
    "docs/PROTOCOL.md",
    "CONTRIBUTING.md",
    "RELIABILITY.md",
    "bench/README.md",
    "docs/ROUTING.md",
    "docs/WORKER.md",
)


def _doc_text(doc: str) -> str:
    return _layout() if doc == "docs/LAYOUT.md#map" else (ROOT / doc).read_text()


def _top_level_names(module: str) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
    return names


def _class_names(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def dangling(name: str) -> str | None:
    """Why a name a doc gives (``relay/edge/fanout/hub.py``, ``relay/edge/``,
    ``relay.edge.fanout.hub.Hub.open``) does not exist, or None."""
    if "/" in name:
        return None if (ROOT / name).exists() else "no such file or folder"
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in sources():
            break
    else:
        return "no such module"
    rest = parts[i:]
    if not rest:
        return None
    top = _top_level_names(mod)
    if rest[0] not in top:
        return f"{mod} has no {rest[0]}"
    node = top[rest[0]]
    if len(rest) > 1:
        if not isinstance(node, ast.ClassDef):
            return f"{mod}.{rest[0]} is not a class"
        if rest[1] not in _class_names(node):
            return f"{mod}.{rest[0]} has no {rest[1]}"
    return None


_NAMED = re.compile(r"`((?:relay|worker|devstack|tokenrelay)[./][^`\s(]*)")
_PATH = re.compile(r"(?<![\w/.-])((?:relay|worker|devstack|tokenrelay)/[\w/]*\w\.py)\b")
_FILE = re.compile(r"\.(js|cjs|mjs|json|ya?ml|md|html|css|png|txt)$")


def named_in(doc: str) -> list[str]:
    """Backticked module, attribute and path names, and paths to .py files anywhere."""
    text = _doc_text(doc)
    names = [n.rstrip(".:,") for n in _NAMED.findall(text)] + _PATH.findall(text)
    return [n for n in names if n not in NOT_MODULES and ("/" in n or not _FILE.search(n))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_a_doc_names_exists(doc: str) -> None:
    names = named_in(doc)
    if doc != "docs/LAYOUT.md#map":  # the map names its modules unquoted: checked below
        assert names, f"{doc} names no module"
    bad = [f"{n}: {why}" for n in dict.fromkeys(names) if (why := dangling(n))]
    assert not bad, f"{doc} names what does not exist:\n" + "\n".join(bad)


def test_the_layout_map_matches_the_tree() -> None:
    entries = layout_map()
    missing = [
        f"{e.path}  (line: {e.line.strip()})" for e in entries if not (ROOT / e.path).exists()
    ]
    assert not missing, "the Layout map (docs/LAYOUT.md) names what does not exist:\n" + "\n".join(
        missing
    )
    mapped = {e.path for e in entries}
    packages = sorted(
        str(p.parent.relative_to(ROOT)) + "/"
        for top in PRODUCT
        for p in (ROOT / top).rglob("__init__.py")
    )
    absent = [p for p in packages if p not in mapped]
    assert not absent, (
        "product packages missing from the Layout map (docs/LAYOUT.md):\n" + "\n".join(absent)
    )
    modules = sorted(
        str(p.relative_to(ROOT))
        for top in PRODUCT
        for p in (ROOT / top).rglob("*.py")
        if p.name != "__init__.py" and (p.parent / "__init__.py").exists()
    )
    unmapped = [m for m in modules if m not in mapped]
    assert not unmapped, (
        "product modules the Layout map (docs/LAYOUT.md) does not name (every module has a line "
        "that says what it holds):\n" + "\n".join(unmapped)
    )
