"""Pure: vLLM's KV-cache events on the wire (msgpack), decoded and encoded.

What it is for: an engine with prefix caching (vLLM ``--kv-events-config``, SGLang in the
same format) publishes what enters and leaves its KV cache; the router's block index
(:mod:`worker.routing.blockindex`) follows it. Each ZeroMQ message is
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter, ``payload`` one msgpack
``KVEventBatch``. Its layout, as vLLM's ``vllm/distributed/kv_events.py`` declares it
(msgspec structs with ``array_like=True``, ``omit_defaults=True``; events ``tag=True``, the
tag being the class name, first in the array):

- ``KVEventBatch``: ``[ts, events, data_parallel_rank?]``
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
  (``token_ids``: the stored blocks' tokens, ``block_size`` per hash, in order)
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

A block hash is an int (vLLM up to 0.10) or bytes (later ones: the sha256 digest).
Trailing fields a later vLLM appends (``lora_name``, ``extra_keys``, ...) are ignored, the
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


class KVWireError(ValueError):
    """A message that is not a KV-event batch; ``kind`` names why (a metric label)."""

    def __init__(self, kind: WireErrorKind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind: WireErrorKind = kind


_DECODER: Final = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER: Final = msgspec.msgpack.Encoder()
_RAW: Final = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch from its msgpack payload; :class:`KVWireError` for anything else."""
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise KVWireError(_why(payload), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise KVWireError("garbled", str(exc)) from None


def _why(payload: bytes) -> WireErrorKind:
    """Tell an unknown event tag from any other wrong layout (rare path: errors only)."""
    try:
        raw = _RAW.decode(payload)
    except msgspec.DecodeError:
        return "garbled"
    if isinstance(raw, list) and len(raw) >= 2 and isinstance(raw[1], list):
        for ev in raw[1]:
            if isinstance(ev, list) and ev and isinstance(ev[0], str) and ev[0] not in _TAGS:
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
