"""The nemesis (bench.faults.nemesis) in its quick form, as `make test` runs it: three
minutes of overlapping faults under load, every kind of fault (seed 5 draws automatic
failovers too: two masters killed, one frozen past the node timeout), every fault proven
to have taken effect or refused by design, and every screen (SSE, WebSocket, Durable
Streams reader, AI SDK UI stream) checked against the backlogs in Redis at the end."""

from __future__ import annotations

import pytest

from bench.faults.nemesis import NemesisConfig, run_nemesis
from bench.faults.schedule import KINDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
async def test_three_minutes_of_overlapping_faults_lose_nothing() -> None:
    cfg = NemesisConfig.quick()
    cfg.seed, cfg.kinds = 5, list(KINDS)
    r = await run_nemesis(cfg)
    samples = {
        k: r.get(k) for k in ("lost_write_samples", "content_samples", "ui_mismatch_samples")
    }
    history = "\n".join([*(str(e) for e in r["history"]), str(samples)])
    assert r["anomalies"] == [], history
    assert r["faults_carried_out"] >= 6, history
    assert r["overlapping_carried_out"] >= 4, history
    assert r["turns"] > 0
    assert r["frames"] > 0
    assert r["turns_checked"] > 0, r
    assert set(r["producers"]["libraries"]) >= {"producer-py"}, r["producers"]
    done = {e["kind"] for e in r["history"] if e.get("took_effect")}
    assert {"master_kill", "master_freeze"} <= done, history  # automatic failovers
    assert r["durable_readers"] > 0, r
    assert r["ui_turns_checked"] > 0, r
    for key in (
        "lost",
        "duplicated",
        "out_of_order",
        "unended_turns",
        "viewers_behind",
        "lost_writes",
        "content_mismatches",
        "ui_mismatches",
    ):
        assert r[key] == 0, (key, history)
