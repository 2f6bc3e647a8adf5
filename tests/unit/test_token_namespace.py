"""The tokens' one namespace rule: a session's token never opens a stream and a
stream's token never opens a session, whatever the ids look like (an application may
name a session ``ds_<a stream's id>``: it still reads and writes no stream)."""

from __future__ import annotations

import time

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given
from hypothesis import strategies as st

from relay.durable.auth import token_subject
from relay.durable.core import stream_id
from relay.protocol.auth import (
    KeySet,
    TokenInvalid,
    TokenWrongSession,
    issue_token,
    verify_token,
)
from relay.protocol.subjects import is_stream_subject, stream_subject
from worker.access import WorkerAccess

SECRET = "unit-test-secret-3f9a1c7e5b2d8046aa"
KEYS = KeySet.from_secret(SECRET)
PATH = "chats/room-1"
NOW = time.time()


def test_a_stream_subject_can_never_be_a_session_id() -> None:
    sub = token_subject(PATH)
    assert is_stream_subject(sub)
    assert sub == stream_subject(stream_id(PATH))
    assert ":" in sub  # a session id is [A-Za-z0-9_-]{1,64}: never this


def test_a_session_named_after_a_stream_gets_no_token_for_the_stream() -> None:
    # the session an application called ds_<the stream's id>
    lookalike = f"ds_{stream_id(PATH)}"
    token = issue_token(KEYS, lookalike, 300, NOW, scope="write")
    verify_token(KEYS, token, lookalike, NOW, need="write")  # its own session: fine
    for need in ("watch", "write"):
        with pytest.raises(TokenWrongSession, match="session's token does not open a stream"):
            verify_token(KEYS, token, token_subject(PATH), NOW, need=need)


def test_a_stream_token_opens_no_session() -> None:
    token = issue_token(KEYS, token_subject(PATH), 300, NOW, scope="write")
    verify_token(KEYS, token, token_subject(PATH), NOW, need="write")  # its own stream: fine
    for sid in (f"ds_{stream_id(PATH)}", stream_id(PATH), "any-session"):
        with pytest.raises(TokenWrongSession, match="stream's token does not open a session"):
            verify_token(KEYS, token, sid, NOW)


def test_a_stream_token_names_no_session_at_the_gateway() -> None:
    """The OpenAI gateway finds the session of a write token by its ``sub``: a stream's
    write token names none."""
    access = WorkerAccess(KEYS)
    stream_token = issue_token(KEYS, token_subject(PATH), 300, NOW, scope="write")
    request = make_mocked_request(
        "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {stream_token}"}
    )
    assert access.token_session(request) is None
    session_token = issue_token(KEYS, "s-1", 300, NOW, scope="write")
    request = make_mocked_request(
        "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {session_token}"}
    )
    assert access.token_session(request) == "s-1"


@given(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True))
def test_no_session_id_is_a_stream_subject(sid: str) -> None:
    assert not is_stream_subject(sid)
    token = issue_token(KEYS, sid, 300, NOW)
    with pytest.raises(TokenWrongSession):
        verify_token(KEYS, token, stream_subject(sid), NOW)


def test_a_malformed_stream_subject_is_refused() -> None:
    with pytest.raises(ValueError, match="stream id"):
        stream_subject("a:b")
    with pytest.raises(ValueError):
        issue_token(KEYS, "ds:", 300, NOW)
    with pytest.raises(TokenInvalid):
        verify_token(KEYS, "a.b.c", token_subject(PATH), NOW)


def test_every_front_reads_the_token_the_same_way() -> None:
    """relay.service.tokens: the header first, else the first ``token`` parameter; a
    401 challenges, a 403 does not."""
    from relay.protocol.auth import TokenMissing
    from relay.service.tokens import challenge, request_claims, request_token

    token = issue_token(KEYS, "s-1", 300, NOW)
    by_query = make_mocked_request("GET", f"/x?a=1&token={token}&token=other")
    assert request_token(by_query) == token
    both = make_mocked_request(
        "GET", "/x?token=other", headers={"Authorization": f"Bearer {token}"}
    )
    assert request_token(both) == token
    assert request_claims(KEYS, by_query, "s-1", max_lifetime_s=3600).session == "s-1"
    with pytest.raises(TokenMissing) as missing:
        request_claims(KEYS, make_mocked_request("GET", "/x"), "s-1", max_lifetime_s=3600)
    assert challenge(missing.value) == {"WWW-Authenticate": 'Bearer realm="tokenrelay"'}
    with pytest.raises(TokenWrongSession) as wrong:
        request_claims(KEYS, by_query, token_subject(PATH), max_lifetime_s=3600)
    assert challenge(wrong.value) == {}


def test_a_second_token_is_read_from_its_own_header() -> None:
    """``request_claims(header=...)``: a route that opens two subjects (a fork reads its
    source) checks the second one's token from that header, bare, never the request's
    own; without the header, no token."""
    from relay.protocol.auth import TokenMissing
    from relay.service.tokens import request_claims

    source = token_subject("chats/source")
    own = issue_token(KEYS, token_subject(PATH), 300, NOW, scope="write")
    theirs = issue_token(KEYS, source, 300, NOW)
    h = "Stream-Forked-From-Token"
    request = make_mocked_request(
        "PUT", "/x", headers={"Authorization": f"Bearer {own}", h: theirs}
    )
    assert request_claims(KEYS, request, source, max_lifetime_s=3600, header=h).session == source
    with pytest.raises(TokenWrongSession):
        request_claims(KEYS, request, token_subject(PATH), max_lifetime_s=3600, header=h)
    alone = make_mocked_request("PUT", "/x", headers={"Authorization": f"Bearer {theirs}"})
    with pytest.raises(TokenMissing):
        request_claims(KEYS, alone, source, max_lifetime_s=3600, header=h)
