"""The pure slot map: CLUSTER SHARDS / CLUSTER SLOTS replies -> node per channel."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relay.protocol.keys import live_channel, log_key, meta_key
from relay.protocol.slotmap import Addr, group_by_slot, parse_shards, parse_slots, slot_of


def node(port: int, role: str, health: str = "online") -> list[object]:
    return [
        b"id",
        b"x" * 40,
        b"port",
        port,
        b"ip",
        b"127.0.0.1",
        b"endpoint",
        b"127.0.0.1",
        b"role",
        role.encode(),
        b"replication-offset",
        0,
        b"health",
        health.encode(),
    ]


SHARDS = [
    [b"slots", [0, 5460], b"nodes", [node(7000, "master"), node(7003, "replica")]],
    [b"slots", [5461, 10922], b"nodes", [node(7001, "master"), node(7004, "replica", "loading")]],
    [
        b"slots",
        [10923, 12000, 12001, 16383],
        b"nodes",
        [node(7002, "master"), node(7005, "replica")],
    ],
]


def test_shards_reply_maps_every_slot_to_its_master() -> None:
    m = parse_shards(SHARDS)
    assert m.complete()
    assert m.node_for(0) == Addr("127.0.0.1", 7000)
    assert m.node_for(5461) == Addr("127.0.0.1", 7001)
    assert m.node_for(16383) == Addr("127.0.0.1", 7002)
    assert m.nodes() == {Addr("127.0.0.1", p) for p in (7000, 7001, 7002, 7003, 7005)}


def test_replica_reads_skip_unhealthy_replicas_and_fall_back_to_master() -> None:
    m = parse_shards(SHARDS)
    assert m.node_for(1, replica=True) == Addr("127.0.0.1", 7003)
    assert m.node_for(6000, replica=True) == Addr("127.0.0.1", 7001)  # replica loading


def test_resp3_map_form_is_accepted() -> None:
    reply = [
        {
            "slots": [0, 16383],
            "nodes": [{"ip": "10.0.0.1", "port": 6380, "role": "master", "health": "online"}],
        }
    ]
    assert parse_shards(reply).node_for(9999) == Addr("10.0.0.1", 6380)


def test_shard_without_master_leaves_slots_unserved() -> None:
    reply = [[b"slots", [0, 16383], b"nodes", [node(7000, "master", "fail")]]]
    m = parse_shards(reply)
    assert m.node_for(0) is None
    assert not m.complete()


def test_cluster_slots_fallback() -> None:
    reply = [
        [0, 8191, [b"127.0.0.1", 7000, b"a"], [b"127.0.0.1", 7003, b"b"]],
        [8192, 16383, [b"127.0.0.1", 7001, b"c"]],
    ]
    m = parse_slots(reply)
    assert m.node_for(100) == Addr("127.0.0.1", 7000)
    assert m.node_for(100, replica=True) == Addr("127.0.0.1", 7003)
    assert m.node_for(9000, replica=True) == Addr("127.0.0.1", 7001)


def test_session_keys_and_channel_share_one_slot() -> None:
    sid = "abc_DEF-1"
    assert slot_of(live_channel(sid)) == slot_of(log_key(sid)) == slot_of(meta_key(sid))
    assert slot_of(live_channel(sid)) == slot_of(sid)


def test_group_by_slot_batches_channels_of_one_slot() -> None:
    chans = [live_channel(f"s{i}") for i in range(50)]
    groups = group_by_slot(chans)
    assert sum(len(v) for v in groups.values()) == 50
    for slot, members in groups.items():
        assert all(slot_of(c) == slot for c in members)


def test_a_node_that_does_not_know_its_address_is_the_host_asked() -> None:
    # what a single-node cluster (it never met a peer) answers about itself
    shards = [
        [b"slots", [0, 16383], b"nodes",
         [[b"id", b"x", b"port", 7000, b"ip", b"", b"endpoint", b"", b"role", b"master",
           b"health", b"online"]]],
    ]  # fmt: skip
    assert not parse_shards(shards).complete()
    assert parse_shards(shards, asked="127.0.0.1").node_for(5) == Addr("127.0.0.1", 7000)
    slots = [[0, 16383, [b"", 7000, b"x"]]]
    assert parse_slots(slots, asked="10.1.2.3").node_for(16383) == Addr("10.1.2.3", 7000)


def test_a_tls_client_gets_the_tls_port_where_a_node_has_both() -> None:
    n = [b"ip", b"10.0.0.1", b"port", 6379, b"tls-port", 6380, b"role", b"master"]
    reply = [[b"slots", [0, 16383], b"nodes", [n]]]
    assert parse_shards(reply).node_for(0) == Addr("10.0.0.1", 6379)
    assert parse_shards(reply, tls=True).node_for(0) == Addr("10.0.0.1", 6380)
    tls_only = [[b"slots", [0, 16383], b"nodes", [[b"ip", b"10.0.0.1", b"tls-port", 6380,
                                                    b"role", b"master"]]]]  # fmt: skip
    assert parse_shards(tls_only).node_for(0) == Addr("10.0.0.1", 6380)


def test_slot_of_is_the_cluster_specifications_crc16_with_hash_tags() -> None:
    # The specification's examples: CRC16("123456789") is 0x31C3; the hash tag is what
    # lies between the first "{" and the next "}", when that is not empty.
    assert slot_of("123456789") == 0x31C3 % 16384
    assert slot_of("foo") == 12182
    assert slot_of("bar") == 5061
    assert slot_of("{user1000}.following") == slot_of("{user1000}.followers") == slot_of("user1000")
    assert slot_of("foo{}{bar}") != slot_of("bar")  # an empty tag: the whole key is hashed
    assert slot_of("foo{{bar}}zap") == slot_of("{bar")
    assert slot_of("foo{bar}{zap}") == slot_of("bar")
    assert slot_of(b"\xff{\xfe}") == slot_of(b"\xfe")


@given(st.binary(max_size=40) | st.text(max_size=40))
def test_slot_of_agrees_with_redis_py(key: bytes | str) -> None:
    from redis.crc import key_slot  # the client's own rule, as a second reading of the spec

    assert slot_of(key) == key_slot(key.encode() if isinstance(key, str) else key)
