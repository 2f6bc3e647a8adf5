"""Pure: vLLM's KV-cache events on the wire (msgpack), decoded and encoded.

What it is for: an engine with prefix caching (vLLM ``--kv-events-config``, SGLang in the
same format) publishes what enters and leaves its KV cache; the router's block index
(:mod:`worker.routing.blockindex`) follows it. Each ZeroMQ message is
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter, ``payload`` one msgpack
``KVEventBatch``, in one of two layouts vLLM's ``vllm/distributed/kv_events.py`` has used:

**arrays** (msgspec structs with ``array_like=True``, ``omit_defaults=True``; events
``tag=True``, the tag being the class name, first in the array):

- ``KVEventBatch``: ``[ts, events, data_parallel_rank?]``
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
  (``token_ids``: the stored blocks' tokens, ``block_size`` per hash, in order)
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

**maps**, the current one (the same structs without ``array_like``: msgspec then writes
each as a map of its field names, an event's tag under ``"type"``, and leaves out every
field still at its default):

- ``{"ts": ..., "events": [...], "data_parallel_rank"?: ...}``
- ``{"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., "token_ids":
  ..., "block_size": ..., "lora_id": ..., "medium": ..., "lora_name": ..., "extra_keys"?,
  "group_idx"?, "kv_cache_spec_kind"?, "kv_cache_spec_sliding_window"?}``
- ``{"type": "BlockRemoved", "block_hashes": ..., "medium": ..., "group_idx"?}``
- ``{"type": "AllBlocksCleared"}``

``group_idx``: the KV-cache group of a hybrid model (full attention, sliding window, ...),
each group storing the same tokens under its own blocks; the decoder keeps the first
group's events only (``group_idx`` 0 or absent), so a block is never counted twice and
a hash of another group never removes one of the first. Both layouts decode to the
classes below (the first byte says which: a msgpack array or map).

A block hash is an int (vLLM up to 0.10) or bytes (later ones: the sha256 digest).
Fields a later vLLM adds (trailing in an array, new keys in a map) are ignored, the
fields it omits take their defaults. Anything else is a :class:`KVWireError` naming why:
``garbled`` (not msgpack, or truncated), ``shape`` (msgpack of the wrong layout),
``unknown_tag`` (an event this router does not know), ``seq`` (a bad sequence frame).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVWireError",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

BlockHash = int | bytes
WireErrorKind = Literal["garbled", "shape", "unknown_tag", "seq"]

# the replay socket's "no more batches" marker: seq -1 and an empty payload
END_SEQ: Final = -1


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_TAGS: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# the map layout, decoded into the classes above (msgspec writes a struct that is not
# array_like as a map, its tag under "type")
class _MapStored(msgspec.Struct, gc=False, tag_field="type", tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None


class _MapRemoved(msgspec.Struct, gc=False, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, gc=False, tag_field="type", tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class KVWireError(ValueError):
    """A message that is not a KV-event batch; ``kind`` names why (a metric label)."""

    def __init__(self, kind: WireErrorKind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind: WireErrorKind = kind


_DECODER: Final = msgspec.msgpack.Decoder(KVEventBatch)
_MAP_DECODER: Final = msgspec.msgpack.Decoder(_MapBatch)
_ENCODER: Final = msgspec.msgpack.Encoder()
_RAW: Final = msgspec.msgpack.Decoder()


def _is_map(payload: bytes) -> bool:
    """Whether the payload's first msgpack value is a map (fixmap, map 16, map 32)."""
    return bool(payload) and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF))


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch from its msgpack payload, in either layout; :class:`KVWireError` for
    anything else."""
    try:
        if _is_map(payload):
            return _from_map(_MAP_DECODER.decode(payload))
        return _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise KVWireError(_why(payload), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise KVWireError("garbled", str(exc)) from None


def _from_map(m: _MapBatch) -> KVEventBatch:
    events: list[KVEvent] = []
    for ev in m.events:
        if isinstance(ev, _MapStored):
            if ev.group_idx:  # another KV-cache group's copy of blocks (hybrid models)
                continue
            events.append(BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                      ev.block_size, ev.lora_id, ev.medium))  # fmt: skip
        elif isinstance(ev, _MapRemoved):
            if ev.group_idx:
                continue
            events.append(BlockRemoved(ev.block_hashes, ev.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(m.ts, events, m.data_parallel_rank)


def _tag(ev: object) -> object:
    if isinstance(ev, list) and ev:
        return ev[0]
    if isinstance(ev, dict):
        return ev.get("type")
    return None


def _why(payload: bytes) -> WireErrorKind:
    """Tell an unknown event tag from any other wrong layout (rare path: errors only)."""
    try:
        raw = _RAW.decode(payload)
    except msgspec.DecodeError:
        return "garbled"
    events = None
    if isinstance(raw, list) and len(raw) >= 2:
        events = raw[1]
    elif isinstance(raw, dict):
        events = raw.get("events")
    if isinstance(events, list):
        for ev in events:
            tag = _tag(ev)
            if isinstance(tag, str) and tag not in _TAGS:
                return "unknown_tag"
    return "shape"


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def encode_seq(seq: int) -> bytes:
    """The sequence frame: 8 bytes big-endian, signed (the replay's end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVWireError("seq", f"sequence frame of {len(frame)} bytes, want 8")
    return int.from_bytes(frame, "big", signed=True)
