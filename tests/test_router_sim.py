"""The routing simulator run small: the properties the routing design promises."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.router_sim import SimConfig, run

SMALL = SimConfig(duration_s=150.0, engines=6, cap=12, load=0.9, seed=11)


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, float]]:
    return {p: run(replace(SMALL, policy=p)) for p in ("sticky", "least_loaded", "walk")}


@pytest.fixture(scope="module")
def four_workers() -> dict[str, dict[str, float]]:
    over = replace(SMALL, workers=4, load=1.3)
    return {"off": run(replace(over, loadshare=False)), "on": run(over)}


def test_four_workers_keep_global_in_flight_within_cap_x_1_1(four_workers) -> None:
    assert four_workers["on"]["peak_global_over_cap"] <= 1.1
    assert four_workers["on"]["utilization"] > 0.8  # the cap is enforced, not wasted


def test_more_workers_than_an_engine_has_slots_all_get_a_share(single) -> None:
    # 24 workers, cap 12: most shares are a slot or none; none may starve. (Simulated
    # time: deterministic, not a wall-clock assertion.)
    many = run(replace(SMALL, workers=24))
    base = single["least_loaded"]
    assert many["peak_global_over_cap"] <= 1.1
    assert many["requests"] >= 0.97 * base["requests"]  # the offered load is served
    assert many["p99_queue_ms"] < 2000.0  # a turn waits rounds of the exchange, not minutes


def test_without_load_sharing_four_workers_overshoot_the_cap(four_workers) -> None:
    assert four_workers["off"]["peak_global_over_cap"] > 2.0


@pytest.mark.parametrize("policy", ["least_loaded", "walk"])
def test_bounded_load_beats_sticky_on_max_load(single, policy: str) -> None:
    assert single[policy]["max_mean_load"] < single["sticky"]["max_mean_load"]
    assert single[policy]["p99_queue_ms"] <= single["sticky"]["p99_queue_ms"]


@pytest.mark.parametrize("policy", ["least_loaded", "walk"])
def test_bounded_load_keeps_most_cache_hits(single, policy: str) -> None:
    assert single[policy]["cache_hit_rate"] >= 0.85 * single["sticky"]["cache_hit_rate"]


def test_round_robin_throws_the_cache_away() -> None:
    rr = run(replace(SMALL, policy="round_robin"))
    ll = run(SMALL)
    assert rr["cache_hit_rate"] < ll["cache_hit_rate"] - 0.05
