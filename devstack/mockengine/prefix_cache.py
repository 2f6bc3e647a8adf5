"""Pure core of the mock engine: tokeniser, prefix-block LRU cache, deterministic replies.

No I/O, no clock: ``devstack.mockengine.server`` drives these functions, and they are unit
tested with plain values. Order of use for one request:

1. ``prompt_tokens(messages)`` renders the chat into a token list (a toy chat template:
   ``<|role|>`` + the content's tokens + ``<|end|>`` per message, then ``<|assistant|>``;
   the tokeniser and the template live in ``worker.routing.tokens``, which the router
   shares to look prompts up in its block index).
2. ``PrefixCache.lookup(tokens)`` returns how many leading tokens are cached (a multiple
   of the block size) and counts the query in the hit-rate statistics.
3. ``prefill_seconds(uncached, rate)`` is the simulated prefill time.
4. ``reply_pieces(tokens, max_tokens)`` gives the deterministic reply: one text piece per
   decoded token, and the finish reason ("stop" or "length").
5. ``PrefixCache.insert(tokens + reply_tokens(pieces))`` caches prompt and reply, so the
   next turn of the conversation (whose rendering starts with them) hits the cache.

Tokeniser: ``\\w+`` runs and single non-space symbols are tokens; whitespace is dropped;
a token's id is ``worker.routing.tokens.token_id`` (what the KV events carry).
Messages are tokenised one by one and concatenated, so a conversation's rendering is
always a token-level prefix of the next turn's rendering.

Prefix blocks work like vLLM's automatic prefix caching: the token list is cut into
full blocks of ``block_size`` tokens, each block is identified by a hash chained over
its parent's hash and its own tokens, and a lookup walks the chain from the start until
the first missing block. Capacity is ``capacity_tokens // block_size`` blocks; the least
recently used block is evicted first, and a chain is touched tail-first so that, among
blocks used by the same request, the tail is evicted before the prefix it depends on.

KV events (``record_events=True``): what vLLM publishes with ``--kv-events-config``, from
the same cache: each run of newly cached blocks of an insert is one ``BlockStored``
(its blocks' hashes, the parent block's hash or None, their token ids), each eviction
batch one ``BlockRemoved``; ``take_events()`` hands them over in order.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from worker.routing.kvwire import BlockHash, BlockRemoved, BlockStored, KVEvent
from worker.routing.tokens import message_text, prompt_tokens, token_id, tokenize

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "CacheStats",
    "PrefixCache",
    "block_hashes",
    "message_text",
    "prefill_seconds",
    "prompt_tokens",
    "reply_pieces",
    "reply_tokens",
    "tokenize",
]

DEFAULT_BLOCK_SIZE = 16

# Readable filler vocabulary for deterministic replies (alphabetic only, so every word
# is exactly one token of ``tokenize``).
_WORDS = (  # noqa: SIM905 (readable as prose)
    "the a cache prefix token stream engine model request reply answer prompt block "
    "memory latency route shard relay worker queue batch layer signal value system "
    "fast slow warm cold quiet bright small large simple careful steady early late "
    "keeps sends moves holds reads writes finds builds turns waits runs gives takes "
    "river mountain garden window lantern harbor meadow forest signal letter bridge "
    "and then while because after before under over with without through across"
).split()


def block_hashes(tokens: Sequence[str], block_size: int = DEFAULT_BLOCK_SIZE) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (a partial tail block is ignored)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        for tok in tokens[start : start + block_size]:
            h.update(b"\x00")
            h.update(tok.encode("utf-8", "surrogatepass"))
        parent = h.digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Cumulative statistics, in tokens, as vLLM reports them."""

    queries: int
    hits: int
    used_blocks: int
    capacity_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


