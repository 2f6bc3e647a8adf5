"""Pure tests of session tokens (relay.protocol.auth): JWTs issued and verified, key sets and
rotation, pinned algorithms, weak secrets refused, and no forgery verifies. The minting
examples of docs/PROTOCOL.md are run here, so the documentation cannot drift."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from pathlib import Path
from typing import Any

import jwt
import jwt.types
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.protocol.auth import (
    MAX_TOKEN_LEN,
    Claims,
    Key,
    KeySet,
    TokenExpired,
    TokenForbidden,
    TokenInvalid,
    TokenMissing,
    TokenNotYetValid,
    TokenUnknownKey,
    TokenWrongScope,
    TokenWrongSession,
    WeakSecret,
    check_secret,
    extract_token,
    issue_token,
    load_keys,
    verify_token,
)

SECRET = "s3cret-for-tests-0f8e2a6c4b1d9e7a5c3b"
NOW = 1_800_000_000.0
sids = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def forge(header: dict[str, Any], claims: dict[str, Any], sign: Any = None) -> str:
    """A token assembled by hand: ``sign(signing_input) -> bytes`` or no signature."""
    head = b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())
    return f"{head}.{b64(sign(head.encode())) if sign else ''}"


def claims_for(sid: str = "abc", **kw: Any) -> dict[str, Any]:
    return {"sub": sid, "scope": "watch", "iat": int(NOW), "exp": int(NOW) + 60, **kw}


def test_a_fresh_token_is_a_standard_jwt_with_its_claims() -> None:
    tok = issue_token(SECRET, "abc", 60, NOW, scope="write")
    assert jwt.get_unverified_header(tok) == {"alg": "HS256", "typ": "JWT", "kid": "k1"}
    off: jwt.types.Options = {"verify_exp": False, "verify_iat": False}  # NOW: not the clock
    body = jwt.decode(tok, SECRET, algorithms=["HS256"], options=off)
    jti = body.pop("jti")
    assert body == {"sub": "abc", "scope": "write", "iat": int(NOW), "exp": int(NOW) + 60}
    twin = issue_token(SECRET, "abc", 60, NOW, scope="write")  # same claims, same second
    assert jwt.decode(twin, SECRET, ["HS256"], options=off)["jti"] != jti
    got = verify_token(SECRET, tok, "abc", NOW + 59, need="write")
    assert got == Claims("abc", int(NOW) + 60, "write", int(NOW), "k1", jti)


def test_expired_and_not_yet_valid_tokens_are_refused() -> None:
    tok = issue_token(SECRET, "abc", 60, NOW)
    with pytest.raises(TokenExpired):
        verify_token(SECRET, tok, "abc", NOW + 60)
    with pytest.raises(TokenNotYetValid):  # issued an hour from now (a skewed or forged clock)
        verify_token(SECRET, tok, "abc", NOW - 3600)
    verify_token(SECRET, tok, "abc", NOW - 10)  # within the 30 s leeway
    nbf = jwt.encode(claims_for(nbf=int(NOW) + 600), SECRET, "HS256", headers={"kid": "k1"})
    with pytest.raises(TokenNotYetValid):
        verify_token(SECRET, nbf, "abc", NOW)


def test_scope_and_session_are_enforced() -> None:
    watch = issue_token(SECRET, "abc", 60, NOW)
    with pytest.raises(TokenWrongScope):
        verify_token(SECRET, watch, "abc", NOW, need="write")
    with pytest.raises(TokenWrongSession):
        verify_token(SECRET, watch, "abd", NOW)


def test_alg_none_is_refused() -> None:
    for alg in ("none", "None", "NONE"):
        tok = forge({"alg": alg, "typ": "JWT", "kid": "k1"}, claims_for())
        with pytest.raises(TokenInvalid):
            verify_token(SECRET, tok, "abc", NOW)
        with pytest.raises(TokenInvalid):  # with a signature part too
            verify_token(SECRET, tok + "AAAA", "abc", NOW)


def test_hs256_signed_with_a_public_key_is_refused() -> None:
    """The classic confusion: an RS256 verifier handed an HS256 token whose HMAC key is
    the (public) PEM of the RSA key."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    keys = KeySet([Key("r1", "RS256", private.public_key())])
    tok = forge(
        {"alg": "HS256", "typ": "JWT", "kid": "r1"},
        claims_for(),
        lambda data: hmac.new(pem, data, hashlib.sha256).digest(),
    )
    with pytest.raises(TokenInvalid, match="RS256"):
        verify_token(keys, tok, "abc", NOW)
    good = jwt.encode(claims_for(), private, "RS256", headers={"kid": "r1"})
    assert verify_token(keys, good, "abc", NOW).kid == "r1"


