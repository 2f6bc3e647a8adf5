"""The producer benchmarks: the soak's frame check (pure: it must find a frame that
differs from the backlog), and tiny runs of both on the session's cluster (the CPU
comparison's producers all write their turns; the soak's counters are all 0)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.producer import cpu, soak
from devstack.cluster.launcher import ClusterInfo
from tests.support.npm import npm_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def node_packages() -> str | None:
    """clients/producer's packages installed (``npm ci``) if they can be; else why not."""
    return await npm_ready(cpu.PACKAGE, "ioredis")


def _frame(off: int, text: str, kind: str = "token") -> dict[str, Any]:
    return {"offset": off, "kind": kind, "turn": 1, "epoch": 2, "text": text, "meta": None}


def test_the_frame_check_finds_what_differs_from_the_backlog() -> None:
    log = {o: _frame(o, t) for o, t in ((1, ""), (2, "a"), (3, "b"), (4, "c"))}
    log[1]["kind"] = "meta"
    got = soak.FrameLog()
    merged = {**_frame(4, "bc"), "meta": {"merged": 2, "from": 3}}
    for f in (_frame(1, "", "meta"), _frame(2, "a"), merged):
        got.on_frame(None, f)  # type: ignore[arg-type]
    assert soak.check_frames(log, got)[:2] == (3, 0)
    got.on_frame(None, _frame(2, "x"))  # type: ignore[arg-type]
    got.on_frame(None, {**_frame(5, "d")})  # type: ignore[arg-type]
    checked, bad, samples = soak.check_frames(log, got)
    assert (checked, bad) == (4, 2)
    assert samples[0].startswith("offset 2:")


def _args(mod: Any, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.timeout(300)
def test_a_tiny_cpu_comparison(
    cluster: ClusterInfo, tmp_path: Path, node_packages: str | None
) -> None:
    out = tmp_path / "cpu.json"
    args = _args(cpu, "--redis", cluster.url, "--streams", "2", "--tokens", "10", "--rate",
                 "200", "--repeats", "1", "--json", str(out))  # fmt: skip
    assert cpu.run_from_args(args) == 0
    res = json.loads(out.read_text())
    impls = {"publisher", "python"} | ({"node"} if cpu.node_missing() is None else set())
    for s in res["settings"]:
        assert set(s["producers"]) == impls
        for row in s["producers"].values():
            assert row["cpu_us_per_token"] > 0
            # every delta written: one frame each without coalescing, plus meta and done
            if s["max_tokens"] == 1:
                assert row["frames_per_token"] == pytest.approx(12 / 10)
    assert "| coalesce 8/50ms | python |" in cpu.report(res)


@pytest.mark.timeout(300)
def test_a_tiny_soak_counts_nothing_wrong(
    cluster: ClusterInfo, tmp_path: Path, node_packages: str | None
) -> None:
    if (why := node_packages or cpu.node_missing()) is not None:
        pytest.skip(why)
    out = tmp_path / "soak.json"
    args = _args(soak, "--redis", cluster.url, "--viewers", "8", "--sessions", "2",
                 "--duration-s", "1.5", "--reply-min", "5", "--reply-max", "15",
                 "--json", str(out))  # fmt: skip
    assert soak.run_from_args(args) == 0
    res = json.loads(out.read_text())
    assert res["frames_checked"] > 8 * 10
    assert res["viewers_connected_at_start"] == 8
    for k in ("lost", "duplicated", "out_of_order", "mismatched", "content_mismatches"):
        assert res[k] == 0, k
    assert "| lost / duplicated / out of order | 0 / 0 / 0 |" in soak.report(res)
