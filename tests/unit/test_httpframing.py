"""The request framing tracker: where heads and bodies end, pure, no sockets."""

from __future__ import annotations

import pytest

from relay.service.httpframing import MAX_HEAD_BYTES, Deadline, Framing, State

GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /t HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = (
    b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
)
WS = (
    b"GET /v1/sessions/s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
    b"Connection: keep-alive, Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def fed(*chunks: bytes) -> Framing:
    f = Framing()
    for c in chunks:
        f.feed(c)
    return f


def bytewise(data: bytes) -> Framing:
    return fed(*(data[i : i + 1] for i in range(len(data))))


def test_a_new_connection_is_on_its_first_heads_deadline() -> None:
    f = Framing()
    assert f.state is State.IDLE
    assert f.deadline() is Deadline.HEAD  # from the opening: nothing sent is a slow head
    f.feed(b"GET / HT")
    assert (f.state, f.deadline()) == (State.HEAD, Deadline.HEAD)


@pytest.mark.parametrize("request_bytes", [GET, POST, CHUNKED], ids=["get", "length", "chunked"])
@pytest.mark.parametrize("split", ["whole", "bytewise"])
def test_a_request_ends_where_its_body_ends(request_bytes: bytes, split: str) -> None:
    f = fed(request_bytes) if split == "whole" else bytewise(request_bytes)
    assert (f.state, f.heads, f.inflight) == (State.IDLE, 1, 1)
    assert f.deadline() is None  # answered now: no deadline of the client's
    f.response_done()
    assert (f.inflight, f.deadline()) == (0, Deadline.IDLE)


def test_the_body_deadline_runs_until_the_last_byte() -> None:
    f = fed(POST[:-1])
    assert (f.state, f.deadline()) == (State.BODY, Deadline.BODY)
    f.response_done()  # answered before the body arrived (e.g. 413): the body still counts
    assert f.deadline() is Deadline.BODY
    f.feed(POST[-1:])
    assert f.deadline() is Deadline.IDLE
    f = fed(CHUNKED[:-2])  # the trailers' empty line missing
    assert f.deadline() is Deadline.BODY


def test_pipelined_requests_in_one_chunk() -> None:
    f = fed(GET + POST + CHUNKED + GET[:10])
    assert (f.heads, f.inflight, f.state) == (3, 3, State.HEAD)  # the 4th: half a head
    for _ in range(3):
        f.response_done()
    assert f.deadline() is Deadline.HEAD
    f.feed(GET[10:])
    f.response_done()
    assert f.deadline() is Deadline.IDLE


def test_a_later_head_is_timed_from_its_first_byte() -> None:
    f = fed(GET)
    f.response_done()
    f.feed(b"\r\n\r\n")  # empty lines between requests are skipped, not a head
    assert (f.state, f.deadline()) == (State.IDLE, Deadline.IDLE)
    f.feed(b"G")
    assert (f.state, f.deadline()) == (State.HEAD, Deadline.HEAD)


def test_bare_lf_heads_and_lines() -> None:
    f = fed(b"POST / HTTP/1.1\nContent-Length: 2\n\nab" + b"GET / HTTP/1.1\n\n")
    assert (f.heads, f.state) == (2, State.IDLE)


def test_an_upgrade_is_opaque_until_its_response_ends() -> None:
    f = fed(WS + b"\x81\x85masked-frame-bytes\r\n\r\n")
    assert (f.state, f.deadline(), f.heads) == (State.OPAQUE, None, 1)
    f.response_done()  # declined (401, 426, ...): HTTP again
    assert (f.state, f.deadline()) == (State.IDLE, Deadline.IDLE)
    assert fed(b"CONNECT x:1 HTTP/1.1\r\n\r\n").state is State.OPAQUE
    # an Upgrade header without Connection: upgrade is no upgrade (as aiohttp reads it)
    assert fed(b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n").state is State.IDLE


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000,
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXY",
    ],
)
def test_framing_it_cannot_read_never_ends_so_its_deadline_does(head: bytes) -> None:
    f = fed(head, GET * 3)
    assert (f.state, f.deadline(), f.heads) == (State.BODY, Deadline.BODY, 1)


def test_a_head_too_long_to_read_still_ends() -> None:
    f = fed(b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10), b"\r\n", b"\r\n")
    assert (f.state, f.heads) == (State.BODY, 1)  # its framing unread: the body deadline
    assert len(f._buf) == 0


def test_a_content_length_of_zero_has_no_body() -> None:
    f = fed(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert (f.state, f.inflight) == (State.IDLE, 1)
