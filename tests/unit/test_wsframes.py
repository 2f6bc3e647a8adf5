"""The WebSocket frame parser of the relay (:mod:`relay.edge.core.wsframes`), pure: client
frames in, messages or close codes out."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.edge.core.wsframes import (
    BINARY,
    CLOSE,
    PING,
    PONG,
    TEXT,
    WsError,
    WsParser,
    close_frame,
    pong_frame,
)


def frame(op: int, payload: bytes, *, fin: bool = True, mask: bytes | None = b"abcd") -> bytes:
    """A client frame (masked unless ``mask`` is None)."""
    n = len(payload)
    b0 = (0x80 if fin else 0) | op
    m = 0x80 if mask is not None else 0
    if n < 126:
        head = bytes((b0, m | n))
    elif n < 65536:
        head = bytes((b0, m | 126)) + struct.pack("!H", n)
    else:
        head = bytes((b0, m | 127)) + struct.pack("!Q", n)
    if mask is None:
        return head + payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + body


def test_a_text_a_ping_a_pong_a_binary_and_a_close_in_one_chunk() -> None:
    p = WsParser(1024)
    data = (
        frame(TEXT, b'{"type":"ping"}')
        + frame(PING, b"hb")
        + frame(PONG, b"")
        + frame(BINARY, b"\x00\x01")
        + frame(CLOSE, struct.pack("!H", 1000) + b"bye")
    )
    assert p.feed(data) == [
        (TEXT, '{"type":"ping"}'),
        (PING, b"hb"),
        (PONG, b""),
        (BINARY, b"\x00\x01"),
        (CLOSE, (1000, "bye")),
    ]


@given(st.binary(max_size=300), st.data())
def test_any_split_of_the_bytes_gives_the_same_messages(
    payload: bytes, data: st.DataObject
) -> None:
    text = payload.decode("latin-1").encode()  # valid UTF-8 of any length up to 600 bytes
    wire = frame(TEXT, text[:150], fin=False) + frame(PING, b"x") + frame(0, text[150:])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    p = WsParser(10_000)
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += p.feed(wire[a:b])
    assert got == [(PING, b"x"), (TEXT, text.decode())]  # a control frame may interleave


@pytest.mark.parametrize("op", [TEXT, PING, CLOSE])
def test_an_unmasked_client_frame_is_a_protocol_error(op: int) -> None:
    with pytest.raises(WsError) as err:
        WsParser(64).feed(frame(op, b"", mask=None))
    assert (err.value.code, err.value.reason) == (1002, "client frame not masked")
    p = WsParser(64)  # after a masked one too, and before its payload has arrived
    assert p.feed(frame(TEXT, b"hello")) == [(TEXT, "hello")]
    with pytest.raises(WsError):
        p.feed(frame(TEXT, b"hello", mask=None)[:2])


def test_a_long_masked_message_of_each_length_form() -> None:
    for n in (125, 126, 65535, 65536):
        payload = os.urandom(n)
        assert WsParser(1 << 20).feed(frame(BINARY, payload)) == [(BINARY, payload)]


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (bytes([0xF1, 0x85]) + b"abcd" + b"hello", 1002),  # RSV bits set
        (frame(0x3, b""), 1002),  # reserved opcode
        (frame(0xB, b""), 1002),  # reserved control opcode
        (frame(PING, b"p" * 126), 1002),  # a control frame over 125 bytes
        (frame(PING, b"p", fin=False), 1002),  # a fragmented control frame
        (frame(0, b"more"), 1002),  # a continuation with nothing started
        (frame(TEXT, b"a", fin=False) + frame(TEXT, b"b"), 1002),  # a message inside one
        (frame(CLOSE, b"\x03"), 1002),  # a close frame of 1 byte
        (frame(CLOSE, struct.pack("!H", 1005)), 1002),  # a code no peer may send
        (frame(TEXT, b"\xff\xfe"), 1007),  # text that is not UTF-8
        (frame(CLOSE, struct.pack("!H", 1000) + b"\xff"), 1007),  # a reason that is not
        (frame(TEXT, b"x" * 257), 1009),
        (frame(TEXT, b"a" * 200, fin=False) + frame(0, b"b" * 200), 1009),  # fragments add up
        (bytes([0x81, 0xFF]) + struct.pack("!Q", 2**63 - 1), 1009),  # said before any payload
        (b"\xff" * 64, 1002),
    ],
)
def test_what_a_server_must_refuse_gets_its_close_code(wire: bytes, code: int) -> None:
    with pytest.raises(WsError) as err:
        WsParser(256).feed(wire)
    assert err.value.code == code


def test_a_close_frame_without_a_code_and_the_server_frames() -> None:
    assert WsParser(64).feed(frame(CLOSE, b"")) == [(CLOSE, (1005, ""))]
    assert close_frame(4400, b"x" * 200) == b"\x88\x7d" + struct.pack("!H", 4400) + b"x" * 123
    assert pong_frame(b"hb") == b"\x8a\x02hb"
