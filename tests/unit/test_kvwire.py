"""Pure tests of vLLM's KV-event wire format: layout, round trips, typed errors."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.routing.kvwire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVWireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

_pack = msgspec.msgpack.encode


def test_the_layout_is_vllms_tagged_arrays() -> None:
    batch = KVEventBatch(
        1.5,
        [
            BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, "GPU"),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
            ["BlockRemoved", [7], "GPU"],
            ["AllBlocksCleared"],
        ],
        None,  # data_parallel_rank (msgspec writes an array's defaults too)
    ]


def test_a_batch_as_vllm_sends_it_decodes_with_its_data_parallel_rank() -> None:
    # what vLLM's publisher encodes: hashes as ints or sha256 digests, a DP rank last
    payload = _pack(
        [
            2.0,
            [
                ["BlockStored", [b"\x01" * 32], 5, [9] * 16, 16, None, "GPU"],
                ["BlockRemoved", [3, 4], None],
            ],
            1,
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 1
    stored, removed = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"\x01" * 32]
    assert stored.parent_block_hash == 5
    assert stored.block_size == 16
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [3, 4]


def test_older_and_newer_layouts_decode() -> None:
    # vLLM 0.9: no medium; later ones append lora_name, extra_keys, group_idx
    old = _pack([1.0, [["BlockStored", [1], None, [0, 1], 2, None], ["BlockRemoved", [1]]]])
    new = _pack([1.0, [["BlockStored", [1], None, [0, 1], 2, None, "GPU", "lora", None, 0]]])
    a, b = decode_batch(old).events
    assert isinstance(a, BlockStored)
    assert a.medium is None
    assert isinstance(b, BlockRemoved)
    assert b.medium is None
    (c,) = decode_batch(new).events
    assert isinstance(c, BlockStored)
    assert c.medium == "GPU"


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\xc1", "garbled"),  # never used in msgpack
        (_pack([1.0, [["BlockStored", [1], None, [0, 1], 2]]])[:-3], "garbled"),  # truncated
        (b"", "garbled"),
        (_pack([1.0, [["BlockMoved", [1]]]]), "unknown_tag"),
        (_pack([1.0, [["BlockStored", "nope", None, [], 2, None, None]]]), "shape"),
        (_pack("hello"), "shape"),
    ],
)
def test_bad_payloads_are_typed_errors(payload: bytes, kind: str) -> None:
    with pytest.raises(KVWireError) as info:
        decode_batch(payload)
    assert info.value.kind == kind


def test_sequence_frames() -> None:
    assert decode_seq(encode_seq(0)) == 0
    assert decode_seq((12345).to_bytes(8, "big")) == 12345  # vLLM: unsigned big-endian
    assert decode_seq(encode_seq(END_SEQ)) == -1  # the replay's end marker
    with pytest.raises(KVWireError) as info:
        decode_seq(b"\x00\x01")
    assert info.value.kind == "seq"


_hash = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=8, max_size=32))
_stored = st.builds(
    BlockStored,
    st.lists(_hash, max_size=4),
    st.none() | _hash,
    st.lists(st.integers(0, 2**31 - 1), max_size=64),
    st.integers(1, 64),
    st.none() | st.integers(0, 9),
    st.sampled_from([None, "GPU", "CPU"]),
)
_event = st.one_of(
    _stored,
    st.builds(BlockRemoved, st.lists(_hash, max_size=4), st.sampled_from([None, "GPU"])),
    st.just(AllBlocksCleared()),
)


@given(
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(_event, max_size=6),
    st.none() | st.integers(0, 7),
)
def test_round_trip(ts: float, events: list[object], rank: int | None) -> None:
    batch = KVEventBatch(ts, events, rank)  # type: ignore[arg-type]
    assert decode_batch(encode_batch(batch)) == batch


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_the_typed_error(data: bytes) -> None:
    kind = "decoded"
    try:
        decode_batch(data)
    except KVWireError as exc:
        kind = exc.kind
    assert kind in ("decoded", "garbled", "shape", "unknown_tag")


# vLLM's current layout (vllm/distributed/kv_events.py: EventBatch and KVCacheEvent are
# msgspec structs with omit_defaults and tag=True but no array_like): each a map of its
# field names, an event's tag under "type", fields at their default left out
_STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [b"\x07" * 32, b"\x08" * 32],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


def test_vllms_map_layout_decodes_to_the_same_events() -> None:
    payload = _pack(
        {
            "ts": 3.25,
            "events": [
                _STORED_MAP,
                {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 2,
        }
    )
    batch = decode_batch(payload)
    assert batch == KVEventBatch(
        3.25,
        [
            BlockStored([b"\x07" * 32, b"\x08" * 32], None, [1, 2, 3, 4], 2, None, "GPU"),
            BlockRemoved([b"\x07" * 32], "GPU"),
            AllBlocksCleared(),
        ],
        2,
    )


def test_an_empty_map_batch_is_a_batch_not_a_shape_error() -> None:
    assert decode_batch(_pack({"ts": 1.0, "events": []})) == KVEventBatch(1.0, [])


def test_the_map_layouts_optional_and_new_fields() -> None:
    # no data_parallel_rank (omitted at its default), extra_keys and the cache-spec fields
    # of a newer vLLM, and a field it may add later: all decode, the unknown ignored
    stored = {**_STORED_MAP, "extra_keys": [None, ["salt"]], "kv_cache_spec_kind": "full",
              "kv_cache_spec_sliding_window": None, "group_idx": 0, "later_field": 1}  # fmt: skip
    batch = decode_batch(_pack({"ts": 1.0, "events": [stored]}))
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored([b"\x07" * 32, b"\x08" * 32], None, [1, 2, 3, 4], 2, None, "GPU")
    ]


def test_the_map_layout_keeps_the_first_kv_cache_group_only() -> None:
    # a hybrid model stores the same tokens in each group under its own hashes: only
    # group 0's (or an event without the field) reach the index
    other = {**_STORED_MAP, "group_idx": 1, "block_hashes": [b"\x09" * 32, b"\x0a" * 32]}
    removed = {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": "GPU",
               "group_idx": 1}  # fmt: skip
    batch = decode_batch(_pack({"ts": 1.0, "events": [_STORED_MAP, other, removed]}))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored"]
    assert batch.events[0].block_hashes == [b"\x07" * 32, b"\x08" * 32]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (_pack({"ts": 1.0, "events": [{"type": "BlockMoved", "block_hashes": []}]}),
         "unknown_tag"),
        (_pack({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1]}]}), "shape"),
        (_pack({"ts": "x", "events": []}), "shape"),
        (_pack({"events": []}), "shape"),
    ],
)  # fmt: skip
def test_bad_map_payloads_are_typed_errors(payload: bytes, kind: str) -> None:
    with pytest.raises(KVWireError) as err:
        decode_batch(payload)
    assert err.value.kind == kind
