"""The routing simulator run small: the properties the routing design promises.

Every assertion is on simulated (deterministic) figures, never on wall-clock time."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from bench.routing_sim import LEVELS, POLICIES, SimConfig, run, run_all

SMALL = SimConfig(duration_s=150.0, warmup_s=30.0, engines=6, cap=12, load=0.9, seed=11)
TINY = SimConfig(duration_s=40.0, warmup_s=10.0, engines=4, cap=6, seed=5)
BOUNDED = ("bounded_load", "bounded_load_eps", "bounded_load_eps_walk")
UNBOUNDED = tuple(p for p in POLICIES if p not in BOUNDED)

Result = dict[str, Any]


@pytest.fixture(scope="module")
def single() -> dict[str, Result]:
    return {p: run(replace(SMALL, policy=p)) for p in POLICIES}


@pytest.fixture(scope="module")
def four_workers() -> dict[str, Result]:
    over = replace(SMALL, workers=4, load=1.3)
    return {"off": run(replace(over, loadshare=False)), "on": run(over)}


@pytest.fixture(scope="module")
def everything() -> dict[str, Any]:
    return run_all(base=TINY)


def test_four_workers_keep_global_in_flight_within_cap_x_1_1(four_workers) -> None:
    assert four_workers["on"]["peak_global_over_cap"] <= 1.1
    assert four_workers["on"]["utilization"] > 0.8  # the cap is enforced, not wasted


def test_more_workers_than_an_engine_has_slots_all_get_a_share(single) -> None:
    # 24 workers, cap 12: most shares are a slot or none; none may starve.
    many = run(replace(SMALL, workers=24))
    base = single["bounded_load_eps"]
    assert many["peak_global_over_cap"] <= 1.1
    assert many["requests"] >= 0.97 * base["requests"]  # the offered load is served
    assert many["rejected"] <= 0.01 * many["requests"]  # a 2 s admission wait suffices
    assert many["queue_p99_ms"] < 2000.0  # a turn waits rounds of the exchange


def test_without_load_sharing_four_workers_overshoot_the_cap(four_workers) -> None:
    assert four_workers["off"]["peak_global_over_cap"] > 2.0


@pytest.mark.parametrize("policy", ["bounded_load_eps", "bounded_load_eps_walk"])
def test_bounded_load_beats_consistent_hash_on_max_load(single, policy: str) -> None:
    assert single[policy]["max_mean_load"] < single["consistent_hash"]["max_mean_load"]
    assert single[policy]["ttft_p99_ms"] <= single["consistent_hash"]["ttft_p99_ms"]


@pytest.mark.parametrize("policy", ["bounded_load_eps", "bounded_load_eps_walk"])
def test_bounded_load_keeps_most_cache_hits(single, policy: str) -> None:
    assert single[policy]["hit_rate"] >= 0.85 * single["consistent_hash"]["hit_rate"]
    assert single[policy]["captured_over_available"] >= 0.85


def test_round_robin_throws_the_cache_away(single) -> None:
    assert single["round_robin"]["hit_rate"] < single["bounded_load_eps"]["hit_rate"] - 0.05


def test_captured_never_exceeds_available(single) -> None:
    for r in single.values():
        assert 0 < r["captured_tokens"] <= r["available_tokens"]
        assert 0.0 < r["hit_rate"] <= 1.0


def test_same_seed_same_results() -> None:
    cfg = replace(SMALL, policy="cost_aware", duration_s=60.0)
    assert run(cfg) == run(cfg)
    bounded = replace(cfg, policy="bounded_load_eps", workers=3)
    assert run(bounded) == run(bounded)


def test_another_seed_gives_other_numbers() -> None:
    cfg = replace(SMALL, duration_s=60.0)
    a, b = run(cfg), run(replace(cfg, seed=cfg.seed + 1))
    assert a["prompt_tokens"] != b["prompt_tokens"]
    assert a["ttft_p99_ms"] != b["ttft_p99_ms"]


@pytest.mark.parametrize("policy", BOUNDED)
def test_bounded_policies_reject_nothing_at_half_load(policy: str) -> None:
    assert run(replace(SMALL, policy=policy, load=0.5))["rejected"] == 0


def test_consistent_hash_is_less_balanced_than_bounded_load_eps(single) -> None:
    assert single["consistent_hash"]["max_mean_load"] > single["bounded_load_eps"]["max_mean_load"]


def test_every_level_has_every_policy_in_the_json(everything) -> None:
    res = json.loads(json.dumps(everything))  # JSON-serialisable as written by --json
    assert res["seed"] == TINY.seed
    assert set(res["levels"]) == {f"{x:g}" for x in LEVELS}
    for rows in res["levels"].values():
        assert "cost_aware" in rows
        assert set(rows) == set(POLICIES)
        for r in rows.values():
            for k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "max_mean_load", "rejected"):
                assert k in r
            assert {"available_tokens", "captured_tokens", "captured_over_available"} <= set(r)
    assert {"off", "on", "on_walk"} <= set(res["multi_worker"])
    assert set(res["many_workers"]) == {"1", str(TINY.cap), str(2 * TINY.cap)}


def test_unbounded_policies_never_reject(everything) -> None:
    for rows in everything["levels"].values():
        for p in UNBOUNDED:
            assert rows[p]["rejected"] == 0
