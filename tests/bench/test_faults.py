"""Faults while streams run: each test starts a stack (or cluster) of its own, breaks
one piece and checks what the viewers got (bench.faults.drills does the counting).

Small versions of ``python -m bench.faults``: 3 sessions x 2 viewers, short phases.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from bench.faults.drills import FaultConfig, failures, run_fault
from bench.faults.evidence import judge
from bench.faults.partition import unsupported
from devstack.cluster import form
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Publisher
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.protocol.keys import live_channel, new_session_id
from relay.protocol.slotmap import slot_of
from tests.conftest import PrivateClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# replies of 30 tokens at most: the drills' own runs use the natural lengths
SMALL = FaultConfig(
    sessions=3, viewers_per_session=2, warm_s=1.5, after_s=6.0, drain_s=20.0, max_tokens=30,
    seed=1,
)  # fmt: skip


def _clean(r: dict[str, Any]) -> None:
    """The fault took effect; nothing lost (a gap the server reported is not lost: it is
    counted apart), duplicated, reordered or altered, against the backlog in Redis;
    every turn ended; every viewer got its session's last frame and something after the
    fault."""
    assert r["took_effect"] is True, r["evidence"]
    assert r["frames"], r
    assert (r["lost"], r["duplicated"], r["out_of_order"]) == (0, 0, 0), r
    assert (r["content_mismatches"], r["unended_turns"]) == (0, 0), r
    assert (r["viewers_behind"], r["stalled_viewers"]) == (0, 0), r
    assert r["turns_checked"] > 0, r
    assert r["done_frames_checked"] > 0, r
    assert failures({"faults": {"x": r}}) == []


async def test_relay_kill_viewers_resume_on_the_other_relay() -> None:
    r = await run_fault("relay_kill", SMALL)
    _clean(r)
    assert r["reconnects"] >= 1, r


async def test_master_kill_no_frame_lost_after_failover() -> None:
    r = await run_fault("master_kill", SMALL)
    # with asynchronous replication a frame may be lost; it must then be reported as a
    # gap (gaps_reported), never silently: `lost` counts only the silent ones
    _clean(r)


async def test_reshard_of_live_sessions_loses_nothing() -> None:
    r = await run_fault("reshard", SMALL)
    _clean(r)
    assert r["keys_moved"] > 0, r
    assert all(dst != r["slot_owner_before"][0] for dst in r["slot_owner_after"]), r


async def test_engine_kill_ends_its_turns_with_an_error_frame() -> None:
    r = await run_fault("engine_kill", SMALL)
    _clean(r)
    assert r["killed_engine_leases"] > 0, r  # the drill kills an engine with turns on it
    assert r["error_frames"] > 0, r
    assert r["leases_on_killed_engine_end"] == 0, r  # released
    assert r["turns_on_killed_engine_later"] == 0, r  # later turns went elsewhere


async def test_worker_kill_ends_its_turns_with_an_error_within_the_deadline() -> None:
    r = await run_fault("worker_kill", SMALL)
    _clean(r)
    assert r["killed_leases"] > 0, r  # the drill kills a worker with turns running
    assert r["error_reasons"] == ["worker lost"], r
    assert r["last_error_after_fault_ms"] < 10_000, r


async def test_relay_dropped_for_its_output_buffer_repairs_from_the_backlog() -> None:
    r = await run_fault("relay_stall_buffer", SMALL)
    _clean(r)
    assert r["dropped_by_redis"] is True, r  # the fault really happened


async def test_redis_stall_below_node_timeout_loses_nothing() -> None:
    r = await run_fault("redis_stall", SMALL)
    _clean(r)
    assert r["stall_seen_ms"] >= 1000, r  # a client saw the master stall


async def test_partition_of_a_master_loses_nothing_and_the_rules_go_away() -> None:
    # a fault class that cannot run here fails, unless asked to skip it by name
    if "partition" in os.environ.get("TOKENRELAY_SKIP_FAULTS", "").split(","):
        pytest.skip("TOKENRELAY_SKIP_FAULTS names partition")
    why = unsupported()
    assert why is None, (
        f"the partition drill cannot run here: {why} (TOKENRELAY_SKIP_FAULTS=partition skips it)"
    )
    r = await run_fault("partition", SMALL)
    _clean(r)
    assert (r["partition_ping"], r["healed_ping"]) == ("no answer", "PONG"), r


def test_a_fault_that_did_not_take_effect_fails_the_drill() -> None:
    clean = dict.fromkeys(
        ("lost", "duplicated", "out_of_order", "content_mismatches", "unended_turns",
         "viewers_behind", "stalled_viewers"), 0,
    )  # fmt: skip
    same = {**clean, "slot_master_before": 7001, "slot_master_after": 7001}
    ok, evidence = judge("master_kill", same)
    assert not ok
    assert evidence == {"slot_master_before": 7001, "slot_master_after": 7001}
    assert judge("master_kill", {**same, "slot_master_after": 7004})[0]
    nothing_moved = {**clean, "slots_moved": 1, "keys_moved": 0,
                     "slot_owner_before": [7001], "slot_owner_after": [7002]}  # fmt: skip
    assert not judge("reshard", nothing_moved)[0]
    assert not judge("redis_stall", {"stall_s": 1.5, "stall_seen_ms": None})[0]
    assert not judge("relay_kill", {"killed_relay_exit": -9, "reconnects": 0})[0]
    failed = {**same, "took_effect": False, "evidence": evidence}
    skipped = {"skipped": "needs root", "took_effect": None}
    report: dict[str, Any] = {"faults": {"master_kill": failed, "partition": skipped}}
    assert failures(report, skip=["partition"]) == [
        f"master_kill: the fault did not take effect ({evidence})"
    ]
    report["faults"]["master_kill"].update(took_effect=True, lost=2)
    assert failures(report, skip=["partition"]) == ["master_kill: non-zero lost"]
    # a drill that could not run and was not asked to be skipped is a failure
    assert failures(report) == [
        "master_kill: non-zero lost",
        "partition: could not run here: needs root (or --skip partition)",
    ]


async def test_migrate_slot_moves_a_live_session_and_the_hub_follows(
    private_cluster: PrivateClusterFactory,
) -> None:
    cluster = await private_cluster(masters=2, replicas=0)
    assert cluster.info is not None
    host, port = cluster.info.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    await redis.initialize()
    hub = Hub(RedisBroker(redis, "mig"), reap_interval_s=0)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        gen = await Publisher(redis).open_generation(sid)
        slot = slot_of(live_channel(sid))
        masters = await cluster.masters_now()
        src = next(p for p, slots in masters.items() if slot in slots)
        dst = next(p for p in masters if p != src)

        async def produce() -> None:
            for i in range(60):
                await gen.token(f"{i},")
                await asyncio.sleep(0.01)
            await gen.done()

        producer = asyncio.create_task(produce())
        await asyncio.sleep(0.2)
        assert await cluster.migrate_slot(slot, src, dst) >= 2
        await producer
        got: list[int] = []
        async with asyncio.timeout(10):
            while not got or got[-1] != 61:
                got.extend(d.offset for d in await w.next())
        assert got == list(range(1, 62))
        assert slot in (await cluster.masters_now())[dst]
    finally:
        await hub.close()
        await redis.aclose()


async def test_session_expiry_under_watch_is_a_reset_not_dropped_frames() -> None:
    r = await run_fault("session_expiry", SMALL)
    _clean(r)
    assert r["gen_after"] != r["gen_before"], r
    assert r["resets_seen"] == r["viewers_of_it"] == SMALL.viewers_per_session, r


async def test_a_migration_chosen_from_a_stale_view_refuses_before_any_setslot(
    private_cluster: PrivateClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 30-minute nemesis chose a migration's destination from one node's view while a
    failover had just demoted it (``SETSLOT only with masters``). The move now asks both
    nodes themselves right before its first SETSLOT, and refuses with NotMaster, the slot
    untouched."""
    cluster = await private_cluster(masters=2, replicas=1)
    assert cluster.info is not None
    shards = await cluster.shards_now()
    real = await cluster.masters_now()
    src = next(iter(shards))
    slot = real[src][0]
    demoted = next(r for m, reps in shards.items() if m != src for r in reps)
    stale = {**real, demoted: []}  # a lagging node still lists it as a master

    async def lagging(*_a: Any, **_k: Any) -> dict[int, list[int]]:
        return stale

    monkeypatch.setattr(form, "masters_now", lagging)
    with pytest.raises(form.NotMaster, match=f"{demoted} is a slave now"):
        await cluster.migrate_slot(slot, src, demoted)
    other = next(m for m in real if m != src)
    with pytest.raises(form.NotMaster, match=f"{other} does not serve slot {slot}"):
        await cluster.migrate_slot(slot, other, src)
    monkeypatch.undo()
    assert slot in (await cluster.masters_now())[src]
    c = aioredis.Redis(host="127.0.0.1", port=src)
    try:
        nodes = (await c.execute_command("CLUSTER", "NODES")).decode()
    finally:
        await c.aclose()
    assert "[" not in nodes  # no slot left migrating or importing
