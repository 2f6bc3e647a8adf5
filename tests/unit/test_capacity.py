"""The capacity core (tokenrelay.capacity.core): the arithmetic of relays, Redis masters and
workers for a target, reading costs out of a pathcost result, and its refusals; and the
command's one-line exits on bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tokenrelay.capacity import cli
from tokenrelay.capacity.core import Assumptions, Costs, Target, costs_from_pathcost, plan, render

COSTS = Costs(producer_us=10.0, redis_masters_us=20.0, redis_replicas_us=8.0, relay_us=15.0,
              source="test")  # fmt: skip
A = Assumptions(cores_per_pod=1.0, utilisation=0.5, redis_core_ceiling=1.0,
                replicas_per_master=1, kb_per_conn=10.0, pod_memory_mb=1024.0)  # fmt: skip


def test_plan_arithmetic() -> None:
    p = plan(Target(100_000, 30.0, 10.0), COSTS, A)
    assert p.sessions == 10_000
    assert p.published_per_s == 300_000
    assert p.delivered_per_s == 3_000_000
    assert math.isclose(p.relay_cores, 45.0)  # 3M/s x 15 µs
    assert p.relays == 90  # 45 cores / (1 core x 0.5)
    assert p.relays_bound_by == "cpu"
    assert math.isclose(p.redis_master_cores, 6.0)  # 300k/s x 20 µs
    assert p.masters == 12
    assert p.replicas == 12
    assert math.isclose(p.worker_cores, 3.0)
    assert p.workers == 6


def test_coalescing_divides_the_frames() -> None:
    a4 = Assumptions(**{**A.__dict__, "tokens_per_frame": 4.0})
    target = Target(100_000, 30.0, 10.0)
    one, four = plan(target, COSTS, A), plan(target, COSTS, a4)
    assert four.published_per_s == one.published_per_s / 4
    assert math.isclose(four.relay_cores, one.relay_cores / 4)
    assert four.relay_memory_gb == one.relay_memory_gb


def test_memory_can_bind_the_relays() -> None:
    idle = Costs(0.0, 0.0, 0.0, 0.001, "test")
    p = plan(Target(1_000_000, 1.0, 1.0), idle, A)
    # 1M x 10 KB = 9,765.6 MB over 512 MB per pod
    assert p.relays == math.ceil(1_000_000 * 10 / 1024 / 512)
    assert p.relays_bound_by == "memory"
    assert p.masters == 1
    assert p.workers == 1


def test_replicas_can_need_more_masters() -> None:
    heavy = Costs(1.0, 1.0, 40.0, 1.0, "test")  # a replica costs more than its master
    p = plan(Target(10_000, 10.0, 1.0), heavy, A)  # 100k/s x 40 µs = 4 replica cores
    assert p.masters == 8
    assert p.replicas == 8


@pytest.mark.parametrize(
    ("target", "assume", "words"),
    [
        (Target(0, 30, 1), A, "viewers must be >= 1"),
        (Target(10, 0, 1), A, "tokens/s"),
        (Target(10, 30, 20), A, "viewers per session"),
        (Target(10, 30, 1), Assumptions(utilisation=1.5), "utilisation"),
        (Target(10, 30, 1), Assumptions(cores_per_pod=0), "cores_per_pod"),
        (Target(10, 30, 1), Assumptions(tokens_per_frame=0), "tokens_per_frame"),
    ],
)
def test_bad_input_is_refused(target: Target, assume: Assumptions, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        plan(target, COSTS, assume)


def _result() -> dict[str, Any]:
    def tr(viewers: int, rate: int, kept: bool, server: float) -> dict[str, Any]:
        return {"tokenrelay": {"kept_up": kept, "us_per_token": {"server": server},
                               "us_per_published": {"producer": rate / 1000, "redis_masters": 2.0,
                                                    "redis_replicas": 1.0}}}  # fmt: skip

    phases = {
        "a": {"kind": "steady", "viewers": 1, "tokens_per_s": 2000},
        "b": {"kind": "steady", "viewers": 1, "tokens_per_s": 10000},
        "c": {"kind": "steady", "viewers": 1, "tokens_per_s": 20000},
        "f": {"kind": "steady", "viewers": 10, "tokens_per_s": 2000},
        "s": {"kind": "resume_storm", "viewers": 1, "tokens_per_s": 2000},
    }
    results = {"a": tr(1, 2000, True, 30.0), "b": tr(1, 10000, True, 20.0),
               "c": tr(1, 20000, False, 18.0), "f": tr(10, 2000, True, 9.0),
               "s": tr(1, 2000, True, 99.0)}  # fmt: skip
    return {"phases": phases, "results": results}


def test_costs_from_pathcost_pick_the_phases() -> None:
    one = costs_from_pathcost(_result(), 1)
    assert one.producer_us == 10.0  # the fastest one-reader phase that kept up: b
    assert one.relay_us == 20.0
    fan = costs_from_pathcost(_result(), 8)
    assert fan.relay_us == 9.0  # the phase nearest 8 viewers per session
    assert fan.producer_us == 10.0
    with pytest.raises(ValueError, match="not a pathcost result"):
        costs_from_pathcost({"phases": {}}, 1)


def test_render_names_its_assumptions() -> None:
    text = render([plan(Target(10_000, 30, 1), COSTS, A)], COSTS, A)
    assert "| 10,000 |" in text
    for words in ("30 tokens/s per session", "10 KB", "1 replica(s)", "publish path"):
        assert words in text


def test_command_exits_with_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    for argv in (["--viewers", "ten"], ["--from", str(bad)], ["--tokens-per-s", "-1"],
                 ["--from", str(tmp_path / "missing.json")]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        msg = str(exc.value.code) if not isinstance(exc.value.code, int) else ""
        assert exc.value.code != 0
        assert "\n" not in msg.strip()
    assert cli.main(["--viewers", "10000"]) == 0
    assert "| 10,000 |" in capsys.readouterr().out
