"""Pure tests of the block index: it follows a cache's events to the block, sequence
numbers, resync, engines leaving; and the mock tokenizer the router shares."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from devstack.mockengine.prefix_cache import PrefixCache, prompt_tokens
from worker.routing.blockindex import BlockIndex
from worker.routing.kvwire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from worker.routing.tokens import block_keys, prompt_ids, token_id

BS = 4


def _feed(ix: BlockIndex, name: str, cache: PrefixCache, seq: int) -> int:
    """The cache's pending events as one batch through the wire and the index."""
    events = cache.take_events()
    if not events:
        return seq
    batch = decode_batch(encode_batch(KVEventBatch(0.0, events)))
    assert ix.sequence(name, seq) == "apply"
    ix.apply(name, batch, now=0.0)
    return seq + 1


def _msgs(system: str, *users: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, *({"role": "user", "content": u} for u in users)]


_text = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=40).map(" ".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), _text, st.integers(0, 1)), min_size=1, max_size=30))
def test_the_index_matches_each_engines_cache_block_for_block(
    steps: list[tuple[int, str, int]],
) -> None:
    """Three small LRU caches (evicting often) publish their events; after every request,
    what the index says each engine holds of any prompt is what its cache holds."""
    caches = [PrefixCache(48, BS, record_events=True) for _ in range(3)]
    ix = BlockIndex(BS)
    seqs = [0, 0, 0]
    for i in range(3):
        ix.add_engine(f"e{i}")
    prompts: list[list[dict[str, str]]] = []
    for engine, text, system in steps:
        msgs = _msgs(f"system prompt number {system} is long enough", text)
        prompts.append(msgs)
        caches[engine].insert(prompt_tokens(msgs))
        seqs[engine] = _feed(ix, f"e{engine}", caches[engine], seqs[engine])
        for p in prompts[-5:]:
            got = ix.match(block_keys(prompt_ids(p), BS))
            for i, c in enumerate(caches):
                if ix.live(f"e{i}"):
                    assert got[f"e{i}"] * BS == c.peek(prompt_tokens(p))


def test_the_mock_tokenizer_is_shared_and_deterministic() -> None:
    msgs = _msgs("be brief", "hello, world")
    ids = prompt_ids(msgs)
    assert ids == [token_id(t) for t in prompt_tokens(msgs)]
    assert token_id("<|system|>") == token_id("<|system|>")
    assert 0 <= ids[0] < 2**31
    longer = prompt_ids([*msgs, {"role": "assistant", "content": "hi"}])
    head = block_keys(ids, BS)
    assert block_keys(longer, BS)[: len(head) - 1] == head[:-1]  # chained: a shared prefix


