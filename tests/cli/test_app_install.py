"""An app's install (``pip install tokenrelay``, pyproject.toml's dependencies): the
producer API without the servers' dependencies (the ``server`` extra: aiohttp, orjson,
mmh3, uvloop). Each case is a child interpreter in which those modules cannot be
imported (``sys.modules[name] = None``, as an absent package), with this checkout's
metadata (a ``tokenrelay`` dist-info written from pyproject.toml, first on the path):

- ``relay.producer`` imports, and a producer is made (no Redis needed to build one);
- ``tokenrelay relay|worker|jobworker`` is one line naming the extra, exit 2, with or
  without flags; ``tokenrelay capacity`` (no server dependency) still runs; ``--help``
  lists every subcommand.

tests/e2e/test_dist.py installs the built wheel into a fresh venv and streams a turn.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.cli import clean_env, run_cli

ROOT = Path(__file__).resolve().parents[2]
SERVER = ("aiohttp", "orjson", "mmh3", "uvloop")
BLOCK = f"import sys; sys.modules.update(dict.fromkeys({SERVER!r}))\n"


def _dist_info(into: Path) -> Path:
    """A ``tokenrelay`` dist-info in ``into``: this checkout's requirements (extras
    included) and entry points, as the installed wheel has them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = into / f"tokenrelay-{project['version']}.dist-info"
    info.mkdir(parents=True)
    reqs = [f"Requires-Dist: {r}" for r in project["dependencies"]]
    for extra, deps in project["optional-dependencies"].items():
        reqs.append(f"Provides-Extra: {extra}")
        for dep in deps:
            marker = dep.split(";", 1)
            cond = f"({marker[1].strip()}) and " if len(marker) > 1 else ""
            reqs.append(f'Requires-Dist: {marker[0].strip()}; {cond}extra == "{extra}"')
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tokenrelay\n"
        f"Version: {project['version']}\n" + "\n".join(reqs) + "\n"
    )
    groups = {"console_scripts": project["scripts"], **project["entry-points"]}
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for g, eps in groups.items()
        )
    )
    return into


async def _python(code: str, meta: Path) -> tuple[int, str, str]:
    env = clean_env(PYTHONPATH=f"{meta}:{ROOT}")
    ran = await run_cli([sys.executable, "-c", BLOCK + code], env=env, timeout_s=60)
    return ran.code, ran.out, ran.err


def test_the_server_extra_holds_what_only_the_servers_import() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("[")[0].split(";")[0] for d in project["dependencies"]]
    server = [d.split(">")[0] for d in project["optional-dependencies"]["server"]]
    assert sorted(server) == sorted(SERVER)
    assert not set(names) & set(SERVER), names


async def test_the_producer_imports_and_runs_without_the_server_extra(tmp_path: Path) -> None:
    code = (
        "from relay.producer import Producer, pipe\n"
        "from relay.broker.memstore import MemoryStore\n"
        "import jwt\n"
        "p = Producer(MemoryStore(), keys='app-install-secret-5c1e9b7a3f2d8e6a0b4c')\n"
        "s = p.session('chat-42')\n"
        "print(s.id, jwt.decode(s.token(), options={'verify_signature': False})['sub'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{SERVER!r} and sys.modules[m] is not None))\n"
    )
    code_, out, err = await _python(code, _dist_info(tmp_path))
    assert code_ == 0, err
    assert out.splitlines() == ["chat-42 chat-42", "[]"], out


@pytest.mark.parametrize(
    "argv",
    [["relay"], ["relay", "--port", "0", "--redis", "redis://127.0.0.1:1"], ["worker", "--help"],
     ["jobworker"]],
    ids=["relay", "relay with flags", "worker --help", "jobworker"],
)  # fmt: skip
async def test_a_server_subcommand_without_the_extra_is_one_line_naming_it(
    argv: list[str], tmp_path: Path
) -> None:
    code = f"from tokenrelay.cli import main\nsys.exit(main({argv!r}))\n"
    code_, out, err = await _python(code, _dist_info(tmp_path))
    assert code_ == 2, (out, err)
    assert out == ""
    assert err == (
        f"error: tokenrelay {argv[0]} needs aiohttp, which is not installed: "
        "pip install 'tokenrelay[server]'\n"
    )


async def test_the_other_subcommands_still_run_and_help_lists_them_all(tmp_path: Path) -> None:
    meta = _dist_info(tmp_path)
    code = "from tokenrelay.cli import main\nsys.exit(main(['capacity', '--viewers', '1000']))\n"
    code_, out, err = await _python(code, meta)
    assert code_ == 0, err
    assert "relay" in out.lower(), out
    code = "from tokenrelay.cli import main\nsys.exit(main(['--help']))\n"
    code_, out, err = await _python(code, meta)
    assert code_ == 0, err
    for name in ("capacity", "jobworker", "relay", "worker"):
        assert name in out
    assert "relay               (not installed: needs aiohttp)" in out, out