def test_unknown_kid_and_missing_kid_are_refused() -> None:
    other = jwt.encode(claims_for(), SECRET, "HS256", headers={"kid": "k9"})
    with pytest.raises(TokenUnknownKey):
        verify_token(SECRET, other, "abc", NOW)
    bare = jwt.encode(claims_for(), SECRET, "HS256")
    with pytest.raises(TokenUnknownKey):
        verify_token(SECRET, bare, "abc", NOW)


def test_rotation_old_and_new_secrets_both_verify_until_the_old_kid_is_removed() -> None:
    old, new = SECRET, "n3w-secret-for-tests-7a1c9e3b5d2f4a6c8e"
    before = KeySet.from_secret(old, "k1")
    during = KeySet([Key.hs256("k2", new), Key.hs256("k1", old)], "k2")
    after = KeySet.from_secret(new, "k2")
    t_old = issue_token(before, "abc", 60, NOW)
    t_new = issue_token(during, "abc", 60, NOW)
    assert jwt.get_unverified_header(t_new)["kid"] == "k2"
    assert verify_token(during, t_old, "abc", NOW).kid == "k1"
    assert verify_token(after, t_new, "abc", NOW).kid == "k2"
    with pytest.raises(TokenUnknownKey):  # removing a kid revokes its tokens
        verify_token(after, t_old, "abc", NOW)


def test_es256_verifier_holds_only_the_public_key_and_cannot_mint(tmp_path: Path) -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    priv_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private))
    pub_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private.public_key()))
    (tmp_path / "worker.json").write_text(json.dumps({"keys": [{**priv_jwk, "kid": "e1"}]}))
    (tmp_path / "relay.json").write_text(json.dumps({"keys": [{**pub_jwk, "kid": "e1"}]}))
    worker = load_keys(None, "e1", str(tmp_path / "worker.json"))
    relay = load_keys(None, "e1", str(tmp_path / "relay.json"))
    assert worker.has_private_keys() == ["e1"]
    assert relay.has_private_keys() == []
    assert relay.signing is None
    tok = issue_token(worker, "abc", 60, NOW, scope="write")
    assert jwt.get_unverified_header(tok)["alg"] == "ES256"
    assert verify_token(relay, tok, "abc", NOW, need="write").scope == "write"
    with pytest.raises(ValueError, match="signing"):
        issue_token(relay, "abc", 60, NOW)
    forged = forge(  # HS256 with the public key's JWK text as the secret
        {"alg": "HS256", "typ": "JWT", "kid": "e1"},
        claims_for(),
        lambda data: hmac.new(json.dumps(pub_jwk).encode(), data, hashlib.sha256).digest(),
    )
    with pytest.raises(TokenInvalid):
        verify_token(relay, forged, "abc", NOW)


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        ("k", "at least 32"),
        ("x" * 31, "at least 32"),
        ("x" * 40, "distinct"),
        ("change-me-in-production-0123456789abcdef", "example"),
        ("demo-secret-change-me-0123456789abcdefgh", "example"),
    ],
)
def test_weak_or_default_secrets_are_refused(secret: str, why: str) -> None:
    with pytest.raises(WeakSecret, match=why):
        check_secret(secret)
    with pytest.raises(WeakSecret):
        issue_token(secret, "abc", 60, NOW)


def test_key_files_are_checked(tmp_path: Path) -> None:
    def load(doc: object) -> KeySet:
        path = tmp_path / "keys.json"
        path.write_text(json.dumps(doc))
        return load_keys(None, "k1", str(path))

    with pytest.raises(WeakSecret, match="JWK Set"):
        load([])
    with pytest.raises(WeakSecret, match="at least 32"):
        load({"keys": [{"kty": "oct", "kid": "k1", "k": b64(b"short")}]})
    with pytest.raises(WeakSecret, match="kty"):
        load({"keys": [{"kty": "OKP", "kid": "k1"}]})
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(small.public_key()))
    with pytest.raises(WeakSecret, match="2048"):
        load({"keys": [{**rsa_jwk, "kid": "r"}]})
    with pytest.raises(WeakSecret, match="cannot read"):
        load_keys(None, "k1", str(tmp_path / "absent.json"))
    ks = load({"keys": [{"kty": "oct", "kid": "k1", "k": b64(SECRET.encode())}]})
    assert verify_token(ks, issue_token(SECRET, "abc", 60, NOW), "abc", NOW).kid == "k1"


@pytest.mark.parametrize(
    "token",
    ["x", "a.b", "a.b.c.d", "!!!.???.!!!", "abc..", ".abc.", "a" * (MAX_TOKEN_LEN + 1), "e30.e30."],
)
def test_malformed_tokens_are_invalid(token: str) -> None:
    with pytest.raises(TokenInvalid):
        verify_token(SECRET, token, "abc", NOW)


