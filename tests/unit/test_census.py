"""devstack.census reads a tree's structure figures from its files."""

from __future__ import annotations

from pathlib import Path

from devstack.census import census


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_census_counts_redis_importers_outside_the_store_and_the_wheels_lines(
    tmp_path: Path,
) -> None:
    _write(tmp_path, "pyproject.toml", """
[project]
dependencies = ["redis[hiredis]>=8.0", "PyJWT[crypto]>=2.8",
                "uvloop>=0.19; sys_platform != 'win32'"]
[project.optional-dependencies]
jobs = ["aio-pika>=9.4"]
[tool.setuptools.packages.find]
include = ["relay*"]
""")  # fmt: skip
    _write(tmp_path, "relay/__init__.py", "")
    _write(tmp_path, "relay/broker/rediscluster/store.py", "import redis\n")
    _write(tmp_path, "relay/a.py", "from redis.crc import key_slot\n")
    _write(tmp_path, "relay/b.py", "import os, redis.asyncio as r\n")
    _write(tmp_path, "relay/c.py", "import redisx\nfrom .redis import x\n# import redis\n")
    _write(tmp_path, "bench/__init__.py", "import redis\n\n")
    got = census(tmp_path)
    assert got["redis_importers"] == ["relay/a.py", "relay/b.py"]
    assert got["wheel_packages"] == ["relay"]
    assert got["lines"] == {"wheel": 6, "bench": 2, "devstack": 0}
    assert got["dependencies"] == ["PyJWT", "redis", "uvloop"]
    assert got["extras"] == ["jobs"]


def test_this_tree_has_no_redis_importer_outside_the_store() -> None:
    assert census(Path(__file__).resolve().parents[2])["redis_importers"] == []
