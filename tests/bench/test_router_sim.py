"""The routing simulator's promises, as properties that hold for any seed.

Every assertion is on simulated (deterministic) figures, never on wall-clock time. Each
test draws its seed with hypothesis, so no assertion depends on one chosen setup."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.routing.core import DEFAULT_POLICY, SimConfig, run
from bench.routing.engine_model import EngineParams
from bench.routing.policies import POLICIES
from bench.routing.report import markdown
from bench.routing.sim import TRACE, main, run_all, workload
from bench.routing.workloads import (
    Request,
    SynthConfig,
    TraceError,
    load_trace,
    pulse,
    scale,
    synthetic,
)
from worker.routing.cost import CostModel, TurnInfo
from worker.routing.policy import DEFAULT_QUEUE

SEEDS = st.integers(0, 10_000)
FEW = settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
# a small fleet with a small KV cache, so a short workload reaches preemption and caps
SMALL = SimConfig(engines=4, engine=EngineParams(kv_tokens=160_000))
CAPPED = ("article_fixed_cap", "bounded_load_eps")


def _trace_part(seed: int, factor: float, n: int = 160) -> list[Request]:
    return scale(load_trace(TRACE, limit=n), factor, seed=seed)


@FEW
@given(SEEDS)
def test_caps_are_never_exceeded(seed: int) -> None:
    reqs = _trace_part(seed, 3.0)
    for pol in CAPPED:
        res = run(replace(SMALL, policy=pol, seed=seed, workers=1), reqs)
        cap = 4 if pol == "article_fixed_cap" else res["cap"]
        assert res["peak_load"] <= cap, pol


@FEW
@given(SEEDS)
def test_no_session_starves_rejected_turns_retry_and_finish(seed: int) -> None:
    reqs = _trace_part(seed, 3.0)
    for pol in POLICIES:
        res = run(replace(SMALL, policy=pol, seed=seed, drain_s=3600.0), reqs)
        assert res["unfinished"] == 0, pol
        assert 0.0 <= res["hit_rate"] <= 1.0
        assert res["goodput_rps"] >= 0.0
        assert res["ttft_p50_ms"] <= res["ttft_p99_ms"]
    # the article's cap of 4 refuses turns at this load; they still finish above
    assert run(replace(SMALL, policy="article_fixed_cap", seed=seed), reqs)["rejected"] > 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=4, max_size=4),
    st.integers(1, 30_000),
    st.sampled_from(["", "0", "1", "2", "3"]),
    st.integers(0, 30_000),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20_000), st.booleans()), max_size=30),
)
def test_cost_aware_never_picks_a_costlier_engine_by_its_own_estimate(
    others: list[int],
    prompt: int,
    prev: str,
    prev_tokens: int,
    history: list[tuple[int, int, bool]],
) -> None:
    names = ["0", "1", "2", "3"]
    m = CostModel(names)
    for lease, (e, tokens, first) in enumerate(history):  # some leases, some past their prefill
        t = TurnInfo(prompt_tokens=tokens, shared_key="sys", shared_tokens=512)
        c = m.choose(t)
        m.admitted(lease, replace(c, engine=names[e]), t)
        if first:
            m.first_token(lease)
    turn = TurnInfo(
        prompt_tokens=prompt,
        prev_engine=prev,
        prev_tokens=prev_tokens,
        shared_key="sys",
        shared_tokens=512,
    )
    view = dict(zip(names, others, strict=True))
    costs = m.costs(turn, view)
    choice = m.choose(turn, view)
    assert all(costs[choice.engine][0] <= costs[e][0] for e in names)
    assert choice.reason in ("preferred", "spilled_cost", "least_cost")


def test_cost_aware_bookkeeping_returns_to_zero() -> None:
    m = CostModel(["a", "b"])
    t = TurnInfo(prompt_tokens=1000)
    for lease in range(10):
        m.admitted(lease, m.choose(t), t)
    for lease in range(10):
        m.first_token(lease)
        m.first_token(lease)  # idempotent
        m.finished(lease)
        m.finished(lease)
    assert m.in_flight() == {"a": 0, "b": 0}
    assert m.costs(t, {}) == {e: m.costs(t, {})[e] for e in ("a", "b")}
    assert m.costs(t, {})["a"][0] == m.costs(t, {})["b"][0]


def test_under_a_pulse_the_default_tail_is_below_sticky_sessions() -> None:
    """Steady sessions (4 a second) plus 200 sessions on one 8k-token system prompt within
    10 s, in real time: the burst the caps absorb. (The quick run's pulse compresses time
    about tenfold; there the caps bind, and docs/ROUTING.md shows the default losing.)

    A claim about the usual case, not every draw: over 24 seeds the default's p99 was
    below sticky sessions' in 23 (seed 456: 195 ms against 187 ms). So five fixed seeds,
    the default below on the median and on at least four of them."""
    ours, theirs = [], []
    for seed in range(5):
        reqs = pulse(SynthConfig(rate=4.0, duration_s=90.0), seed=seed, at_s=30.0)
        ours.append(run(SimConfig(policy=DEFAULT_POLICY, seed=seed), reqs)["ttft_p99_ms"])
        theirs.append(run(SimConfig(policy="sticky_session", seed=seed), reqs)["ttft_p99_ms"])
    assert statistics.median(ours) < statistics.median(theirs), (ours, theirs)
    assert sum(a < b for a, b in zip(ours, theirs, strict=True)) >= 4, (ours, theirs)


def test_under_the_compressed_pulse_the_default_tail_is_below_sticky_sessions() -> None:
    """The quick run's pulse (docs/ROUTING.md): the mix at 0.5 x with 200 sessions on one
    8k-token system prompt within about a second, time compressed about fourfold. Far more
    turns are in flight than the KV-derived caps (an engine shares the prompt's blocks):
    the default queues them past the caps (``queued_past_cap``) instead of refusing them,
    and its TTFT p99 is below sticky sessions' at the median of five fixed seeds and on
    at least four of them (over seeds 0-19 on 17: seeds 1 and 14 within 1 %, seed 17 5 %
    above; docs/ROUTING.md has the table)."""
    ours: list[float] = []
    theirs: list[float] = []
    for seed in range(5):
        reqs = workload("pulse", "0.5", str(TRACE), True, seed, 8)
        mine = run(SimConfig(policy=DEFAULT_POLICY, seed=seed), reqs)
        assert mine["reasons"].get("queued_past_cap", 0) > 0, seed  # the caps bound
        ours.append(mine["ttft_p99_ms"])
        theirs.append(run(SimConfig(policy="sticky_session", seed=seed), reqs)["ttft_p99_ms"])
    assert statistics.median(ours) < statistics.median(theirs), (ours, theirs)
    assert sum(a < b for a, b in zip(ours, theirs, strict=True)) >= 4, (ours, theirs)


@FEW
@given(SEEDS)
def test_the_default_queue_past_the_cap_is_bounded(seed: int) -> None:
    """An engine never holds more than (1 + queue) x its cap under the default policy."""
    reqs = _trace_part(seed, 3.0)
    res = run(replace(SMALL, policy="cost_aware", seed=seed, workers=1), reqs)
    assert res["peak_load"] <= res["cap"] + math.floor(DEFAULT_QUEUE * res["cap"])


@FEW
@given(SEEDS)
def test_round_robin_throws_cache_away_against_affinity(seed: int) -> None:
    reqs = synthetic(SynthConfig(rate=0.5, duration_s=150.0, think_s=5.0), seed=seed)
    rr = run(replace(SMALL, policy="round_robin", seed=seed), reqs)
    for pol in ("sticky_session", "cost_aware"):
        assert run(replace(SMALL, policy=pol, seed=seed), reqs)["hit_rate"] > rr["hit_rate"]


def test_same_seed_same_results() -> None:
    reqs = _trace_part(3, 2.0, 120)
    for pol in ("cost_aware", "bounded_load_eps", "sglang_cache_aware"):
        cfg = replace(SMALL, policy=pol, seed=3)
        assert run(cfg, reqs) == run(cfg, reqs)


def test_trace_conversations_extend_earlier_chains() -> None:
    reqs = load_trace(TRACE, limit=2000)
    assert all(r.ids[0] == 0 for r in reqs)  # the shared system prompt
    later = [r for r in reqs if r.turn > 0]
    assert later
    assert all(r.key == ":".join(map(str, r.ids[:2])) for r in later)


def test_a_bad_trace_is_a_one_line_error(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n', encoding="utf-8")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        load_trace(bad)
    with pytest.raises(SystemExit, match=r"routing_sim: .*missing"):
        main(["--quick", "--trace", str(tmp_path / "missing.jsonl")])


def test_the_json_has_every_workload_level_and_policy(monkeypatch) -> None:
    import bench.routing.sim as rs

    monkeypatch.setattr(rs, "_synth_cfg", lambda quick: SynthConfig(duration_s=60.0))
    monkeypatch.setattr(rs, "_trace", lambda path, limit: tuple(load_trace(path, limit=150)))
    res = json.loads(
        json.dumps(
            run_all(
                quick=True,
                seeds=[1],
                path=str(TRACE),
                engines=2,
                procs=1,
                policies=("round_robin", "cost_aware"),
            )
        )
    )
    assert res["default_policy"] in POLICIES
    levels = res["workloads"]["trace"]["levels"]
    assert {"0.5", "0.75", "1.0", "1.5"} <= set(levels)
    for row in levels.values():
        for r in row.values():
            for k in (
                "goodput_rps",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "itl_p99_ms",
                "hit_rate",
                "preemptions",
                "rejected",
                "max_mean_load",
            ):
                assert k in r
                assert k in r["spread"]
    assert {"trace", "synthetic", "pulse"} == set(res["workloads"])
    # the docs' tables come from this rendering of the same results
    md = markdown(res)
    for kind in ("trace", "synthetic", "pulse"):
        assert f"### {kind}: goodput" in md
    assert "| goodput / round_robin's |" in md
    assert md.count("| cost_aware |") >= 1 + len(levels)
