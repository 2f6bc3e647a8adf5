"""The TypeScript producer package (clients/producer): its own tests under Node's test
runner (pure parts; the AI SDK adapters with the real ``ai`` package and its mock model,
the stop and nobody-watching signals and the errors, against the session's cluster),
its type declarations under ``tsc``, and the npm package as published: ``npm pack``
copies the relay's Lua files into it (prepack), and the copy must be the source, byte
for byte, and run the very script the Python side runs (same SHA-1). The frame rules
are tests/conformance's, which drives this package too.

The npm packages install from clients/producer/package-lock.json (``npm ci``); where
node, npm or the registry is missing, these skip with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.scripts import PUBLISH, lua
from tests.support.cli import run_cli
from tests.support.npm import npm_ready

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "clients" / "producer"
LUA = ROOT / "relay" / "broker" / "rediscluster" / "lua"
NODE, NPM = shutil.which("node"), shutil.which("npm")


async def _ready() -> None:
    why = await npm_ready(PKG, "@langchain/core")  # the newest of its packages
    if why is not None:
        pytest.skip(why)


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            **extra}  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_the_package_tests_pass_against_the_cluster(cluster: ClusterInfo) -> None:
    await _ready()
    tests = sorted(str(p) for p in (PKG / "test").glob("*.test.js"))
    ran = await run_cli([NODE or "node", "--test", *tests], cwd=PKG, timeout_s=240, merge=True,
                        env=_env(TR_REDIS_URL=cluster.url, TR_PUBLISH_SHA=PUBLISH.sha))  # fmt: skip
    assert ran.code == 0, ran.out[-6000:]
    assert "# fail 0" in ran.out
    assert re.search(r"^# pass [1-9]", ran.out, re.M), ran.out[-3000:]
    assert "# skipped 0" in ran.out, ran.out[-3000:]


@pytest.mark.timeout(300)
async def test_the_type_declarations_check() -> None:
    await _ready()
    tsc = PKG / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        pytest.skip("typescript is not installed in clients/producer (npm ci)")
    ran = await run_cli([str(tsc), "--noEmit", "-p", "."], cwd=PKG, timeout_s=240, merge=True,
                        env=_env())  # fmt: skip
    assert ran.code == 0, ran.out[-4000:]


@pytest.mark.timeout(300)
async def test_the_packed_package_carries_the_relay_lua_files(tmp_path: Path) -> None:
    await _ready()
    ran = await run_cli([NPM or "npm", "pack", "--json", "--pack-destination", str(tmp_path)],
                        cwd=PKG, timeout_s=240, env=_env())  # fmt: skip
    assert ran.code == 0, ran.err[-3000:]
    packed = json.loads(ran.out[ran.out.index("[") :])[0]
    names = {f["path"] for f in packed["files"]}
    sources = sorted(p.name for p in LUA.glob("*.lua"))
    assert {f"lua/{n}" for n in sources} <= names
    # the copy beside the package (what npm packed) is the source, byte for byte
    for n in sources:
        assert (PKG / "lua" / n).read_bytes() == (LUA / n).read_bytes(), n
    # installed from the tarball (no repository around it) it loads its own copy and
    # runs the very publish script the Python side runs
    with tarfile.open(tmp_path / packed["filename"]) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    mods = tmp_path / "app" / "node_modules"
    (mods / "@tokenrelay").mkdir(parents=True)
    (tmp_path / "x" / "package").rename(mods / "@tokenrelay" / "producer")
    for dep in ("ioredis", "cluster-key-slot", "debug", "denque", "lodash.defaults",
                "lodash.isarguments", "ms", "redis-errors", "redis-parser",
                "standard-as-callback", "@ioredis"):  # fmt: skip
        if (PKG / "node_modules" / dep).exists():
            (mods / dep).symlink_to(PKG / "node_modules" / dep)
    probe = tmp_path / "app" / "probe.mjs"
    probe.write_text(
        "import { createHash } from 'node:crypto';\n"
        "import { LUA_DIR, scriptSource } from '@tokenrelay/producer';\n"
        "const sha = createHash('sha1').update(scriptSource('publish')).digest('hex');\n"
        "console.log(JSON.stringify({ dir: LUA_DIR, sha }));\n"
    )
    ran = await run_cli([NODE or "node", str(probe)], cwd=tmp_path / "app", timeout_s=60,
                        env=_env())  # fmt: skip
    assert ran.code == 0, ran.err[-3000:]
    out = json.loads(ran.out)
    assert out["dir"] == str(mods / "@tokenrelay" / "producer" / "lua")
    assert out["sha"] == PUBLISH.sha
    assert lua("publish") in (mods / "@tokenrelay" / "producer" / "lua" / "publish.lua").read_text()
