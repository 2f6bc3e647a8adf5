"""Pure tests of the relay's SSE encoder and resume-offset parsing (relay.protocol.sse).

Encoded streams are decoded back with the WHATWG algorithm
(relay.protocol.sse_reader.SSEDecoder, the project's one decoder, tested on its own in
tests/unit/test_sse.py) so that what we write is what a browser reads.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.protocol import sse
from relay.protocol.sse import MAX_OFFSET, OffsetError, parse_offset, resume_offset
from relay.protocol.sse_reader import SSEDecoder


def whatwg_parse(stream: bytes) -> list[tuple[str, str, str]]:
    """(last event id, type, data) per dispatched event, as the project's WHATWG decoder
    (and a browser) reads them; a strict end: an unfinished event is dropped."""
    d = SSEDecoder()
    events = d.feed(stream)
    return [(e.id or "", e.event, e.data) for e in events]


def test_event_has_id_event_and_data_lines():
    raw = sse.event(b'{"kind":"token","text":"hi"}', id=7, kind="token")
    assert raw == b'id: 7\nevent: token\ndata: {"kind":"token","text":"hi"}\n\n'


def test_data_with_newlines_becomes_several_data_lines():
    raw = sse.event(b"a\nb\r\nc\rd", id=1)
    assert raw == b"id: 1\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
    assert whatwg_parse(raw) == [("1", "message", "a\nb\nc\nd")]


def test_id_and_event_may_not_break_the_framing():
    with pytest.raises(ValueError):
        sse.event(b"x", id="1\n2")
    with pytest.raises(ValueError):
        sse.event(b"x", id="1\0")
    with pytest.raises(ValueError):
        sse.event(b"x", kind="a\rb")


def test_preamble_is_retry_then_a_hello_event_without_id():
    raw = sse.preamble(1500, b'{"type":"hello","relay":"relay-1","from":42}')
    assert raw.startswith(b"retry: 1500\n")
    assert b"id:" not in raw  # the client's resume point is untouched
    assert whatwg_parse(raw) == [("", "hello", '{"type":"hello","relay":"relay-1","from":42}')]
    # the last event id before the hello survives it
    stream = sse.event(b"x", id=7, kind="token") + raw
    assert [i for i, _, _ in whatwg_parse(stream)] == ["7", "7"]


def test_comments_and_goodbye_dispatch_nothing():
    for raw in (sse.comment(), sse.comment("hb"), sse.comment("a\nb"), sse.goodbye("x", "y", 10)):
        assert raw.endswith(b"\n\n")
        assert whatwg_parse(raw) == []
    assert sse.goodbye("relay_shutdown", "reconnect", 250).startswith(b"retry: 250\n")


@settings(max_examples=300)
@given(
    events=st.lists(
        st.tuples(
            st.integers(0, MAX_OFFSET),
            st.sampled_from(["token", "done", "error", "presence", "gap"]),
            st.text(),
        ),
        max_size=10,
    )
)
def test_any_payload_roundtrips_through_a_whatwg_parser(events):
    stream = b""
    for i, (off, kind, text) in enumerate(events):
        stream += sse.event(text.encode(), id=off, kind=kind)
        if i % 2:
            stream += sse.comment("heartbeat")
    got = whatwg_parse(stream)
    norm = [t.replace("\r\n", "\n").replace("\r", "\n") for _, _, t in events]
    assert got == [(str(o), k, t) for (o, k, _), t in zip(events, norm, strict=True)]


@pytest.mark.parametrize(
    ("raw", "want"), [(None, None), ("", None), ("  ", None), ("0", 0), ("17", 17), (" 5", 5)]
)
def test_parse_offset_accepts_decimal_integers(raw, want):
    assert parse_offset(raw) == want


@pytest.mark.parametrize(
    "raw", ["-1", "1.5", "abc", "0x10", "1e3", "+3", "١٢", str(MAX_OFFSET + 1), "9" * 400]
)
def test_parse_offset_rejects_with_a_reason(raw):
    with pytest.raises(OffsetError, match="from"):
        parse_offset(raw, name="from")


def test_resume_prefers_the_header_over_the_query():
    assert resume_offset("5", "9") == 5
    assert resume_offset(None, "9") == 9
    assert resume_offset("", "9") == 9
    assert resume_offset(None, None) is None
    with pytest.raises(OffsetError, match="Last-Event-ID"):
        resume_offset("x", None)
    with pytest.raises(OffsetError, match="last_event_id"):
        resume_offset(None, "-3")


@given(n=st.integers(0, MAX_OFFSET))
def test_every_offset_in_range_parses_back(n):
    assert parse_offset(str(n)) == n


@given(raw=st.text(max_size=30))
def test_parse_offset_returns_an_in_range_int_or_raises(raw):
    try:
        got = parse_offset(raw)
    except OffsetError:
        return
    assert got is None or 0 <= got <= MAX_OFFSET
