"""``bench.pubsub.publish_cost`` on a tiny load: every variant's frames land once, and the
commands per frame it reports are those of each variant (no timing asserted)."""

from __future__ import annotations

import pytest

from bench.pubsub.publish_cost import VARIANTS, Config, run, table

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
    assert "script" in table(res)