def _stored(hashes: list[BlockHash], parent: BlockHash | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU")


def _index(*names: str) -> BlockIndex:
    ix = BlockIndex(BS)
    for n in names:
        ix.add_engine(n)
    return ix


def test_sequence_gaps_duplicates_and_restarts() -> None:
    ix = _index("a")
    assert ix.sequence("a", 5) == "apply"  # the first one seen: taken as it comes
    assert ix.sequence("a", 6) == "apply"
    assert ix.sequence("a", 6) == "duplicate"
    assert ix.sequence("a", 9) == "gap"
    assert ix.expected("a") == 7
    ix.apply("a", KVEventBatch(0, [_stored([1], None, [1, 2, 3, 4])]), 0.0)
    assert ix.blocks("a") == 1
    assert ix.sequence("a", 0) == "apply"  # a restarted engine: counts again from 0
    assert ix.blocks("a") == 0
    assert ix.stats.restarts == 1
    assert ix.sequence("nobody", 0) == "duplicate"


def test_an_unfilled_gap_drops_the_engine_until_resynced() -> None:
    ix = _index("a")
    keys = block_keys([1, 2, 3, 4], BS)
    ix.sequence("a", 0)
    ix.apply("a", KVEventBatch(0, [_stored([1], None, [1, 2, 3, 4])]), 0.0)
    assert ix.match(keys) == {"a": 1}
    ix.unfilled("a", now=10.0, resync_s=5.0)
    assert ix.match(keys) == {}
    assert not ix.live("a")
    assert ix.blocks("a") == 0
    assert ix.sequence("a", 40) == "apply"
    ix.apply("a", KVEventBatch(0, [_stored([1], None, [1, 2, 3, 4])]), 12.0)
    assert not ix.live("a")  # relearning: still estimated
    ix.tick(15.0)
    assert ix.match(keys) == {"a": 1}


def test_clear_remove_and_bits_reused() -> None:
    ix = _index("a", "b")
    keys = block_keys(list(range(8)), BS)
    for n in ("a", "b"):
        ix.sequence(n, 0)
        ix.apply(n, KVEventBatch(0, [_stored([10, 11], None, list(range(8)))]), 0.0)
    assert ix.match(keys) == {"a": 2, "b": 2}
    assert len(ix) == 2
    ix.apply("a", KVEventBatch(0, [AllBlocksCleared()]), 0.0)
    assert ix.match(keys) == {"a": 0, "b": 2}
    ix.remove_engine("b")
    assert ix.match(keys) == {"a": 0}
    assert len(ix) == 0
    ix.add_engine("c")  # takes b's bit, holds nothing of b's
    ix.sequence("c", 0)
    ix.apply("c", KVEventBatch(0, []), 0.0)
    assert ix.match(keys) == {"a": 0, "c": 0}


def test_events_it_cannot_use_are_counted() -> None:
    ix = _index("a")
    ix.sequence("a", 0)
    batch = KVEventBatch(
        0,
        [
            _stored([1], 999, [1, 2, 3, 4]),  # parent never seen
            BlockStored([2], None, [1, 2], 2, None, "GPU"),  # another block size
            BlockStored([3], None, [1, 2, 3, 4], BS, None, "CPU"),  # offloaded
            _stored([4, 5], None, [1, 2, 3, 4]),  # tokens for one block, two hashes
            BlockRemoved([77], "GPU"),
        ],
    )
    assert ix.apply("a", batch, 0.0) == 0
    assert ix.stats.skipped == {
        "orphan": 1,
        "block_size": 1,
        "medium": 1,
        "token_count": 2,
        "unknown_removed": 1,
    }
    capped = BlockIndex(BS, max_blocks=1)
    capped.add_engine("a")
    capped.sequence("a", 0)
    capped.apply("a", KVEventBatch(0, [_stored([1, 2], None, list(range(8)))]), 0.0)
    assert capped.blocks("a") == 1
    assert capped.stats.skipped == {"max_blocks": 1}


def test_lora_blocks_never_match_a_prompt_without_the_adapter() -> None:
    ix = _index("a")
    ix.sequence("a", 0)
    ix.apply("a", KVEventBatch(0, [BlockStored([1], None, [1, 2, 3, 4], BS, 3, "GPU")]), 0.0)
    assert ix.match(block_keys([1, 2, 3, 4], BS)) == {"a": 0}


def test_bytes_and_int_hashes_and_a_removed_parent() -> None:
    ix = _index("a")
    ix.sequence("a", 0)
    digest = b"\xab" * 32
    ix.apply("a", KVEventBatch(0, [_stored([digest], None, [1, 2, 3, 4])]), 0.0)
    ix.apply("a", KVEventBatch(0, [_stored([2**200 + 5], digest, [5, 6, 7, 8])]), 0.0)
    keys = block_keys(list(range(1, 9)), BS)
    assert ix.match(keys) == {"a": 2}
    ix.apply("a", KVEventBatch(0, [BlockRemoved([digest], "GPU")]), 0.0)
    assert ix.match(keys) == {"a": 0}  # a chain is matched from its start
    ix.apply("a", KVEventBatch(0, [BlockRemoved([2**200 + 5], None)]), 0.0)
    assert len(ix) == 0