def test_padded_or_noncanonical_base64_is_invalid() -> None:
    tok = issue_token(SECRET, "abc", 60, NOW)
    head, body, sig = tok.split(".")
    with pytest.raises(TokenInvalid):
        verify_token(SECRET, f"{head}.{body}.{sig}=", "abc", NOW)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = alphabet[alphabet.index(sig[-1]) ^ 1]  # the unused low bits of the last character
    raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    assert base64.urlsafe_b64decode(sig[:-1] + twin + "=" * (-len(sig) % 4)) == raw
    with pytest.raises(TokenInvalid, match="canonical"):
        verify_token(SECRET, f"{head}.{body}.{sig[:-1]}{twin}", "abc", NOW)


def test_extract_prefers_bearer_header_then_query() -> None:
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
    with pytest.raises(TokenMissing):
        verify_token(SECRET, "", "abc", NOW)


@settings(max_examples=200)
@given(sid=sids, ttl=st.integers(1, 10**8), scope=st.sampled_from(["watch", "write"]))
def test_roundtrip_for_any_session(sid: str, ttl: int, scope: Any) -> None:
    tok = issue_token(SECRET, sid, ttl, NOW, scope=scope)
    assert len(tok) <= MAX_TOKEN_LEN
    claims = verify_token(SECRET, tok, sid, NOW, max_lifetime_s=10**8)
    assert (claims.session, claims.expires, claims.scope) == (sid, int(NOW) + ttl, scope)


