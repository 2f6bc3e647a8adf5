"""``bench.relay.report``: runs of bench.relay.throughput side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.relay.report import main, table


def test_a_figure_one_run_lacks_is_na_and_the_last_run_says_met() -> None:
    before = {"relay_cpu_us_per_frame": 100.8, "raw_msgs_per_s": 36106}
    after = {
        "relay_cpu_us_per_frame": 14.0,
        "raw_msgs_per_s": 83000,
        "bare_cpu_us_per_frame": 12.0,
        "targets_met": {"relay_cpu_us_per_frame": True},
    }
    out = table([("before", before), ("after", after)]).splitlines()
    assert out[0] == "| figure | target | before | after | met (last)? |"
    assert "| `raw_msgs_per_s` |  | 36,106 | 83,000 |  |" in out
    assert "| `relay_cpu_us_per_frame` | <= 15 | 100.8 | 14.0 | yes |" in out
    assert "| `bare_cpu_us_per_frame` |  | n/a | 12.0 |  |" in out
    assert not any("latency" in line for line in out)  # measured by neither


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        main(["no-label"])
    with pytest.raises(SystemExit, match=r"missing\.json"):
        main([f"a={tmp_path / 'missing.json'}"])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit, match=r"bad\.json"):
        main([f"a={bad}"])
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"ratio": 1.0}))
    main([f"a={good}"])