class PrefixCache:
    """LRU cache of prefix blocks with a capacity in tokens."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        record_events: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._queries = 0
        self._hits = 0
        self._events: list[KVEvent] | None = [] if record_events else None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def peek(self, tokens: Sequence[str]) -> int:
        """Cached prefix length in tokens, without touching LRU order or statistics."""
        n = 0
        for h in block_hashes(tokens, self.block_size):
            if h not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def lookup(self, tokens: Sequence[str]) -> int:
        """Cached prefix length in tokens; marks the hit blocks recently used and counts
        ``len(tokens)`` queried and the result as hit tokens."""
        hit: list[bytes] = []
        for h in block_hashes(tokens, self.block_size):
            if h not in self._blocks:
                break
            hit.append(h)
        self._touch(hit)
        cached = len(hit) * self.block_size
        self._queries += len(tokens)
        self._hits += cached
        return cached

    def insert(self, tokens: Sequence[str]) -> int:
        """Cache every full block of ``tokens``; returns the number of blocks evicted."""
        hashes = block_hashes(tokens, self.block_size)
        if self.capacity_blocks == 0:
            return 0
        # Keep at most the leading blocks that fit: a tail without its prefix is useless.
        hashes = hashes[: self.capacity_blocks]
        if self._events is not None:
            self._record_stored(tokens, hashes)
        self._touch(hashes)
        gone: list[BlockHash] = []
        while len(self._blocks) > self.capacity_blocks:
            gone.append(self._blocks.popitem(last=False)[0])
        if gone and self._events is not None:
            self._events.append(BlockRemoved(gone, "GPU"))
        return len(gone)

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, in order (empty unless ``record_events``)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def _record_stored(self, tokens: Sequence[str], hashes: Sequence[bytes]) -> None:
        assert self._events is not None
        bs = self.block_size
        run: list[int] = []  # indices of a run of blocks not cached yet
        for i, h in enumerate([*hashes, b""]):
            if h and h not in self._blocks:
                run.append(i)
                continue
            if run:
                first = run[0]
                ids = [token_id(t) for t in tokens[first * bs : (run[-1] + 1) * bs]]
                parent = hashes[first - 1] if first else None
                stored: list[BlockHash] = [hashes[j] for j in run]
                self._events.append(BlockStored(stored, parent, ids, bs, None, "GPU"))
                run = []

    def stats(self) -> CacheStats:
        return CacheStats(self._queries, self._hits, len(self._blocks), self.capacity_blocks)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        # Tail first: the prefix ends up most recently used and is evicted last.
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)


def prefill_seconds(uncached_tokens: int, tok_per_s: float) -> float:
    """Simulated prefill time of ``uncached_tokens`` at ``tok_per_s`` (0 if rate <= 0)."""
    if tok_per_s <= 0 or uncached_tokens <= 0:
        return 0.0
    return uncached_tokens / tok_per_s


def reply_pieces(
    tokens: Sequence[str], max_tokens: int, *, min_len: int = 8, max_len: int = 48,
    seed: int | None = None,
) -> tuple[list[str], str]:  # fmt: skip
    """Deterministic reply to a prompt: text pieces (one per token) and finish reason.

    The natural length (``min_len``..``max_len`` tokens) and the words derive from a hash
    of the prompt tokens and ``seed`` (None: the prompt's alone, so the same prompt gets
    the same reply; another seed, other words: a regenerate is sent with one); the
    reply is cut at ``max_tokens`` with finish reason "length". Sentences of readable
    words, capitalised, ending in ".". Joining the pieces gives the reply text, and
    ``tokenize`` of that text gives back one token per piece.
    """
    text = "\x00".join(tokens) + ("" if seed is None else f"\x01{seed}")
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass")).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    natural = rng.randint(min_len, max(min_len, max_len))
    limit = min(natural, max(0, max_tokens))
    pieces: list[str] = []
    sentence_left = 0
    while len(pieces) < limit:
        if sentence_left == 0:
            sentence_left = rng.randint(4, 11)
            word = rng.choice(_WORDS).capitalize()
            pieces.append(word if not pieces else " " + word)
        elif sentence_left == 1 or len(pieces) == natural - 1:
            pieces.append(".")
            sentence_left = 0
            continue
        else:
            pieces.append(" " + rng.choice(_WORDS))
        sentence_left -= 1
    finish = "length" if natural > limit else "stop"
    return pieces, finish


def reply_tokens(pieces: Sequence[str]) -> list[str]:
    """Tokens of a reply given as pieces (equal to ``tokenize("".join(pieces))``)."""
    return [p.strip() for p in pieces]
