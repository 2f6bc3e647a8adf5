"""What the wheel ships (pyproject.toml): the product only, ``relay``, ``worker`` and the
``tokenrelay`` command, every subcommand of it inside them; the development stack and the
benchmarks run from a checkout (``python -m devstack``, ``python -m bench``).

The optional dependencies are extras: ``tokenrelay[jobs]`` (aio-pika) and
``tokenrelay[precise]`` (pyzmq). An edge install has neither, so:

- no module of the wheel imports them when it is imported (only where they are used,
  or under ``TYPE_CHECKING``): every subcommand's parser, and the relay and the worker
  without those flags, start without them;
- a flag that needs one refuses to start, in one line naming the extra, exit 2, never a
  traceback (the missing module simulated here: ``sys.modules[name] = None`` makes its
  import fail as an absent package does).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from relay.service.settings import ConfigError, require_extra
from tokenrelay.cli import main

ROOT = Path(__file__).resolve().parents[2]
# each extra, and the module it provides
EXTRAS = {"jobs": "aio_pika", "precise": "zmq"}
WHEEL = ("relay", "worker", "tokenrelay")
WORKER = ["worker", "--port", "0", "--redis", "redis://127.0.0.1:1", "--insecure-no-auth",
          "--engine", "http://127.0.0.1:9"]  # fmt: skip
AMQP = ["--amqp", "amqp://guest:guest@127.0.0.1:1/"]
KV = ["--routing", "precise", "--engine-kv-events", "e=tcp://127.0.0.1:5557"]


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules a module imports when it is imported: its body's imports, and those of its
    module-level blocks (if, try), but not ``if TYPE_CHECKING:`` nor inside functions
    and classes."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    visit(block)

    visit(tree.body)
    return out


def test_the_wheel_holds_the_product_and_its_commands_only() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert sorted(setuptools["packages"]["find"]["include"]) == sorted(f"{p}*" for p in WHEEL)
    assert all(pkg.split(".")[0] in WHEEL for pkg in setuptools["package-data"])
    commands = pyproject["project"]["entry-points"]["tokenrelay.commands"]
    scripts = pyproject["project"]["scripts"]
    for name, target in {**commands, **scripts}.items():
        assert target.split(".")[0] in WHEEL, f"{name} = {target}: not in the wheel"
    for top in ("devstack", "bench"):  # from a checkout
        assert (ROOT / top / "__main__.py").is_file(), f"python -m {top} runs nothing"


def test_the_extras_are_the_optional_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["jobs"] == ["aio-pika>=9.4"]
    assert extras["precise"] == ["pyzmq>=25"]
    required = " ".join(project["dependencies"])
    assert "aio-pika" not in required
    assert "pyzmq" not in required


def test_no_module_of_the_wheel_imports_an_extra_when_it_is_imported() -> None:
    bad = []
    for top in WHEEL:
        for path in sorted((ROOT / top).rglob("*.py")):
            imported = _top_level_imports(ast.parse(path.read_text(), str(path)))
            for extra, module in EXTRAS.items():
                if any(m == module or m.startswith(module + ".") for m in imported):
                    bad.append(f"{path.relative_to(ROOT)} imports {module} ({extra} extra)")
    assert not bad, "imported at module level (import it where it is used):\n" + "\n".join(bad)


def test_the_check_names_the_extra() -> None:
    require_extra("json", "jobs", "--amqp")  # installed: nothing to say
    said = r"--amqp needs the jobs extra: pip install 'tokenrelay\[jobs\]'"
    with pytest.raises(ConfigError, match=said):
        require_extra("no_such_module_here", "jobs", "--amqp")


@pytest.mark.parametrize(
    ("missing", "argv", "words"),
    [
        ("aio_pika", [*WORKER, *AMQP], "--amqp needs the jobs extra"),
        ("aio_pika", ["jobworker", "--redis", "redis://127.0.0.1:1", *AMQP, "--engine",
                      "http://127.0.0.1:9"], "tokenrelay jobworker needs the jobs extra"),
        ("zmq", [*WORKER, *KV], "--engine-kv-events needs the precise extra"),
    ],
    ids=["worker --amqp", "jobworker", "worker --engine-kv-events"],
)  # fmt: skip
def test_a_flag_without_its_extra_is_one_line_and_exit_2(
    missing: str,
    argv: list[str],
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(sys.modules):
        if name == missing or name.startswith(missing + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as a missing package does
    for var in ("TOKENRELAY_SECRET", "TOKENRELAY_KEYS_FILE", "TOKENRELAY_AMQP_URL"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: "), err
    assert words in err, err
    extra = words.split(" extra")[0].rsplit(" ", 1)[1]
    assert f"pip install 'tokenrelay[{extra}]'" in err, err