@settings(max_examples=300)
@given(sid=sids, pos=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_any_single_byte_change_is_refused(sid: str, pos: int, flip: int) -> None:
    tok = issue_token(SECRET, sid, 3600, NOW).encode()
    i = pos % len(tok)
    mutated = bytearray(tok)
    mutated[i] = (mutated[i] + flip) % 256
    with pytest.raises(TokenForbidden):
        verify_token(SECRET, mutated.decode("latin-1"), sid, NOW)


@settings(max_examples=300)
@given(token=st.text(max_size=300), sid=sids)
def test_arbitrary_text_never_verifies(token: str, sid: str) -> None:
    with pytest.raises((TokenForbidden, TokenMissing)):
        verify_token(SECRET, token, sid, NOW)


@settings(max_examples=100)
@given(sid=sids, other=sids)
def test_a_token_never_opens_another_session(sid: str, other: str) -> None:
    tok = issue_token(SECRET, sid, 3600, NOW)
    if other == sid:
        verify_token(SECRET, tok, other, NOW)
    else:
        with pytest.raises(TokenWrongSession):
            verify_token(SECRET, tok, other, NOW)


# -- the documented minting examples ---------------------------------------------------


def _doc_example(name: str) -> str:
    text = PROTOCOL.read_text()
    found = re.search(rf"<!-- example: {name} -->\s*```\w*\n(.*?)```", text, re.S)
    assert found is not None, f"docs/PROTOCOL.md has no example {name}"
    return found.group(1)


def test_the_documented_python_example_mints_tokens_the_relay_accepts() -> None:
    scope: dict[str, Any] = {}
    exec(_doc_example("mint-python"), scope)
    tok = scope["mint"](SECRET, "k1", "abc", "write", 600)
    claims = verify_token(SECRET, tok, "abc", time.time(), need="write")
    assert (claims.session, claims.scope, claims.kid) == ("abc", "write", "k1")


# -- malleability, critical extensions, lifetime, identity --------------------------------

P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def _es256_pair() -> tuple[KeySet, KeySet, Any]:
    private = ec.generate_private_key(ec.SECP256R1())
    signer = KeySet([Key("e1", "ES256", private.public_key(), private)], "e1")
    verifier = KeySet([Key("e1", "ES256", private.public_key())])
    return signer, verifier, private


def _flip_s(token: str) -> str:
    """The same ES256 token with its signature's ``s`` replaced by ``n - s``: an equally
    valid ECDSA signature (the malleability of ECDSA), a different token string."""
    head, body, sig = token.split(".")
    raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    r, s = raw[:32], int.from_bytes(raw[32:], "big")
    return f"{head}.{body}.{b64(r + (P256_N - s).to_bytes(32, 'big'))}"


def test_es256_tokens_are_minted_low_s_and_the_high_s_twin_is_refused() -> None:
    signer, verifier, _ = _es256_pair()
    for _ in range(16):  # a random s is high half of the time: every one minted is low
        tok = issue_token(signer, "abc", 60, NOW)
        raw = base64.urlsafe_b64decode(tok.split(".")[2] + "==")
        assert int.from_bytes(raw[32:], "big") <= P256_N // 2
        assert verify_token(verifier, tok, "abc", NOW).kid == "e1"
        with pytest.raises(TokenInvalid, match="low-S"):
            verify_token(verifier, _flip_s(tok), "abc", NOW)


def test_a_high_s_es256_token_of_another_library_is_refused() -> None:
    """PyJWT signs with a random s: its high-S tokens verify mathematically and are
    refused here (a minter normalises s, docs/PROTOCOL.md says how)."""
    _, verifier, private = _es256_pair()
    seen_high = False
    for _ in range(64):
        tok = jwt.encode(claims_for(), private, "ES256", headers={"kid": "e1"})
        raw = base64.urlsafe_b64decode(tok.split(".")[2] + "==")
        if int.from_bytes(raw[32:], "big") > P256_N // 2:
            seen_high = True
            with pytest.raises(TokenInvalid, match="low-S"):
                verify_token(verifier, tok, "abc", NOW)
        else:
            verify_token(verifier, tok, "abc", NOW)
    assert seen_high


@pytest.mark.parametrize(
    "sig",
    [
        b"\x00" * 64,  # r = s = 0
        P256_N.to_bytes(32, "big") + (1).to_bytes(32, "big"),  # r = n
        b"\x01" * 63,  # short
        b"\x01" * 65,  # long
    ],
)
def test_out_of_range_or_misshapen_es256_signatures_are_invalid(sig: bytes) -> None:
    _, verifier, _ = _es256_pair()
    tok = forge({"alg": "ES256", "typ": "JWT", "kid": "e1"}, claims_for(), lambda _: sig)
    with pytest.raises(TokenInvalid):
        verify_token(verifier, tok, "abc", NOW)


@pytest.mark.parametrize("crit", [["exp"], ["b64"], ["x-unknown"], [], "exp"])
def test_a_critical_header_extension_is_refused(crit: Any) -> None:
    """RFC 7515 4.1.11: a recipient that does not understand an extension listed in
    ``crit`` must reject the JWS; this verifier understands none."""
    tok = jwt.encode(claims_for(), SECRET, "HS256", headers={"kid": "k1", "crit": crit})
    with pytest.raises(TokenInvalid, match="crit"):
        verify_token(SECRET, tok, "abc", NOW)


def test_a_lifetime_past_the_maximum_is_refused() -> None:
    day = 86_400
    forever = jwt.encode(claims_for(exp=int(NOW) + 10**10), SECRET, "HS256", headers={"kid": "k1"})
    with pytest.raises(TokenInvalid, match="lifetime"):
        verify_token(SECRET, forever, "abc", NOW)  # the default maximum: a day
    longest = jwt.encode(claims_for(exp=int(NOW) + day), SECRET, "HS256", headers={"kid": "k1"})
    verify_token(SECRET, longest, "abc", NOW)
    with pytest.raises(TokenInvalid, match="lifetime"):
        verify_token(SECRET, longest, "abc", NOW, max_lifetime_s=3600)
    # an old iat does not stretch it: exp - iat is what is bounded
    stale = jwt.encode(
        claims_for(iat=int(NOW) - 2 * day, exp=int(NOW) + 60), SECRET, "HS256",
        headers={"kid": "k1"},
    )  # fmt: skip
    with pytest.raises(TokenInvalid, match="lifetime"):
        verify_token(SECRET, stale, "abc", NOW)
    assert verify_token(SECRET, issue_token(SECRET, "abc", day, NOW), "abc", NOW)


def test_the_identity_of_a_token_is_its_jti_or_its_claims() -> None:
    a = verify_token(SECRET, issue_token(SECRET, "abc", 60, NOW), "abc", NOW)
    b = verify_token(SECRET, issue_token(SECRET, "abc", 60, NOW), "abc", NOW)
    assert a.identity != b.identity  # two minted tokens: two jti
    plain = jwt.encode(claims_for(), SECRET, "HS256", headers={"kid": "k1"})
    # the same claims in another JSON spelling: another string, one identity
    spaced = forge(
        {"alg": "HS256", "typ": "JWT", "kid": "k1"},
        claims_for(),
        lambda data: hmac.new(SECRET.encode(), data, hashlib.sha256).digest(),
    )
    assert plain != spaced
    one = verify_token(SECRET, plain, "abc", NOW)
    two = verify_token(SECRET, spaced, "abc", NOW)
    assert one.identity == two.identity
    later = jwt.encode(claims_for(exp=int(NOW) + 61), SECRET, "HS256", headers={"kid": "k1"})
    assert verify_token(SECRET, later, "abc", NOW).identity != one.identity
