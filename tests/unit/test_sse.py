"""Pure tests of the incremental SSE decoder."""

from __future__ import annotations

import pytest

from relay.protocol import sse
from relay.protocol.sse_reader import SSEDecoder, SSEError, SSEEvent

STREAM = (
    "\ufeff: comment first\r\n"
    'data: {"a": "h\u00e9llo \u4e16\u754c"}\r\n\r\n'
    "data:no-space\n\n"
    "event: custom\rid: 7\rretry: 1500\rdata: line1\rdata:  line2\r\r"
    "field-without-colon\n"
    "data\n\n"
    ": keep-alive\n\n"
    "data: [DONE]\n\n"
).encode()

EXPECTED = [
    SSEEvent('{"a": "h\u00e9llo \u4e16\u754c"}'),
    SSEEvent("no-space"),
    SSEEvent("line1\n line2", "custom", "7", 1500),
    SSEEvent("", "message", "7", 1500),
    SSEEvent("[DONE]", "message", "7", 1500),
]


def decode_in_pieces(data: bytes, sizes: list[int]) -> list[SSEEvent]:
    d = SSEDecoder()
    out: list[SSEEvent] = []
    pos = 0
    for n in sizes:
        out += d.feed(data[pos : pos + n])
        pos += n
    out += d.feed(data[pos:])
    out += d.close()
    return out


def test_whole_stream_decodes_per_the_whatwg_rules() -> None:
    assert decode_in_pieces(STREAM, []) == EXPECTED


def test_every_split_point_gives_the_same_events() -> None:
    for cut in range(1, len(STREAM)):
        assert decode_in_pieces(STREAM, [cut]) == EXPECTED, cut


def test_byte_by_byte_gives_the_same_events() -> None:
    assert decode_in_pieces(STREAM, [1] * len(STREAM)) == EXPECTED


def test_crlf_split_between_chunks_is_one_line_end() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: a\r") == []
    assert d.feed(b"\n\r") == [SSEEvent("a")]
    assert d.feed(b"\ndata: b\n\n") == [SSEEvent("b")]


def test_pending_event_is_dispatched_at_end_of_stream() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: [DONE]") == []
    assert d.close() == [SSEEvent("[DONE]")]


def test_comments_are_counted_not_dispatched() -> None:
    d = SSEDecoder()
    assert d.feed(b": ping\n\n: ping\n\n") == []
    assert d.comments == 2


def test_overlong_line_is_an_error() -> None:
    d = SSEDecoder(max_line_chars=10)
    with pytest.raises(SSEError):
        d.feed(b"data: " + b"x" * 20)


def test_overlong_event_is_an_error() -> None:
    d = SSEDecoder(max_event_chars=10)
    with pytest.raises(SSEError):
        d.feed(b"data: 123456\ndata: 123456\n")


def test_comments_go_to_the_callback_and_retry_is_kept() -> None:
    seen: list[str] = []
    d = SSEDecoder(on_comment=seen.append)
    assert d.feed(b"data: x\n\n") == [SSEEvent("x")]  # no retry: hint yet
    assert d.feed(b"retry: 900\n: heartbeat\n:\n:no space\n\n") == []
    assert (seen, d.comments, d.retry_ms) == (["heartbeat", "", "no space"], 3, 900)
    assert d.feed(b"retry: 1x\nretry: \xd9\xa3\n\n") == []  # not ASCII digits: ignored
    assert d.retry_ms == 900


def test_the_relays_own_stream_decodes_with_the_encoder() -> None:
    """What relay.protocol.sse writes, this decoder reads back, across every split."""
    stream = (
        sse.preamble(1000, b'{"type":"hello","relay":"r1"}')
        + sse.event(b'{"kind":"token","text":"a\\nb"}', id=3, kind="token")
        + sse.comment("heartbeat")
        + sse.event(b"line1\r\nline2", kind="token")  # no id: the last one persists
        + sse.goodbye("relay_shutdown", "bye", retry_ms=250)
    )
    want = [
        SSEEvent('{"type":"hello","relay":"r1"}', "hello", None, 1000),
        SSEEvent('{"kind":"token","text":"a\\nb"}', "token", "3", 1000),
        SSEEvent("line1\nline2", "token", "3", 1000),
    ]
    for cut in range(len(stream)):
        seen: list[str] = []
        d = SSEDecoder(on_comment=seen.append)
        got = d.feed(stream[:cut]) + d.feed(stream[cut:]) + d.close()
        assert got == want, cut
        assert seen == ["heartbeat", "close relay_shutdown bye"]
        assert (d.retry_ms, d.last_id) == (250, "3")


def test_an_id_with_nul_is_ignored_and_an_empty_id_resets() -> None:
    d = SSEDecoder()
    assert d.feed(b"id: 5\ndata: a\n\nid: 6\x00\ndata: b\n\nid\ndata: c\n\n") == [
        SSEEvent("a", id="5"),
        SSEEvent("b", id="5"),
        SSEEvent("c", id=""),
    ]
