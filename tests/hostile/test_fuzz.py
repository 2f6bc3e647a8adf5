"""Property tests (hypothesis) of the parsers that read hostile input.

The contracts live in :mod:`bench.fuzz.props` (shared with ``python -m bench.fuzz``,
the million-case run); here hypothesis drives them with structured and arbitrary
inputs, a moderate number of examples for CI (``TOKENRELAY_FUZZ_EXAMPLES`` to change).
Each regression found by fuzzing has a named example test below.
"""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.fuzz.props import (
    NOW,
    SECRET,
    VALID_SID,
    VALID_TOKEN,
    check_frame,
    check_offset,
    check_session,
    check_token,
    hash_tag,
)
from relay.protocol import auth, frame, keys, sse

EXAMPLES = int(os.environ.get("TOKENRELAY_FUZZ_EXAMPLES", "500"))
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_frame_decode_of_a_str_with_lone_surrogates_is_a_frame_error():
    """Regression (fuzz): msgspec raised UnicodeEncodeError for such a str."""
    with pytest.raises(frame.FrameError):
        frame.decode('{"v":1,"session":"\ud800","turn":0,"offset":1,"kind":"token"}')
    check_frame(b"\xf7s")


def test_frame_decode_of_invalid_utf8_in_a_string_is_a_frame_error():
    """Regression (fuzz): msgspec raised UnicodeDecodeError for non-UTF-8 bytes inside a
    JSON string, which the hub (it catches FrameError only) would not have caught."""
    with pytest.raises(frame.FrameError, match="UTF-8"):
        frame.decode(b'{"v":1,"session":"S\xa2s","turn":1,"offset":7,"kind":"token"}')
    with pytest.raises(frame.FrameError):
        frame.decode(b'{"v":1,"session":"s","turn":1,"offset":7,"kind":"token","text":"\x80"}')


def _raw_frame(offset: int, turn: int) -> bytes:
    return (f'{{"v":1,"session":"s","turn":{turn},"offset":{offset},"kind":"token"}}').encode()


@pytest.mark.parametrize("field", ["offset", "turn"])
def test_frame_offsets_past_2_53_are_refused(field):
    """Regression (fuzz): an offset no client can resume from (``Last-Event-ID`` /
    ``from`` stop at 2**53-1, relay.protocol.sse.MAX_OFFSET) decoded as a valid frame."""
    assert frame.MAX_INT == sse.MAX_OFFSET
    for value in (2**53, 10**23):
        args = {"offset": 1, "turn": 1, field: value}
        with pytest.raises(frame.FrameError, match="outside"):
            frame.decode(_raw_frame(**args))
    args = {"offset": 1, "turn": 1, field: 2**53 - 1}
    assert getattr(frame.decode(_raw_frame(**args)), field) == 2**53 - 1


# -- frame decoder ----------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_frame_fields = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([1, 0, 2, -1, "1", None]),
        "session": st.text(max_size=70) | st.integers(),
        "turn": st.integers(min_value=-3, max_value=2**64) | st.text(max_size=3),
        "offset": st.integers(min_value=-3, max_value=2**64) | st.floats(),
        "kind": st.sampled_from([*frame.KINDS, "", "TOKEN", "hello"]) | st.text(max_size=8),
        "text": st.text() | st.integers(),
        "epoch": st.integers(),
        "ts": st.integers() | st.none(),
        "meta": st.none() | st.dictionaries(st.text(max_size=5), _json_values, max_size=4),
        "extra": _json_values,
    },
)


@fuzz
@given(st.binary(max_size=512))
def test_frame_decode_of_arbitrary_bytes_is_a_frame_or_frame_error(data):
    check_frame(data)


@fuzz
@given(_frame_fields)
def test_frame_decode_of_near_valid_json_is_a_frame_or_frame_error(fields):
    check_frame(json.dumps(fields).encode("utf-8", "surrogatepass"))


@fuzz
@given(st.builds(
    frame.Frame,
    session=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    turn=st.integers(0, frame.MAX_INT),
    offset=st.integers(0, frame.MAX_INT),
    kind=st.sampled_from(sorted(frame.KINDS)),
    text=st.text(),
))  # fmt: skip
def test_every_valid_frame_round_trips(f):
    assert frame.decode(frame.encode(f)) == f


