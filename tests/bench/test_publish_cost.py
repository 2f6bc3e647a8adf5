"""``bench.pubsub.publish_cost`` on a tiny load: every variant's frames land once, and the
commands per frame it reports are those of each variant (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pubsub.publish_cost import VARIANTS, Config, main, report, run, table

pytestmark = pytest.mark.integration


async def test_a_tiny_run_lands_every_frame_and_counts_each_variants_commands() -> None:
    cfg = Config(sessions=20, rate=400, seconds=0.5, rounds=1, batches=(1,))
    res = await run(cfg)
    assert res["errors"] == 0
    by_v = res["summary"]["1"]
    assert set(by_v) == set(VARIANTS)
    floor = by_v["floor"]["commands_per_frame"]
    assert floor["xadd"] == floor["spublish"] == 1
    assert "evalsha" not in floor
    script = by_v["script"]["commands_per_frame"]
    assert script["evalsha"] == script["hmget"] == script["hset"] == 1
    assert script.get("expire", 0) < 1 < by_v["before"]["commands_per_frame"]["expire"]
    assert by_v["function"]["commands_per_frame"]["fcall"] == 1
    # today's script reads no TTL; the one before it read one per call
    assert "pttl" not in script
    assert "pttl" not in by_v["function"]["commands_per_frame"]
    assert by_v["script_pttl"]["commands_per_frame"]["pttl"] == 1
    assert "script" in table(res)
    md = report(res).splitlines()
    rows = [r for r in md if r.startswith("| 1 |")]
    assert [r.split(" | ")[1] for r in rows] == list(VARIANTS)
    assert "| 1 | floor | " in md[2]
    assert "| 1.00 |" in md[2]


def test_report_of_an_unreadable_run_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"summary": {}}))
    assert main(["--report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("publish_cost: cannot read")
    assert err.count("\n") == 1
