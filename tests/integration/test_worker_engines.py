"""The worker on engines that behave like real ones, not like the mock's defaults:
reports only in the last chunk, context limits, slow prefill."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.reply_length import ReplyLength
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration

LONG_REPLIES = ReplyLength(mean=80.0, max_tokens=120, min_tokens=60, sigma=0.0)


@pytest.mark.parametrize("report", ["last", "llamacpp"])
async def test_a_turn_cut_at_max_tokens_still_says_its_cache(
    h: Harness, redis: RedisCluster, report: str
) -> None:
    """A turn that reaches ``max_tokens`` on an engine that reports only at its end said
    cache "unknown" (the worker closed the stream before the report)."""
    await h.start_engines(1, report=report, reply=LONG_REPLIES)
    await h.start_worker()
    sid, token = await h.session()
    body = {"message": "tell me about caches", "system": "be brief " * 20, "max_tokens": 6}
    s1, b1, _ = await h.post_turn(sid, token, body)
    assert s1 == 202, b1
    d1 = (await wait_turn(redis, sid, b1["turn"]))[-1].meta
    assert d1 is not None
    assert d1["finish_reason"] == "length"
    assert (d1["cache"], d1["cached_tokens"]) == ("miss", 0)
    assert d1["prompt_tokens"] > 0
    s2, b2, _ = await h.post_turn(sid, token, {**body, "message": "and more"})
    assert s2 == 202, b2
    d2 = (await wait_turn(redis, sid, b2["turn"]))[-1].meta
    assert d2 is not None
    assert d2["cache"] == "hit"
    assert 0 < d2["cached_tokens"] < d2["prompt_tokens"]
    assert d2["computed_tokens"] == d2["prompt_tokens"] - d2["cached_tokens"]
    metrics = h.state.metrics.render().decode()
    assert f"tokenrelay_worker_cached_prompt_tokens_total {float(d2['cached_tokens'])}" in metrics
