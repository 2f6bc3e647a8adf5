"""Pure: which engine holds which KV blocks, from the engines' own cache events.

What it is for: the ``precise`` cost model (:mod:`worker.routing.cost`) asks, for a new
prompt's block keys (:func:`worker.routing.tokens.block_keys`), how many leading blocks each
engine holds (:meth:`BlockIndex.match`). Every worker builds the same index from the same
events (:mod:`worker.routing.kvevents` subscribes), so the workers share no state and the
routing path does no I/O.

Layout (memory-lean: two dict entries a block): ``_holders`` maps a block's key to a
bitmask of the engines holding it; each engine maps its own block hashes (as 64-bit ints)
to keys, to resolve a ``BlockStored``'s parent and a ``BlockRemoved``. Keys are the
router's chain over the token ids the events carry (see :mod:`worker.routing.tokens`), so
the engine's hash algorithm and seed do not matter. A LoRA adapter's blocks chain from a
root of their own, so a prompt without the adapter never matches them.

Sequence numbers (:meth:`BlockIndex.sequence`): the next batch of an engine is applied, an
older one (a replay overlapping the live stream) is a duplicate, a later one is a gap the
shell fills by replay; :meth:`BlockIndex.unfilled` (no replay answer, or the engine's
buffer no longer reaches back) drops the engine's blocks and keeps it out of
:meth:`match` for ``resync_s`` while its cache is relearnt. ``AllBlocksCleared`` and
:meth:`BlockIndex.remove_engine` drop an engine's blocks. Events it cannot use are
counted, not raised: a block size other than the index's, another medium than the GPU's
(CPU offload), a stored block whose parent it never saw (an orphan), a removal of a block
it never saw, an engine past ``max_blocks``. Pure: no I/O; the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from worker.routing.kvwire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

__all__ = ["BlockIndex", "IndexStats", "SeqVerdict"]

SeqVerdict = Literal["apply", "duplicate", "gap"]
_MASK64: Final = (1 << 64) - 1
_MEDIA: Final = frozenset({None, "GPU", "gpu"})


def _h(block_hash: BlockHash) -> int:
    """An engine's block hash as a 64-bit int (vLLM sends ints or sha256 digests)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[:8], "big")
    return block_hash & _MASK64


@dataclass(slots=True)
class IndexStats:
    """Cumulative counts (the shell exports them as metrics)."""

    batches: int = 0
    stored: int = 0  # blocks
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared, engines removed, unfilled gaps
    duplicates: int = 0  # batches already applied (replay overlap)
    gaps: int = 0
    unfilled: int = 0
    restarts: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # unusable events, by reason

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


class _Engine:
    __slots__ = ("bit", "blocks", "live", "next_seq", "resync_until")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks: dict[int, int] = {}  # engine block hash -> key
        self.next_seq: int | None = None  # None: take whatever comes next
        self.live = False  # applied a batch and not relearning after an unfilled gap
        self.resync_until = 0.0


