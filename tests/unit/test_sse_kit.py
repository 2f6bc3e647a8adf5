"""The one SSE encoder (relay.protocol.sse.event) writes, byte for byte, what each
front's own encoder wrote before it replaced them: the references below are those
encoders as they were, so a wire format that drifts fails here."""

from __future__ import annotations

import base64
import re
from typing import Any

import msgspec
import orjson
from hypothesis import given
from hypothesis import strategies as st

from relay.durable import core
from relay.edge.conn.base import sse_bytes
from relay.edge.core.resume import Delivery
from relay.fronts.aisdk import wire as uistream
from relay.fronts.responses import wire as responses
from relay.protocol import sse
from relay.protocol.frame import KINDS
from worker.fronts.openai import http as openai
from worker.fronts.openai import session

_LINES = re.compile(rb"\r\n|\r|\n")
_enc = msgspec.json.Encoder()


def ref_event(data: bytes, *, id: int | str | None = None, kind: str | None = None) -> bytes:
    out = bytearray()
    if id is not None:
        out += b"id: " + str(id).encode() + b"\n"
    if kind is not None:
        out += b"event: " + kind.encode() + b"\n"
    for line in _LINES.split(data):
        out += b"data: " + line + b"\n"
    out += b"\n"
    return bytes(out)


def ref_durable_data(messages: list[bytes], json_mode: bool, binary: bool) -> bytes:
    payload = core.join_body(messages, json_mode)
    if binary:
        lines = [base64.b64encode(payload)]
    else:
        lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"event: data\n" + b"".join(b"data:" + line + b"\n" for line in lines) + b"\n"


payloads = st.binary(max_size=64) | st.sampled_from([b"", b"\n", b"a\r\nb", b"\r\r\n", b"x\n"])
kinds = st.sampled_from(sorted(KINDS)) | st.from_regex(r"[a-z.]{1,12}", fullmatch=True)


@given(
    payloads,
    st.none() | st.integers(0, 2**53) | st.from_regex(r"[0-9a-z]{0,8}", fullmatch=True),
    kinds,
)
def test_event_is_the_relay_wire_as_it_was(data: bytes, ident: Any, kind: str) -> None:
    assert sse.event(data, id=ident, kind=kind) == ref_event(data, id=ident, kind=kind)
    assert sse.event(data) == ref_event(data)


@given(payloads, st.integers(1, 2**53), st.sampled_from(sorted(KINDS)))
def test_the_edge_fast_path_writes_what_event_writes(data: bytes, offset: int, kind: str) -> None:
    d = Delivery(offset, kind, data)
    assert (
        sse_bytes(d)
        == ref_event(data, id=offset, kind=kind)
        == sse.event(data, id=offset, kind=kind)
    )


@given(st.lists(payloads, max_size=4), st.booleans(), st.booleans())
def test_durable_streams_data_events_as_they_were(msgs: list[bytes], json_mode: bool,
                                                  binary: bool) -> None:  # fmt: skip
    assert core.sse_data(msgs, json_mode, binary) == ref_durable_data(msgs, json_mode, binary)


def test_durable_streams_control_event_as_it_was() -> None:
    c = b'{"streamNextOffset": "0000000000000000_0000000000000003", "upToDate": true}'
    assert sse.event(c, kind="control", space=False) == b"event: control\ndata:" + c + b"\n\n"


def test_openai_and_ui_stream_events_as_they_were() -> None:
    obj = {"id": "chatcmpl-1", "choices": [{"delta": {"content": "a\nb"}}], "x": None}
    old = b"data: " + orjson.dumps(obj) + b"\n\n"
    assert openai._event(obj) == old
    assert session._event(obj) == old
    assert uistream.encode_chunk(obj) == b"data: " + _enc.encode(obj) + b"\n\n"
    assert uistream.DONE == sse.DONE == b"data: [DONE]\n\n"
    ev = {"type": "response.output_text.delta", "delta": "hi\n", "sequence_number": 3}
    want = b"event: response.output_text.delta\ndata: " + _enc.encode(ev) + b"\n\n"
    assert responses.encode_event(ev) == want
