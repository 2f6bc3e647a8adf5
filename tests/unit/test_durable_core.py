"""The Durable Streams protocol's pure rules (relay.durable.core)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from relay.durable import core
from relay.durable.core import BadRequest
from relay.edge.config import RelayConfig
from relay.service.settings import ConfigError


def test_offsets_sort_as_their_numbers_and_round_trip() -> None:
    texts = [core.format_offset(n) for n in (0, 1, 9, 10, 99, 100, 12345)]
    assert texts == sorted(texts)
    assert [core.parse_offset(t) for t in texts] == [0, 1, 9, 10, 99, 100, 12345]
    assert all(c.isdigit() or c == "_" for t in texts for c in t)
    assert core.parse_offset(None) == 0
    assert core.parse_offset("-1") == 0
    assert core.parse_offset("now") is None


@pytest.mark.parametrize(
    "text", ["", "abc", "12", "-2", "0000000000000001", "0000000000000001_0000000000000001"]
)
def test_malformed_offsets_are_refused(text: str) -> None:
    with pytest.raises(BadRequest, match="malformed offset"):
        core.parse_offset(text)


@pytest.mark.parametrize("value", ["+60", "060", "1.5", "3.6e3", "-1", "", " 6"])
def test_ttl_must_be_a_plain_decimal(value: str) -> None:
    with pytest.raises(BadRequest):
        core.parse_ttl(value)


def test_ttl_and_expiry_parse() -> None:
    assert core.parse_ttl("0") == 0
    assert core.parse_ttl("3600") == 3600
    parsed = core.parse_expires_at("2030-01-01T00:00:00Z")
    assert parsed is not None
    assert parsed[1] == 1893456000000
    for bad in ("tomorrow", "2030-01-01", "2030-01-01T00:00:00"):
        with pytest.raises(BadRequest):
            core.parse_expires_at(bad)


def test_producer_headers_go_together_and_are_bounded() -> None:
    assert core.parse_producer(None, None, None) is None
    assert core.parse_producer("p", "0", "7") == ("p", 0, 7)
    for args in [("p", "0", None), ("", "0", "0"), ("p", "-1", "0"), ("p", "01", "0"),
                 ("p", str(1 << 53), "0")]:  # fmt: skip
        with pytest.raises(BadRequest):
            core.parse_producer(*args)


def test_json_mode_flattens_one_level_and_validates() -> None:
    flat = core.body_messages(b'[[1,2], {"a": 1}]', True, allow_empty_array=False)
    assert flat == [b"[1,2]", b'{"a":1}']
    assert core.body_messages(b"[[[1]]]", True, allow_empty_array=False) == [b"[[1]]"]
    assert core.body_messages(b'{"a":1}', True, allow_empty_array=False) == [b'{"a":1}']
    assert core.body_messages(b"[]", True, allow_empty_array=True) == []
    with pytest.raises(BadRequest, match="empty JSON array"):
        core.body_messages(b"[]", True, allow_empty_array=False)
    with pytest.raises(BadRequest, match="not valid JSON"):
        core.body_messages(b"{nope", True, allow_empty_array=False)
    assert core.join_body(flat, True) == b'[[1,2],{"a":1}]'
    assert core.body_messages(b"raw", False, allow_empty_array=False) == [b"raw"]


def test_sse_data_cannot_be_injected_and_binary_is_base64() -> None:
    event = core.sse_data([b"a\r\revent: control\rdata: {}\r\nb"], False, False)
    lines = event.decode().split("\n")
    assert lines[0] == "event: data"
    assert all(line.startswith("data:") for line in lines[1:-2])  # every line is data
    blob = core.sse_data([b"\x00\x01\xff"], False, True)
    assert base64.b64decode(blob.split(b"data:")[1].strip()) == b"\x00\x01\xff"


def test_cursor_moves_past_a_client_cursor() -> None:
    now = core.CURSOR_EPOCH_S + 20 * 1000 + 5
    assert core.cursor(now, None, 1) == "1000"
    assert core.cursor(now, "999", 1) == "1000"
    assert int(core.cursor(now, "1000", 1)) > 1000
    assert int(core.cursor(now, "5000", 3600)) == 5000 + 180


def test_etag_varies_with_closure_and_cache_control() -> None:
    assert core.etag("g", 0, 3, False) != core.etag("g", 0, 3, True)
    assert core.cache_control(public=True, tail=False).startswith("public, max-age=60")
    assert core.cache_control(public=False, tail=False).startswith("private")
    assert core.cache_control(public=True, tail=True) == "no-store"


def test_stream_paths() -> None:
    assert core.stream_id("a/b") == core.stream_id("a/b")
    assert core.stream_id("a/b") != core.stream_id("a/c")
    for bad in ("", "/a", "a//b", "a b", "x" * 513):
        with pytest.raises(BadRequest):
            core.stream_id(bad)


def test_open_prefix_starts_with_a_slash_and_is_refused_with_a_key_file(tmp_path: Path) -> None:
    secret = "a-durable-test-secret-4f1c9e2a7b3d"
    ok = RelayConfig(secret=secret, durable_open_prefix="/open/").validate()
    assert ok.durable_open_prefix == "/open/"
    with pytest.raises(ConfigError, match="must start with '/'"):
        RelayConfig(secret=secret, durable_open_prefix="open/").validate()
    private = ec.generate_private_key(ec.SECP256R1())
    pub = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private.public_key()))
    keys = tmp_path / "relay.json"
    keys.write_text(json.dumps({"keys": [{**pub, "kid": "e1"}]}))
    RelayConfig(keys_file=str(keys), kid="e1").validate()  # the key file alone is fine
    with pytest.raises(ConfigError, match="refused with a production key file"):
        RelayConfig(keys_file=str(keys), kid="e1", durable_open_prefix="/").validate()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[NaN]", "NaN"),
        (b'{"a":Infinity}', "Infinity"),
        (b"[-Infinity]", "Infinity"),
        (b"[1e400]", "Infinity"),
        (b'["\\ud800"]', "surrogate"),
        (b'[{"k":["x\\udc00y"]}]', "surrogate"),
        (b"[" * 300 + b"]" * 300, "deep"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    ],
)
def test_json_mode_refuses_what_json_parse_would_not_read_back(body: bytes, words: str) -> None:
    with pytest.raises(core.BadRequest, match=words) as got:
        core.body_messages(body, True, allow_empty_array=False)
    assert got.value.status == 400


def test_json_mode_bounds_the_messages_of_one_write_early() -> None:
    """More than the bound is 413, found after bound + 1 elements (commas inside an
    element or a string do not count); a big integer survives as written."""
    assert core.body_messages(b"[1,2,3]", True, allow_empty_array=False, max_messages=3) == [
        b"1", b"2", b"3"
    ]  # fmt: skip
    same = core.body_messages(b'[[1,2,3,4], "a,b,c,d"]', True, allow_empty_array=False,
                              max_messages=2)  # fmt: skip
    assert same == [b"[1,2,3,4]", b'"a,b,c,d"']
    for body in (b"[1,2,3,4]", b" [ 1 , 2 , 3 , 4 ] ", b"[" + b"0," * 1_000_000 + b"0]"):
        with pytest.raises(core.TooLarge, match="at most 3") as got:
            core.body_messages(body, True, allow_empty_array=False, max_messages=3)
        assert got.value.status == 413
    big = b"123456789012345678901234567890"
    assert core.body_messages(b"[" + big + b"]", True, allow_empty_array=False) == [big]
