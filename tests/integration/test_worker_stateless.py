"""Workers are stateless: the next turn of a session, served by a different worker
process, is generated from the history the first one left in Redis."""

from __future__ import annotations

import aiohttp
import pytest
from redis.asyncio import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.stack import Stack, StackSpec
from tests.support.worker import expected_reply, wait_turn

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(120)
async def test_the_next_turn_on_another_worker_process_sees_the_history(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    spec = StackSpec(
        relays=0,
        workers=2,
        engines=1,
        redis_url=cluster.url,
        insecure_no_auth=True,
        # nobody watches this session; the live-session cap would count in the shared
        # cluster for a day
        worker_args=["--presence-grace-s", "60", "--max-sessions-per-address", "0"],
    )
    async with Stack(spec) as stack, aiohttp.ClientSession() as http:
        w1, w2 = stack.worker_urls
        async with http.post(w1 + "/v1/sessions") as r:
            assert r.status == 201
            sid = (await r.json())["session"]
        replies: list[str] = []
        messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
        for worker, text in ((w1, "first question"), (w2, "and a follow-up")):
            body = {"message": text, "system": "be brief", "max_tokens": 12}
            async with http.post(f"{worker}/v1/sessions/{sid}/turns", json=body) as r:
                assert r.status == 202, await r.text()
                turn = (await r.json())["turn"]
            frames = await wait_turn(redis, sid, turn, timeout_s=30)
            assert frames[-1].kind == "done", [f.kind for f in frames]
            assert frames[0].meta is not None
            assert frames[0].meta["worker"] == ("worker-1" if worker == w1 else "worker-2")
            messages.append({"role": "user", "content": text})
            reply = "".join(f.text for f in frames if f.kind == "token")
            # the mock engine's reply is a function of the whole prompt it received: equal
            # to the expected one only if worker-2 sent worker-1's turn as history
            assert reply == expected_reply(messages, 12)
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
        assert replies[0] != replies[1]


@pytest.mark.timeout(120)
async def test_a_stack_whose_port_was_taken_before_its_child_listened_starts_on_another(
    cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests run side by side: a port picked for a child can be taken by another program
    before the child listens. The stack gives that child a new port instead of failing."""
    import socket

    from devstack.demo import stack as stack_module

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    real = stack_module.free_port
    monkeypatch.setattr(stack_module, "free_port", lambda: next(picks, None) or real())
    spec = StackSpec(relays=0, workers=1, engines=0, engine_urls=["e=http://127.0.0.1:9"],
                     redis_url=cluster.url, insecure_no_auth=True)  # fmt: skip
    try:
        async with Stack(spec) as stack:
            (worker,) = stack.of_kind("worker")
            assert worker.port != taken
            assert str(worker.port) in worker.argv
            assert str(taken) not in worker.argv
            assert worker.proc is not None
            assert "in use" in worker.proc.output()  # the first child said why it left
    finally:
        squatter.close()