# -- session ids ------------------------------------------------------------------------


@fuzz
@given(st.text(max_size=80) | st.binary(max_size=80).map(lambda b: b.decode("latin-1")))
@example("a{b}c")
@example("x" * 10_240)
@example("a\r\nb")
@example("a\x00")
@example("café")
def test_parse_session_returns_a_valid_id_or_refuses(text):
    check_session(text.encode("utf-8", "surrogatepass"))
    try:
        sid = keys.parse_session(text)
    except keys.InvalidSessionId:
        return
    assert hash_tag(keys.live_channel(sid)) == sid


@fuzz
@given(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True), st.text(max_size=10))
def test_every_key_of_a_valid_id_hashes_on_the_id(sid, suffix):
    for kind in keys.KeyKind:
        name = keys.key(sid, kind, suffix)
        assert hash_tag(name) == sid
        assert name.startswith(f"tr:{{{sid}}}:")


def test_parse_session_refuses_non_strings():
    for raw in (None, 5, b"abc", ["abc"]):
        with pytest.raises(keys.InvalidSessionId):
            keys.parse_session(raw)


# -- resume offsets ---------------------------------------------------------------------

_offset_text = (
    st.text(max_size=24)
    | st.integers(-(2**60), 2**60).map(str)
    | st.from_regex(r"[ \t]*[0-9]{1,20}[ \t]*", fullmatch=True)
    | st.text(alphabet="0123456789٠١٢９ \t+-.eEx", max_size=20)
)


@fuzz
@given(_offset_text)
@example(str(2**53 - 1))
@example(str(2**53))
@example("9" * 5000)
def test_offset_parsers_accept_only_decimal_integers_in_range(text):
    check_offset(text.encode("utf-8", "surrogatepass"))


@fuzz
@given(st.none() | _offset_text, st.none() | _offset_text)
def test_resume_offset_prefers_a_non_blank_header(header, query):
    try:
        got = sse.resume_offset(header, query)
    except sse.OffsetError as exc:
        reason = str(exc)
    else:
        reason = ""
    if reason:
        assert reason.startswith(("Last-Event-ID", "last_event_id"))
        return
    if header is not None and header.strip(" \t"):
        assert got == int(header.strip(" \t"))
    else:
        assert got == (None if query is None or not query.strip(" \t") else int(query))
    assert got is None or 0 <= got <= sse.MAX_OFFSET


# -- tokens -----------------------------------------------------------------------------


@fuzz
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_arbitrary_tokens_never_verify(token):
    check_token(token.encode("utf-8", "surrogatepass"))


@fuzz
@given(st.binary(min_size=1, max_size=120), st.binary(min_size=32, max_size=32))
def test_tokens_signed_with_another_key_never_verify(payload, sig):
    def b64(raw: bytes) -> str:  # canonical base64url, so only the signature is wrong
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    header = VALID_TOKEN.split(".")[0]  # the real header: HS256 and a kid the server holds
    token = f"{header}.{b64(payload)}.{b64(sig)}"
    with pytest.raises(auth.TokenInvalid):
        auth.verify_token(SECRET, token, VALID_SID, NOW)


def test_every_one_character_change_of_a_valid_token_fails():
    """Exhaustive: every position x every other base64url character (canonical
    encoding matters: without it, the low bits of the last character would be free)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."
    assert auth.verify_token(SECRET, VALID_TOKEN, VALID_SID, NOW).session == VALID_SID
    tried = 0
    for i, c in enumerate(VALID_TOKEN):
        for r in alphabet:
            if r == c:
                continue
            forged = VALID_TOKEN[:i] + r + VALID_TOKEN[i + 1 :]
            with pytest.raises(auth.AuthError):
                auth.verify_token(SECRET, forged, VALID_SID, NOW)
            tried += 1
    assert tried == len(VALID_TOKEN) * 64


@fuzz
@given(st.integers(0, len(VALID_TOKEN) * 8 - 1))
def test_bit_flips_of_a_valid_token_never_verify(bit):
    raw = bytearray(VALID_TOKEN.encode())
    raw[bit // 8] ^= 1 << (bit % 8)
    check_token(bytes(raw))
    with pytest.raises(auth.AuthError):
        auth.verify_token(SECRET, raw.decode("latin-1"), VALID_SID, NOW)
