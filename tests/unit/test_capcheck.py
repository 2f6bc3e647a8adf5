"""bench.peers.capcheck's arithmetic: the planner's cores for the checked shape from the
fitted phase alone, beside the cores the checked phase measured."""

from __future__ import annotations

from typing import Any

from bench.peers.capcheck import check, report


def _result() -> dict[str, Any]:
    fit = {"sessions": 100, "viewers": 1, "tokens_per_s": 1000, "kind": "steady"}
    probe = {"sessions": 10, "viewers": 5, "tokens_per_s": 1000, "kind": "steady"}
    fitted = {"kept_up": True, "us_per_token": {"server": 25.0},
              "us_per_published": {"producer": 20.0, "redis_masters": 40.0,
                                   "redis_replicas": 10.0}}  # fmt: skip
    # the checked phase's own per-token figures differ: they must not be the prediction's
    measured = {"kept_up": True, "lost": 0, "us_per_token": {"server": 99.0},
                "us_per_published": {"producer": 99.0, "redis_masters": 99.0,
                                     "redis_replicas": 99.0},
                "rounds": [{"wall_s": 3.5, "published": 2000,  # (published over 2 s)
                            "cpu_s": {"server": 0.5, "producer": 0.1, "redis": 0.3},
                            "notes": {"redis_masters_cpu_s": 0.2,
                                      "producer_seconds": 2.0}}]}  # fmt: skip
    return {
        "phases": {"fit": fit, "probe": probe},
        "results": {"fit": {"tokenrelay": fitted}, "probe": {"tokenrelay": measured}},
        "config": {"repeats": 1, "seconds": 2.0},
        "cpus": 2,
        "loadavg_start": ["0.1", "0.1", "0.1"],
        "loadavg_end": ["0.1", "0.1", "0.1"],
    }


def test_prediction_uses_the_fitted_costs_and_the_measurement_the_checked_phase() -> None:
    res = _result()
    got = check(res, "fit", "probe")
    # 10 sessions x 100 tokens/s (2,000 in 2 s), 5 screens each: 1,000 published and
    # 5,000 delivered per second
    assert got["target"] == {"viewers": 50, "tokens_per_s": 100.0, "viewers_per_session": 5}
    rows = {r["participant"]: r for r in got["rows"]}
    relay, masters = rows["relay"], rows["Redis masters"]
    workers = rows["workers (publish path)"]
    assert (relay["predicted_cores"], relay["measured_cores"], relay["ratio"]) == (0.125, 0.25, 2.0)
    assert (masters["predicted_cores"], masters["measured_cores"], masters["ratio"]) == (
        0.04, 0.1, 2.5,
    )  # fmt: skip
    assert (workers["predicted_cores"], workers["measured_cores"], workers["ratio"]) == (
        0.02, 0.05, 2.5,
    )  # fmt: skip
    res["check"] = got
    text = report(res)
    assert "| relay | 0.125 | 0.250 | 2.0 |" in text
    assert "Fitted on `fit`, checked on `probe`" in text
