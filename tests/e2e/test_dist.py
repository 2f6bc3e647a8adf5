"""The packages an app installs, as it installs them: ``make dist`` builds the wheel, the
sdist and the npm tarball of ``@tokenrelay/producer`` (into a folder of the test's), and
each goes into a fresh environment in a temporary folder outside the checkout, from the
artifact and the registry only (nothing of this checkout on any path):

- Python: a new venv, ``pip install <wheel> openai`` into it. The app's install holds none of
  the servers' dependencies (the ``server`` extra), ``relay`` is imported from the venv,
  and the sdist carries every file the wheel does.
- Node: a new project, ``npm install <tarball> ai @ai-sdk/openai`` (``ai`` 6 on Node 20,
  ``ai`` 7 from Node 22: what the README states; the Node that runs is this machine's).

Then each streams a turn: README.md's "Stream from your own backend" block of its
language, unmodified, run as the README says (``set -a; . backend.env; set +a``, the file
the demo writes, made here by the same code from a live stack: relays, a worker and its
OpenAI gateway over mock engines, behind the demo's front door). An SSE viewer of the
front door, with the token the program printed, must read the reply it printed.

pip and npm need their registries (their caches make a second run fast): where one does
not answer, that half skips with the reason; any other failure fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.backend import backend_env, write_env_file
from devstack.demo.stack import Stack
from tests.e2e.test_examples import example
from tests.e2e.test_producer_examples import watch
from tests.support import demo as demo_harness
from tests.support.cli import Ran, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "dist-gateway-key-0123456789abcdef"
SERVER = ("aiohttp", "orjson", "mmh3", "uvloop")  # the server extra: not in an app
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is "
           "unreachable", "ConnectTimeout", "ProxyError", "ENOTFOUND", "EAI_AGAIN",
           "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "network request")  # fmt: skip


def _env(home: Path, **extra: str) -> dict[str, str]:
    """An environment with nothing of this checkout: PATH (the system's tools), HOME
    (pip's and npm's caches), a TMPDIR of the test's."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "TMPDIR": str(home), "LANG": "C.UTF-8", **extra}  # fmt: skip


def _bare(*argv: str) -> list[str]:
    """``argv`` without ``PYTHONPATH``: the children of a test get this checkout on it
    (devstack.procs.child_env), an app's programs do not."""
    return ["env", "-u", "PYTHONPATH", *argv]


def _skip_if_offline(ran: Ran, what: str) -> None:
    said = ran.out + ran.err
    if ran.code != 0 and any(s in said for s in OFFLINE):
        pytest.skip(f"{what}: the registry does not answer here: {said.strip()[-300:]}")


@pytest.fixture(scope="module")
async def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make dist`` into a folder of the test's (this venv's python; its stamp not
    redone), run in a copy of what it reads: the build writes nothing into the checkout,
    where another test packs the npm package at the same time."""
    if shutil.which("make") is None or shutil.which("npm") is None:
        pytest.skip("needs make and npm")
    out, src = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("src")
    for name in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "node_modules", "lua", "*.tgz")
    for pkg in ("relay", "worker", "tokenrelay"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "clients" / "producer", src / "clients" / "producer", ignore=skip)
    bindir = Path(sys.executable).parent
    ran = await run_cli(
        ["make", "-o", ".venv/.installed-demo", "dist", f"DIST={out}", f"BIN={bindir}"],
        cwd=src, timeout_s=600, merge=True, env=os.environ,
    )  # fmt: skip
    _skip_if_offline(ran, "make dist")
    assert ran.code == 0, ran.out[-4000:]
    return out


@pytest.fixture(scope="module")
async def stack(cluster: ClusterInfo) -> AsyncIterator[tuple[str, Stack]]:
    async with demo_harness.front_door(cluster, decode_tok_per_s=200, gateway_keys=[KEY]) as door:
        yield door


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, (pattern, sorted(p.name for p in folder.iterdir()))
    return found[0]


def test_the_sdist_carries_what_the_wheel_does(dist: Path) -> None:
    wheel, sdist = _one(dist, "tokenrelay-*.whl"), _one(dist, "tokenrelay-*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if ".dist-info/" not in n}
    with tarfile.open(sdist) as t:
        root = t.getnames()[0].split("/")[0]
        carried = {n.removeprefix(root + "/") for n in t.getnames()}
    assert shipped <= carried, sorted(shipped - carried)
    assert {"relay/broker/rediscluster/lua/publish.lua", "relay/service/openapi.json",
            "relay/producer/__init__.py"} <= shipped  # fmt: skip
    assert not [n for n in shipped if n.startswith(("devstack/", "bench/", "tests/"))]


async def _run_backend(program: list[str], cwd: Path, env_file: Path, env: dict[str, str],
                       base: str) -> None:  # fmt: skip
    """The README's way: the demo's settings into the shell, then the program; what it
    printed must be what a viewer of the session reads."""
    script = f'set -a; . "{env_file}"; set +a; exec "$@"'
    ran = await run_cli(_bare("bash", "-c", script, "backend", *program), cwd=cwd, timeout_s=120,
                        env=env)  # fmt: skip
    assert ran.code == 0, ran.out[-3000:] + ran.err[-3000:]
    first, *_, printed = ran.out.strip().splitlines()
    sid, token = first.split(" ")
    reply, done = await watch(base, sid, token)
    assert reply == printed
    assert len(reply) > 20, reply
    assert done["meta"]["chars"] == len(reply)


async def test_the_wheel_in_a_fresh_venv_streams_the_readme_python_block(
    dist: Path, stack: tuple[str, Stack], cluster: ClusterInfo, tmp_path: Path
) -> None:
    base, st = stack
    app, home = tmp_path / "app", tmp_path / "tmp"
    app.mkdir()
    home.mkdir()
    env = _env(home)
    # a venv of its own, filled by this interpreter's pip (--python: no ensurepip, no
    # bytecode compiled: a minute less on a small machine; the same packages installed)
    made = await run_cli(_bare(sys.executable, "-m", "venv", "--without-pip", str(app / "venv")),
                         timeout_s=120, env=env)  # fmt: skip
    assert made.code == 0, made.err
    python = app / "venv" / "bin" / "python"
    wheel = _one(dist, "tokenrelay-*.whl")
    ran = await run_cli(_bare(sys.executable, "-m", "pip", "--python", str(python), "install",
                              "-q", "--no-compile", str(wheel), "openai"),
                        cwd=app, timeout_s=600, merge=True, env=env)  # fmt: skip
    _skip_if_offline(ran, "pip install")
    assert ran.code == 0, ran.out[-4000:]
    # an app's install: no server dependency, the package from the venv
    probe = (
        "import importlib.util, relay.producer\n"
        f"print([m for m in {SERVER!r} if importlib.util.find_spec(m)])\n"
        "print(relay.producer.__file__)\n"
    )
    ran = await run_cli(_bare(str(python), "-c", probe), cwd=app, timeout_s=60, env=env)
    assert ran.code == 0, ran.err
    missing, where = ran.out.splitlines()
    assert missing == "[]", missing
    assert where.startswith(str(app / "venv")), where
    (app / "backend.py").write_text(example("producer-py"))
    env_file = write_env_file(home, backend_env(cluster.url, st.spec.secret, base, KEY,
                                                st.spec.model))  # fmt: skip
    await _run_backend([str(python), "backend.py"], app, env_file, env, base)


async def test_the_npm_tarball_in_a_fresh_project_streams_the_readme_typescript_block(
    dist: Path, stack: tuple[str, Stack], cluster: ClusterInfo, tmp_path: Path
) -> None:
    base, st = stack
    app, home = tmp_path / "app", tmp_path / "tmp"
    app.mkdir()
    home.mkdir()
    env = _env(home, npm_config_prefer_offline="true", npm_config_audit="false",
               npm_config_fund="false", npm_config_update_notifier="false")  # fmt: skip
    node = shutil.which("node") or "node"
    version = await run_cli([node, "--version"], timeout_s=30, env=env)
    major = int(version.out.strip().lstrip("v").split(".")[0])
    assert major >= 20, f"@tokenrelay/producer states Node >= 20; this is {version.out}"
    sdk = ["ai@7", "@ai-sdk/openai@4"] if major >= 22 else ["ai@6", "@ai-sdk/openai@3"]
    tarball = _one(dist, "tokenrelay-producer-*.tgz")
    (app / "package.json").write_text('{"name": "app", "version": "1.0.0", "private": true}\n')
    ran = await run_cli(["npm", "install", str(tarball), *sdk], cwd=app, timeout_s=600,
                        merge=True, env=env)  # fmt: skip
    _skip_if_offline(ran, "npm install")
    assert ran.code == 0, ran.out[-4000:]
    assert "EBADENGINE" not in ran.out, ran.out[-3000:]  # every package takes this Node
    installed = app / "node_modules" / "@tokenrelay" / "producer"
    assert installed.is_dir()
    assert not installed.is_symlink()
    assert (installed / "lua" / "publish.lua").is_file()
    (app / "backend.mjs").write_text(example("producer-ts"))
    env_file = write_env_file(home, backend_env(cluster.url, st.spec.secret, base, KEY,
                                                st.spec.model))  # fmt: skip
    await _run_backend([node, "backend.mjs"], app, env_file, env, base)
