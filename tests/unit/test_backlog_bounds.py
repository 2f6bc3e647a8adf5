"""What a session stores, bounded without a server: the user's message as a turn's meta
frame carries it (relay.producer.integrity.message_meta), and the in-memory broker's
backlog, which trims by bytes as the publish script does."""

from __future__ import annotations

import hashlib

import pytest

from relay.broker.memory import MemoryBroker
from relay.producer.integrity import META_MESSAGE_BYTES, message_meta


def test_a_short_message_is_carried_whole() -> None:
    assert message_meta("hello") == {"message": "hello"}
    exact = "x" * META_MESSAGE_BYTES
    assert message_meta(exact) == {"message": exact}


@pytest.mark.parametrize("char", ["a", "é", "\u20ac", "\U0001f600"])
def test_a_long_message_is_cut_on_a_code_point_with_its_size_and_hash(char: str) -> None:
    text = char * 10_000
    got = message_meta(text)
    head = got["message"]
    assert len(head.encode()) <= META_MESSAGE_BYTES
    assert len(head.encode()) > META_MESSAGE_BYTES - 4  # no more cut than a code point
    assert text.startswith(head)
    assert got["message_truncated"] is True
    assert got["message_chars"] == 10_000
    assert got["message_sha256"] == hashlib.sha256(text.encode()).hexdigest()


async def test_the_memory_broker_trims_by_bytes_and_keeps_the_newest() -> None:
    broker = MemoryBroker(max_bytes=10_000)
    for i in range(20):
        broker.append("s1", text=str(i % 10) * 3000)
    page = await broker.read_page("s1", 0, 100, 0)
    assert sum(len(f) for f in page.frames) <= 10_000
    assert page.first > 1
    assert page.last == 20
    huge = MemoryBroker(max_bytes=1000)
    huge.append("s2", text="y" * 5000)  # larger than the budget: the newest stays
    assert (await huge.read_page("s2", 0, 10, 0)).first == 1
