"""The cluster's slot map, pure: which node serves a shard channel.

Built from the raw (hiredis) reply of ``CLUSTER SHARDS`` (Redis >= 7.0) or, as a
fallback, ``CLUSTER SLOTS``; no I/O here. The subscriber fetches the reply, calls
:func:`parse_shards` / :func:`parse_slots`, then asks :meth:`SlotMap.node_for` where to
SSUBSCRIBE each channel (:func:`slot_of` gives the hash slot, hash tags included).

Order of use: ``m = parse_shards(reply)`` -> ``m.node_for(slot_of(channel), replica=...)``
-> :func:`group_by_slot` to batch one SSUBSCRIBE per slot.
"""

from __future__ import annotations

from binascii import crc_hqx
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

__all__ = [
    "SLOTS",
    "Addr",
    "Shard",
    "SlotMap",
    "group_by_slot",
    "parse_shards",
    "parse_slots",
    "slot_of",
]

SLOTS: Final = 16384


class Addr(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Shard:
    master: Addr
    replicas: tuple[Addr, ...] = ()


@dataclass(slots=True)
class SlotMap:
    """Slot -> shard. Slots nobody serves (mid-failover) map to ``None``."""

    slots: list[Shard | None] = field(default_factory=lambda: [None] * SLOTS)

    def shard(self, slot: int) -> Shard | None:
        return self.slots[slot]

    def node_for(self, slot: int, *, replica: bool = False) -> Addr | None:
        """The node to SSUBSCRIBE on: the master, or a replica (stable choice per slot)."""
        sh = self.slots[slot]
        if sh is None:
            return None
        if replica and sh.replicas:
            return sh.replicas[slot % len(sh.replicas)]
        return sh.master

    def nodes(self) -> set[Addr]:
        out: set[Addr] = set()
        for sh in self.slots:
            if sh is not None:
                out.add(sh.master)
                out.update(sh.replicas)
        return out

    def complete(self) -> bool:
        return all(sh is not None for sh in self.slots)

    def covered(self) -> int:
        """How many slots have a master in this map."""
        return sum(sh is not None for sh in self.slots)


def slot_of(channel: str | bytes) -> int:
    """The hash slot of a key or shard channel, as the cluster specification defines it:
    CRC16 (XMODEM, which is ``binascii.crc_hqx`` from 0) of the key, or of its hash tag
    (what lies between the first ``{`` and the next ``}``, when that is not empty),
    modulo 16384."""
    key = channel.encode() if isinstance(channel, str) else channel
    start = key.find(b"{")
    if start > -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc_hqx(key, 0) % SLOTS


def group_by_slot(channels: Iterable[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for ch in channels:
        out[slot_of(ch)].append(ch)
    return dict(out)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes | bytearray) else str(v)


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    if isinstance(flat, dict):
        return {_s(k): v for k, v in flat.items()}
    return {_s(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _addr(node: dict[str, Any], tls: bool, asked: str | None) -> Addr | None:
    host = node.get("ip") or node.get("endpoint") or node.get("hostname") or asked
    if tls:  # a TLS client must use the TLS port where a node has both
        port = node.get("tls-port") or node.get("port")
    else:
        port = node.get("port") or node.get("tls-port")
    if host is None or port is None:
        return None
    h = _s(host)
    if h in ("", "?"):
        return None
    return Addr(h, int(port))


def parse_shards(reply: Sequence[Any], *, tls: bool = False, asked: str | None = None) -> SlotMap:
    """Parse ``CLUSTER SHARDS`` (RESP2 flat lists or RESP3 maps); ``tls``: the addresses
    of the nodes' TLS ports (``tls-port``) where they have one. ``asked``: the host the
    command was sent to, for a node that does not know its own address yet (an empty
    ``ip``, as a node that never met another one reports itself): Redis means "the
    host you asked"."""
    m = SlotMap()
    for raw in reply:
        shard = _pairs(raw)
        master: Addr | None = None
        replicas: list[Addr] = []
        for rn in shard.get("nodes", []):
            node = {k: v for k, v in _pairs(rn).items()}
            if _s(node.get("health", "online")) != "online":
                continue
            addr = _addr(node, tls, asked)
            if addr is None:
                continue
            if _s(node.get("role", "")) == "master":
                master = addr
            else:
                replicas.append(addr)
        if master is None:
            continue
        sh = Shard(master, tuple(sorted(replicas)))
        ranges = list(shard.get("slots", []))
        for i in range(0, len(ranges) - 1, 2):
            for s in range(int(ranges[i]), int(ranges[i + 1]) + 1):
                m.slots[s] = sh
    return m


def parse_slots(reply: Sequence[Any], *, asked: str | None = None) -> SlotMap:
    """Parse ``CLUSTER SLOTS``: ``[[start, end, [ip, port, id], replica...], ...]``;
    an empty ip is ``asked`` (see :func:`parse_shards`)."""
    m = SlotMap()

    def addr(node: Sequence[Any]) -> Addr:
        return Addr(_s(node[0]) or asked or "", int(node[1]))

    for entry in reply:
        start, end, master, *reps = entry
        sh = Shard(addr(master), tuple(sorted(addr(r) for r in reps)))
        for s in range(int(start), int(end) + 1):
            m.slots[s] = sh
    return m
