"""Pure tests of watch tokens (relay.auth): issue, verify, and no forgery verifies."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.auth import (
    MAX_TOKEN_LEN,
    Claims,
    TokenExpired,
    TokenForbidden,
    TokenInvalid,
    TokenMissing,
    TokenWrongScope,
    TokenWrongSession,
    extract_token,
    issue_token,
    verify_token,
)

SECRET = "s3cret-for-tests"
NOW = 1_800_000_000.0
sids = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)


def test_a_fresh_token_verifies_with_its_claims():
    tok = issue_token(SECRET, "abc", 60, NOW)
    assert verify_token(SECRET, tok, "abc", NOW + 59) == Claims("abc", int(NOW) + 60, "watch")


def test_token_is_compact_and_url_safe():
    tok = issue_token(SECRET, "A" * 22, 3600, NOW, scope="write")
    assert len(tok) < 100
    assert set(tok) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


def test_expired_at_the_expiry_second():
    tok = issue_token(SECRET, "abc", 60, NOW)
    with pytest.raises(TokenExpired, match="expired"):
        verify_token(SECRET, tok, "abc", NOW + 60)


def test_token_of_another_session_is_wrong_session():
    tok = issue_token(SECRET, "abc", 60, NOW)
    with pytest.raises(TokenWrongSession) as err:
        verify_token(SECRET, tok, "abd", NOW)
    assert err.value.status == 403
    assert err.value.error == "token_wrong_session"


def test_other_secret_is_invalid():
    tok = issue_token("other-secret", "abc", 60, NOW)
    with pytest.raises(TokenInvalid, match="signature"):
        verify_token(SECRET, tok, "abc", NOW)


def test_write_scope_allows_watch_but_watch_scope_does_not_allow_write():
    write = issue_token(SECRET, "abc", 60, NOW, scope="write")
    watch = issue_token(SECRET, "abc", 60, NOW)
    assert verify_token(SECRET, write, "abc", NOW).scope == "write"
    assert verify_token(SECRET, write, "abc", NOW, need="write").scope == "write"
    with pytest.raises(TokenWrongScope):
        verify_token(SECRET, watch, "abc", NOW, need="write")


def test_empty_token_is_missing_401():
    with pytest.raises(TokenMissing) as err:
        verify_token(SECRET, "", "abc", NOW)
    assert err.value.status == 401


def test_empty_secret_is_refused():
    with pytest.raises(ValueError, match="secret"):
        issue_token("", "abc", 60, NOW)
    with pytest.raises(ValueError, match="secret"):
        verify_token(b"", "x.y", "abc", NOW)


@pytest.mark.parametrize(
    "token",
    ["x", "a.b.c", "!!!.???", "abc.", ".abc", "a" * (MAX_TOKEN_LEN + 1), "YQ.YQ", "YR.YQ"],
)
def test_malformed_tokens_are_invalid(token):
    with pytest.raises(TokenInvalid):
        verify_token(SECRET, token, "abc", NOW)


def test_padded_or_noncanonical_base64_is_invalid():
    tok = issue_token(SECRET, "abc", 60, NOW)
    payload, sig = tok.split(".")
    with pytest.raises(TokenInvalid):
        verify_token(SECRET, f"{payload}=.{sig}", "abc", NOW)
    # flip the unused low bits of the last character of the signature
    last = sig[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = alphabet[alphabet.index(last) ^ 1]
    raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    if base64.urlsafe_b64decode(sig[:-1] + twin + "=" * (-len(sig) % 4)) == raw:
        with pytest.raises(TokenInvalid, match="canonical"):
            verify_token(SECRET, f"{payload}.{sig[:-1]}{twin}", "abc", NOW)


def test_extract_prefers_bearer_header_then_query():
    assert extract_token("Bearer t1", "t2") == "t1"
    assert extract_token("bearer  t1 ", None) == "t1"
    assert extract_token(None, "t2") == "t2"
    with pytest.raises(TokenMissing):
        extract_token(None, None)
    with pytest.raises(TokenMissing):
        extract_token("", "")
    with pytest.raises(TokenInvalid, match="Bearer"):
        extract_token("Basic dXNlcjpwYXNz", None)
    with pytest.raises(TokenInvalid):
        extract_token("Bearer a b", None)


@settings(max_examples=200)
@given(sid=sids, ttl=st.integers(1, 10**8), scope=st.sampled_from(["watch", "write"]))
def test_roundtrip_for_any_session(sid, ttl, scope):
    tok = issue_token(SECRET, sid, ttl, NOW, scope=scope)
    assert len(tok) <= MAX_TOKEN_LEN
    claims = verify_token(SECRET, tok, sid, NOW)
    assert (claims.session, claims.expires, claims.scope) == (sid, int(NOW) + ttl, scope)


@settings(max_examples=300)
@given(sid=sids, pos=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_any_single_byte_change_is_refused(sid, pos, flip):
    tok = issue_token(SECRET, sid, 3600, NOW).encode()
    i = pos % len(tok)
    mutated = bytearray(tok)
    mutated[i] = (mutated[i] + flip) % 256
    text = mutated.decode("latin-1")
    with pytest.raises(TokenForbidden):
        verify_token(SECRET, text, sid, NOW)


@settings(max_examples=300)
@given(token=st.text(max_size=300), sid=sids)
def test_arbitrary_text_never_verifies(token, sid):
    with pytest.raises((TokenForbidden, TokenMissing)):
        verify_token(SECRET, token, sid, NOW)


@settings(max_examples=200)
@given(
    payload=st.binary(min_size=0, max_size=80),
    sig=st.binary(min_size=0, max_size=40),
    sid=sids,
)
def test_forged_payload_and_signature_never_verify(payload, sig, sid):
    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    with pytest.raises((TokenForbidden, TokenMissing)):
        verify_token(SECRET, f"{b64(payload)}.{b64(sig)}", sid, NOW)


@settings(max_examples=100)
@given(sid=sids, other=sids)
def test_a_token_never_opens_another_session(sid, other):
    tok = issue_token(SECRET, sid, 3600, NOW)
    if other == sid:
        verify_token(SECRET, tok, other, NOW)
    else:
        with pytest.raises(TokenWrongSession):
            verify_token(SECRET, tok, other, NOW)
