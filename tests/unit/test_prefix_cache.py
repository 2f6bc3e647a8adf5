"""Pure tests of the mock engine's core: tokeniser, prefix-block LRU, deterministic replies."""

from __future__ import annotations

import pytest

from devstack.mockengine.prefix_cache import (
    PrefixCache,
    block_hashes,
    message_text,
    prefill_seconds,
    prompt_tokens,
    reply_pieces,
    reply_tokens,
    tokenize,
)


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_tokenize_splits_words_and_symbols_and_drops_whitespace() -> None:
    assert tokenize("Hello, world!  It's  42.") == [
        "Hello",
        ",",
        "world",
        "!",
        "It",
        "'",
        "s",
        "42",
        ".",
    ]


def test_message_text_accepts_string_and_text_parts() -> None:
    assert message_text("hi") == "hi"
    assert message_text([{"type": "text", "text": "a"}, {"type": "image_url"}]) == "a"
    assert message_text(None) == ""


def test_prompt_rendering_of_a_conversation_is_a_prefix_of_the_next_turn() -> None:
    turn1 = [{"role": "user", "content": "What is a prefix cache?"}]
    pieces, _ = reply_pieces(prompt_tokens(turn1), 100)
    reply = "".join(pieces)
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    cached_after_turn1 = prompt_tokens(turn1) + reply_tokens(pieces)
    assert prompt_tokens(turn2)[: len(cached_after_turn1)] == cached_after_turn1


def test_block_hashes_are_chained_and_ignore_the_partial_tail() -> None:
    a = block_hashes(words(40), 16)
    assert len(a) == 2
    b = block_hashes(["x", *words(39)[1:]], 16)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 2, different parent


def test_lookup_finds_the_longest_cached_prefix_in_whole_blocks() -> None:
    cache = PrefixCache(capacity_tokens=1024, block_size=16)
    assert cache.lookup(words(50)) == 0
    cache.insert(words(50))
    assert len(cache) == 3
    assert cache.lookup(words(50)) == 48
    assert cache.lookup(words(20)) == 16
    assert cache.lookup(words(50, "other")) == 0
    diverging = words(40)
    diverging[20] = "changed"
    assert cache.lookup(diverging) == 16


def test_statistics_count_tokens_queried_and_hit() -> None:
    cache = PrefixCache(capacity_tokens=1024, block_size=16)
    cache.lookup(words(32))
    cache.insert(words(32))
    cache.lookup(words(32))
    stats = cache.stats()
    assert (stats.queries, stats.hits) == (64, 32)
    assert stats.hit_rate == pytest.approx(0.5)
    assert stats.usage == pytest.approx(2 / 64)


def test_lru_evicts_the_least_recently_used_blocks_at_capacity() -> None:
    cache = PrefixCache(capacity_tokens=64, block_size=16)  # 4 blocks
    cache.insert(words(32, "a"))
    cache.insert(words(32, "b"))
    assert cache.lookup(words(32, "a")) == 32  # a is now more recent than b
    evicted = cache.insert(words(32, "c"))
    assert evicted == 2
    assert cache.peek(words(32, "a")) == 32
    assert cache.peek(words(32, "b")) == 0
    assert cache.peek(words(32, "c")) == 32
    assert len(cache) == 4


def test_eviction_takes_the_tail_of_a_chain_before_its_prefix() -> None:
    cache = PrefixCache(capacity_tokens=64, block_size=16)
    cache.insert(words(64, "a"))  # fills all 4 blocks
    cache.insert(words(16, "b"))  # one block must go: the tail of a
    assert cache.peek(words(64, "a")) == 48


def test_a_prompt_longer_than_the_cache_keeps_its_leading_blocks() -> None:
    cache = PrefixCache(capacity_tokens=32, block_size=16)
    cache.insert(words(100))
    assert cache.peek(words(100)) == 32


def test_peek_does_not_change_statistics() -> None:
    cache = PrefixCache(capacity_tokens=64)
    cache.peek(words(32))
    assert cache.stats().queries == 0


def test_zero_capacity_caches_nothing() -> None:
    cache = PrefixCache(capacity_tokens=0)
    cache.insert(words(64))
    assert cache.lookup(words(64)) == 0


def test_prefill_is_proportional_to_uncached_tokens() -> None:
    assert prefill_seconds(1000, 500.0) == pytest.approx(2.0)
    assert prefill_seconds(0, 500.0) == 0.0
    assert prefill_seconds(100, 0.0) == 0.0


def test_reply_is_deterministic_readable_and_tokenises_to_its_pieces() -> None:
    prompt = prompt_tokens([{"role": "user", "content": "tell me a story"}])
    pieces, finish = reply_pieces(prompt, 1000)
    assert (pieces, finish) == reply_pieces(prompt, 1000)
    assert finish == "stop"
    text = "".join(pieces)
    assert text[0].isupper()
    assert tokenize(text) == reply_tokens(pieces)
    assert 8 <= len(pieces) <= 48
    other, _ = reply_pieces(prompt_tokens([{"role": "user", "content": "something else"}]), 1000)
    assert other != pieces


def test_a_seed_gives_other_words_of_the_same_length_and_no_seed_the_prompts_own() -> None:
    prompt = prompt_tokens([{"role": "user", "content": "tell me a story"}])
    plain, _ = reply_pieces(prompt, 1000, min_len=20, max_len=20)
    seeded = [reply_pieces(prompt, 1000, min_len=20, max_len=20, seed=n)[0] for n in (2, 3)]
    assert seeded[0] == reply_pieces(prompt, 1000, min_len=20, max_len=20, seed=2)[0]
    assert len({"".join(p) for p in (plain, *seeded)}) == 3  # a regenerate says another thing
    assert [len(p) for p in seeded] == [20, 20]
    assert reply_pieces(prompt, 1000, seed=None) == reply_pieces(prompt, 1000)


def test_reply_is_cut_at_max_tokens_with_finish_length() -> None:
    prompt = prompt_tokens([{"role": "user", "content": "tell me a story"}])
    full, _ = reply_pieces(prompt, 1000)
    cut, finish = reply_pieces(prompt, 3)
    assert (cut, finish) == (full[:3], "length")