class BlockIndex:
    """Engines -> block keys, and block keys -> engines. Not thread-safe: one event loop."""

    def __init__(
        self, block_size: int = 16, *, max_blocks: int = 4_000_000, tokens_per_block: int = 0
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        # prompt tokens one block stands for (the cost model's unit): the block size,
        # unless the events name blocks by one id each (the routing simulator's)
        self.tokens_per_block = tokens_per_block or block_size
        self.max_blocks = max_blocks  # per engine; beyond it new blocks are skipped
        self.stats = IndexStats()
        self._holders: dict[int, int] = {}
        self._engines: dict[str, _Engine] = {}
        self._names: list[str | None] = []  # bit -> engine name
        self._live_mask = 0

    # ---- membership ---------------------------------------------------------------------

    def add_engine(self, name: str) -> None:
        if name in self._engines:
            return
        try:
            bit = self._names.index(None)
            self._names[bit] = name
        except ValueError:
            bit = len(self._names)
            self._names.append(name)
        self._engines[name] = _Engine(bit)

    def remove_engine(self, name: str) -> None:
        """The engine left: its blocks go, its bit is free for another."""
        e = self._engines.pop(name, None)
        if e is None:
            return
        self._clear(e)
        self._names[e.bit] = None

    def engines(self) -> list[str]:
        return list(self._engines)

    def live(self, name: str) -> bool:
        e = self._engines.get(name)
        return e is not None and e.live

    def blocks(self, name: str) -> int:
        e = self._engines.get(name)
        return 0 if e is None else len(e.blocks)

    def __len__(self) -> int:
        """Distinct blocks held by any engine."""
        return len(self._holders)

    # ---- the events ---------------------------------------------------------------------

    def sequence(self, name: str, seq: int) -> SeqVerdict:
        """What to do with the engine's batch numbered ``seq``; ``"apply"`` moves the
        expected number on (the caller then applies it), ``"gap"`` leaves it (replay
        from :meth:`expected` first). A batch 0 after later ones is a restarted engine
        (its counter starts again, its cache is empty): its blocks are dropped."""
        e = self._engines.get(name)
        if e is None:
            return "duplicate"
        if seq == 0 and e.next_seq is not None and e.next_seq > 1:
            self.stats.restarts += 1
            self._clear(e)
            e.next_seq = None
        if e.next_seq is None or seq == e.next_seq:
            e.next_seq = seq + 1
            return "apply"
        if seq < e.next_seq:
            self.stats.duplicates += 1
            return "duplicate"
        self.stats.gaps += 1
        return "gap"

    def reset_engine(self, name: str) -> None:
        """The engine went down (it may come back restarted): forget its blocks and its
        sequence; it counts again from its next batch."""
        e = self._engines.get(name)
        if e is not None:
            self._clear(e)
            e.next_seq = None
            e.resync_until = 0.0
            self._set_live(e, False)

    def expected(self, name: str) -> int | None:
        e = self._engines.get(name)
        return None if e is None else e.next_seq

    def unfilled(self, name: str, now: float, resync_s: float) -> None:
        """A gap replay could not fill: drop what the index knew of the engine (it missed
        stores and removals) and keep it out of :meth:`match` for ``resync_s``."""
        e = self._engines.get(name)
        if e is None:
            return
        self.stats.unfilled += 1
        self._clear(e)
        e.next_seq = None
        e.resync_until = now + resync_s
        self._set_live(e, False)

    def synced(self, name: str, now: float) -> None:
        """The engine's replay answered in full: the index knows its cache (empty, if it
        published nothing), so it counts from now on (unless it is resyncing)."""
        e = self._engines.get(name)
        if e is not None and not e.live and now >= e.resync_until:
            self._set_live(e, True)

    def tick(self, now: float) -> None:
        """Engines whose resync time is over count again."""
        for e in self._engines.values():
            if not e.live and e.next_seq is not None and now >= e.resync_until:
                self._set_live(e, True)

    def apply(self, name: str, batch: KVEventBatch, now: float) -> int:
        """Apply one batch (after :meth:`sequence` said so); returns blocks changed."""
        e = self._engines.get(name)
        if e is None:
            return 0
        self.stats.batches += 1
        changed = 0
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                changed += self._removed(e, ev.block_hashes, ev.medium)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(e)
            else:
                if ev.medium not in _MEDIA:
                    self.stats.skip("medium", len(ev.block_hashes))
                elif ev.block_size != self.block_size:
                    self.stats.skip("block_size", len(ev.block_hashes))
                elif len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
                    self.stats.skip("token_count", len(ev.block_hashes))
                else:
                    changed += self._stored(e, ev)
        if not e.live and now >= e.resync_until:
            self._set_live(e, True)
        return changed

    def _stored(self, e: _Engine, ev: BlockStored) -> int:
        hashes, parent, tokens = ev.block_hashes, ev.parent_block_hash, ev.token_ids
        if parent is None:
            key = 0 if ev.lora_id is None else hash(("lora", ev.lora_id))
        else:
            found = e.blocks.get(_h(parent))
            if found is None:
                self.stats.skip("orphan", len(hashes))
                return 0
            key = found
        bs = self.block_size
        room = self.max_blocks - len(e.blocks)
        holders, bit = self._holders, 1 << e.bit
        n = 0
        for i, bh in enumerate(hashes):
            key = hash((key, tuple(tokens[i * bs : (i + 1) * bs])))
            h = _h(bh)
            if h in e.blocks:
                continue
            if n >= room:
                self.stats.skip("max_blocks", len(hashes) - i)
                break
            e.blocks[h] = key
            holders[key] = holders.get(key, 0) | bit
            n += 1
        self.stats.stored += n
        return n

    def _removed(self, e: _Engine, hashes: Iterable[BlockHash], medium: str | None) -> int:
        if medium not in _MEDIA:
            return 0
        holders, clear = self._holders, ~(1 << e.bit)
        n = 0
        for bh in hashes:
            key = e.blocks.pop(_h(bh), None)
            if key is None:
                self.stats.skip("unknown_removed")
                continue
            m = holders.get(key, 0) & clear
            if m:
                holders[key] = m
            else:
                holders.pop(key, None)
            n += 1
        self.stats.removed += n
        return n

    def _clear(self, e: _Engine) -> None:
        self.stats.cleared += 1
        holders, clear = self._holders, ~(1 << e.bit)
        for key in e.blocks.values():
            m = holders.get(key, 0) & clear
            if m:
                holders[key] = m
            else:
                holders.pop(key, None)
        e.blocks = {}

    def _set_live(self, e: _Engine, live: bool) -> None:
        e.live = live
        if live:
            self._live_mask |= 1 << e.bit
        else:
            self._live_mask &= ~(1 << e.bit)

    # ---- the routing path ---------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Per live engine, how many of the leading ``keys`` it holds (one pass over the
        keys, whatever the number of engines). Engines missing from the answer have no
        events to go by (the caller estimates them)."""
        mask = self._live_mask
        out: dict[str, int] = {}
        if not mask:
            return out
        names = self._names
        get = self._holders.get
        depth = len(keys)
        for i, k in enumerate(keys):
            m = get(k, 0) & mask
            if m == mask:
                continue
            lost = mask ^ m
            while lost:
                low = lost & -lost
                name = names[low.bit_length() - 1]
                if name is not None:
                    out[name] = i
                lost ^= low
            mask = m
            if not mask:
                return out
        while mask:
            low = mask & -mask
            name = names[low.bit_length() - 1]
            if name is not None:
                out[name] = depth
            mask ^= low
        return out
