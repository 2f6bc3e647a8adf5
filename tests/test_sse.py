"""Pure tests of the incremental SSE decoder."""

from __future__ import annotations

import pytest

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
