"""What one client can make Redis hold, on a real worker and the suite's cluster: turns
whose messages are as large as the body limit allows (each turn's ``meta`` frame used to
carry the whole message into the backlog, for the session's lifetime), and sessions
created from one address on several workers (the live-session cap is counted in Redis,
so every worker sees it).

The style of tests/hostile/test_hostile_access.py (a bystander session that gets every
frame, no crash logged).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from relay.protocol.frame import MAX_FRAME_BYTES, decode
from relay.protocol.keys import log_key
from tests.hostile.test_hostile_access import access_stack
from tests.support.hostile import bystander
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration

EMOJI = "\U0001f600" * 16_000  # 64,000 bytes of UTF-8: a body just under 64 KiB


async def test_turns_with_huge_messages_leave_a_bounded_backlog(cluster, redis):
    worker = {"backlog_max_bytes": MAX_FRAME_BYTES, "turns_per_minute": 0, "history_messages": 2}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
        sid, token = await env.worker.session()
        for turn in range(1, 21):
            raw = json.dumps({"message": EMOJI, "max_tokens": 1}, ensure_ascii=False).encode()
            assert len(raw) < 64 * 1024
            status, body, _ = await env.worker.post_turn(
                sid, token, None, raw=raw, headers={"Content-Type": "application/json"}
            )
            assert status == 202, body
            await wait_turn(redis, sid, turn)
        entries: Any = await redis.execute_command("XRANGE", log_key(sid), "-", "+")
        held = sum(len(fields[b"f"]) for _, fields in entries)
        metas = [decode(fields[b"f"]) for _, fields in entries]
        metas = [f for f in metas if f.kind == "meta"]
        assert metas
        for f in metas:
            assert f.meta is not None
            assert len(f.meta["message"].encode()) <= 2048
            assert f.meta["message_truncated"] is True
            assert f.meta["message_chars"] == len(EMOJI)
            assert f.meta["message_sha256"] == hashlib.sha256(EMOJI.encode()).hexdigest()
            assert EMOJI.startswith(f.meta["message"])
        # 20 x 64 KB of messages were posted; the backlog holds a bounded copy of each
        assert held < 100_000, held
        usage = int(await redis.memory_usage(log_key(sid)) or 0)
        assert usage < 200_000, usage
        hist = await env.worker.state.turns.store.load(sid)
        assert [m["content"] for m in hist.messages if m["role"] == "user"][-1] == EMOJI


async def _create(h: Harness, addr: str) -> tuple[int, dict[str, Any], str | None]:
    assert h.http is not None
    async with h.http.post(h.url("/v1/sessions"), headers={"X-Forwarded-For": addr}) as r:
        return r.status, json.loads(await r.text()), r.headers.get("Retry-After")


async def test_live_sessions_per_address_are_capped_on_every_worker(cluster, redis):
    limits: dict[str, Any] = {"trusted_proxies": "127.0.0.1", "max_sessions_per_address": 4,
                              "session_ttl_s": 600}  # fmt: skip
    rng = random.Random()  # a fresh /64 per run: the count lives in the cluster
    a, b = rng.randrange(1 << 16), rng.randrange(1 << 16)
    net, next_net = f"2001:db8:{a:x}:{b:x}", f"2001:db8:{a:x}:{(b + 1) % (1 << 16):x}"
    one, two = Harness(redis), Harness(redis)  # two workers with the cap, on one cluster
    try:
        async with access_stack(cluster, redis) as env, bystander(env):
            for h in (one, two):
                await h.start_engines(1)
                await h.start_worker(**limits)
            got = [await _create(one, f"{net}::{i}") for i in range(1, 4)]
            got.append(await _create(two, f"{net}::99"))  # the same /64, another worker
            assert [s for s, _, _ in got] == [201] * 4, got
            for h in (one, two):
                status, body, retry = await _create(h, f"{net}::5")
                assert (status, body["error"]) == (429, "too_many_sessions"), body
                assert body["reason"]
                assert retry is not None
                assert 590 <= int(retry) <= 600  # until the oldest stops counting
            status, _, _ = await _create(two, f"{next_net}::1")  # another /64
            assert status == 201
            assert env.worker.state.metrics is not None
    finally:
        await one.stop()
        await two.stop()
