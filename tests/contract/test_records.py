"""Sessions' history, idempotency records and job records, once for every store."""

from __future__ import annotations

import asyncio
import json

from relay.service.supervise import Supervisor
from tests.contract.conftest import Stores


def msg(turn: int, role: str, content: str) -> str:
    return json.dumps({"role": role, "content": content, "turn": turn})


async def test_history_bounds_and_truncate(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    for t in range(1, 5):
        n = await s.append_history(sid, [msg(t, "user", "q"), msg(t, "assistant", "a")],
                                   max_messages=6, max_bytes=0, ttl_s=60)  # fmt: skip
    assert n == 6
    hist, _ = await s.history(sid)
    assert [json.loads(m)["turn"] for m in hist] == [2, 2, 3, 3, 4, 4]
    assert await s.truncate_history(sid, 3) == 4
    assert [json.loads(m)["turn"] for m in (await s.history(sid))[0]] == [2, 2]
    big = msg(9, "user", "x" * 200)
    await s.append_history(sid, [big], max_messages=10, max_bytes=100, ttl_s=60)
    assert (await s.history(sid))[0] == [big]  # the appended message always stays
    await s.set_state(sid, "system", "be brief", 60)
    assert (await s.history(sid))[1] == {"system": "be brief"}


async def test_idempotency_record_once(stores: Stores) -> None:
    s, k = stores.store, f"tr:{{{stores.sid()}}}:idem:k1"
    assert await s.claim(k, "pending w:1 fp", 5000) is None
    assert await s.claim(k, "pending w:2 fp", 5000) == "pending w:1 fp"
    assert not await s.release(k, "pending w:2 ")  # not its claim
    await s.put(k, '{"turn": 1}', 60)
    assert await s.get(k) == '{"turn": 1}'
    assert await s.claim(k, "pending w:3 fp", 5000) == '{"turn": 1}'
    assert not await s.release(k, "pending w:1 ")  # resolved: no longer a claim
    await s.drop(k)
    assert await s.get(k) is None
    assert await s.claim(k, "pending w:3 fp", 5000) is None
    assert await s.release(k, "pending w:3 ")


async def test_job_record_keeps_one_result(stores: Stores) -> None:
    s, k = stores.store, f"tr:job:{{{stores.sid()}}}"
    assert await s.job_start(k, "w1", 1) == ("missing", 0)
    assert not await s.job_fail(k, "nothing", 1)
    await s.job_create(k, {"status": "queued", "prompt": "p", "attempts": "0"}, 60)
    await s.job_progress(k, 5, 1)  # not running: ignored
    assert await s.job_start(k, "w1", 2) == ("running", 1)
    assert await s.job_start(k, "w2", 3) == ("running", 2)  # a redelivery
    await s.job_progress(k, 7, 4)
    assert await s.job_finish(k, {"result": "first", "updated_ms": "5"}, 60)
    assert not await s.job_finish(k, {"result": "second", "updated_ms": "6"}, 60)
    assert not await s.job_fail(k, "late", 7)
    assert await s.job_start(k, "w3", 8) == ("done", 0)
    await s.job_note(k, {"notified": "1"})
    rec = await s.job_get(k)
    assert rec is not None
    assert (rec["status"], rec["result"], rec["progress_tokens"], rec["notified"]) == (
        "done", "first", "7", "1")  # fmt: skip
    await s.drop(k)
    assert await s.job_get(k) is None
    await s.job_note(k, {"notified": "1"})  # on nothing: nothing
    assert await s.job_get(k) is None


async def test_slots_and_counters(stores: Stores) -> None:
    s, k = stores.store, f"tr:addr:{{{stores.sid()}}}"
    assert await s.take_slot(k, "a", 2, 60_000) == 0
    assert await s.take_slot(k, "b", 2, 60_000) == 0
    wait = await s.take_slot(k, "c", 2, 60_000)
    assert 1000 <= wait <= 60_000
    c = f"tr:{{{stores.sid()}}}:rate"
    assert [await s.count(c, 120) for _ in range(3)] == [1, 2, 3]


async def test_messages_reach_the_listener(stores: Stores) -> None:
    m, got = stores.messages, list[bytes]()
    channel = f"tr:ctl:{{{stores.sid()}}}"
    sup = Supervisor()
    await m.listen(channel, got.append, sup)
    try:
        await m.send(channel, b"one")
        await m.send(channel, b"two")
        for _ in range(100):
            if len(got) == 2:
                break
            await asyncio.sleep(0.02)
        assert got == [b"one", b"two"]
    finally:
        await m.unlisten()
        await sup.stop()


async def test_registry_members_and_reports(stores: Stores) -> None:
    s, reg = stores.store, f"c{stores.sid()}:workers"
    assert await s.join(reg, "w1", 100.0, 60.0) == ["w1"]
    assert await s.join(reg, "w2", 101.0, 60.0) == ["w1", "w2"]
    assert await s.join(reg, "w3", 170.0, 60.0) == ["w3"]  # w1, w2 unseen for 60 s
    await s.report(f"{reg}:w3", {"in_flight": "{}"}, 60_000)
    assert await s.reports([f"{reg}:w3", f"{reg}:w9"]) == [{"in_flight": "{}"}, {}]
    await s.leave(reg, "w3", f"{reg}:w3")
    assert await s.reports([f"{reg}:w3"]) == [{}]
    assert await s.join(reg, "w4", 171.0, 60.0) == ["w4"]
    assert await s.members_since(reg, 171.0) == ["w4"]
    assert await s.members_since(reg, 172.0) == []
