"""Fuzz targets of the relay's parsers: their contracts as checks, and fast input generators.

Pure (standard library + relay): no I/O, no clock except the fixed ``NOW``. Used by
``bench.fuzz.run`` (the throughput run, random + mutation loops and atheris) and by
``tests/hostile/test_fuzz.py`` (hypothesis). One target per parser that reads hostile input,
each with the contract ``check(data)`` checks:

- ``frame``, :func:`relay.protocol.frame.decode`: a :class:`~relay.protocol.frame.Frame`
  (version 1, ``0 <= offset, turn <= 2**53-1``, known kind, re-encodes to an equal
  frame) or :class:`~relay.protocol.frame.FrameError`; nothing else.
- ``session``, :func:`relay.protocol.keys.parse_session`: the id itself, in
  ``[A-Za-z0-9_-]{1,64}``, or :class:`~relay.protocol.keys.InvalidSessionId`; every key
  built from it has one ``{...}`` hash tag, the id (Redis's first-brace rule).
- ``offset``, :func:`relay.protocol.sse.resume_offset` and
  :func:`relay.protocol.sse.parse_offset`: ``None`` (absent / blank), an int in
  ``0 .. MAX_OFFSET`` equal to the stripped ASCII digits, or
  :class:`~relay.protocol.sse.OffsetError`.
- ``token``, :func:`relay.protocol.auth.verify_token` and
  :func:`relay.protocol.auth.extract_token`: never verifies (an :class:`AuthError` with a
  401/403 status), unless it is byte for byte the token issued for the session.

Order of use: ``TARGETS[name].check(data)`` raises :class:`PropertyFailed` (or any
unexpected exception) when the contract breaks; ``TARGETS[name].generate(rng)`` makes
one input (random bytes, or a mutation of a valid encoding).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from relay.protocol import auth, frame, keys, sse

__all__ = [
    "NOW",
    "SECRET",
    "SEEDS",
    "TARGETS",
    "VALID_SID",
    "VALID_TOKEN",
    "PropertyFailed",
    "Target",
    "check_frame",
    "check_offset",
    "check_session",
    "check_token",
    "hash_tag",
    "mutate",
]

SECRET: Final = b"fuzz-secret-7f3a9c1e5b2d8046a1c3e5f7b9d0"
NOW: Final = 1_800_000_000.0
VALID_SID: Final = "Sess_ion-42"
VALID_TOKEN: Final = auth.issue_token(SECRET, VALID_SID, 3600, NOW, scope="write")
_SID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_INT: Final = 2**53 - 1


class PropertyFailed(AssertionError):
    """A parser broke its contract on this input."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise PropertyFailed(what)


# -- frame ------------------------------------------------------------------------------


def check_frame(data: bytes) -> None:
    _check_frame(data)
    _check_frame(data.decode("utf-8", "surrogateescape"))  # decode() also takes str


def _check_frame(data: bytes | str) -> None:
    try:
        f = frame.decode(data)
    except frame.FrameError:
        return
    _require(f.v == frame.VERSION, "decoded a frame of another version")
    _require(0 <= f.offset <= _MAX_INT and 0 <= f.turn <= _MAX_INT, "offset/turn out of range")
    _require(f.kind in frame.KINDS, f"unknown kind {f.kind!r}")
    _require(frame.decode(frame.encode(f)) == f, "re-encoding changed the frame")


# -- session ids and keys ---------------------------------------------------------------


def hash_tag(name: str) -> str:
    """What Redis Cluster hashes: the text between the first ``{`` and the first ``}``
    after it, if non-empty; else the whole name."""
    start = name.find("{")
    if start == -1:
        return name
    end = name.find("}", start + 1)
    if end == -1 or end == start + 1:
        return name
    return name[start + 1 : end]


def check_session(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    try:
        sid = keys.parse_session(text)
    except keys.InvalidSessionId:
        _require(_SID_RE.fullmatch(text) is None, f"refused a valid id {text!r}")
        return
    _require(sid == text, "parse_session changed the id")
    _require(_SID_RE.fullmatch(sid) is not None, f"accepted {sid!r}")
    for kind in keys.KeyKind:
        name = keys.key(sid, kind)
        _require(name.count("{") == 1 and name.count("}") == 1, f"{name!r}: not one tag")
        _require(hash_tag(name) == sid, f"{name!r} hashes on {hash_tag(name)!r}")
    for name in (keys.live_channel(sid), keys.log_key(sid), keys.idem_key(sid, "}{x}")):
        _require(hash_tag(name) == sid, f"{name!r} hashes on {hash_tag(name)!r}")


# -- resume offsets ---------------------------------------------------------------------


def _expected_offset(raw: str) -> int | str | None:
    text = raw.strip(" \t")
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 16 or int(text) > _MAX_INT:
        return "error"
    return int(text)


def check_offset(data: bytes) -> None:
    raw = data.decode("utf-8", "surrogateescape")
    half = len(raw) // 2
    cases = ((raw, None), (None, raw), (raw[:half], raw[half:]))
    for header, query in cases:
        try:
            got: int | str | None = sse.resume_offset(header, query)
        except sse.OffsetError:
            got = "error"
        hv = None if header is None else _expected_offset(header)
        want = hv if hv is not None else (None if query is None else _expected_offset(query))
        _require(got == want, f"resume_offset({header!r}, {query!r}) = {got!r}, want {want!r}")
    try:
        got = sse.parse_offset(raw, name="from")
    except sse.OffsetError as exc:
        _require(str(exc).startswith("from "), "reason does not name the parameter")
        got = "error"
    _require(got == _expected_offset(raw), f"parse_offset({raw!r}) = {got!r}")


# -- tokens -----------------------------------------------------------------------------


def check_token(data: bytes) -> None:
    token = data.decode("utf-8", "surrogateescape")
    for need in ("watch", "write"):
        try:
            auth.verify_token(SECRET, token, VALID_SID, NOW, need=need)
        except auth.AuthError as exc:
            _require(exc.status in (401, 403) and bool(exc.reason), "bad AuthError")
            continue
        _require(token == VALID_TOKEN, f"a token that was never issued verified: {token!r}")
    try:
        got = auth.extract_token(token, None)
    except auth.AuthError as exc:
        _require(exc.status in (401, 403), "bad AuthError from extract_token")
    else:
        _require(bool(got) and " " not in got, f"extract_token gave {got!r}")


# -- generators -------------------------------------------------------------------------

SEEDS: Final[dict[str, list[bytes]]] = {
    "frame": [
        frame.encode(frame.Frame(session=VALID_SID, turn=1, offset=7, kind="token", text="Hé")),
        frame.encode(frame.gap_frame(VALID_SID, 3, 9)),
        b'{"v":1,"session":"s","turn":0,"offset":0,"kind":"done","meta":{"a":[1,2.5,null]}}',
    ],
    "session": [VALID_SID.encode(), b"a" * 64, b"{x}", b"a\r\nb", b"a\x00"],
    "offset": [b"0", b"42", b" 9007199254740991\t", b"9007199254740992", b"-1", b"\xd9\xa1"],
    "token": [VALID_TOKEN.encode(), b"Bearer " + VALID_TOKEN.encode()],
}
_INTERESTING: Final = [
    b"{", b"}", b"[", b"]", b'"', b":", b",", b"\\u0000", b"\\ud800", b"\x00", b"\r\n", b"\xff",
    b"-1", b"1e400", b"99999999999999999999999", b"null", b"true", b" ", b"\t", b".", b"=",
    b"%", b"\xc3\xa9", b"\xef\xbc\x99",
]  # fmt: skip


def mutate(rng: random.Random, data: bytes) -> bytes:
    """1-4 random edits: bit flip, byte set/insert/delete, splice an interesting token,
    duplicate or truncate a range."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 2:
            buf[pos:pos] = bytes([rng.randrange(256)])
        elif op == 3 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 4:
            buf[pos:pos] = rng.choice(_INTERESTING)
        elif op == 5 and buf:
            j = rng.randrange(len(buf))
            buf[pos:pos] = buf[j : j + rng.randint(1, 16)]
        else:
            del buf[pos:]
    return bytes(buf)


def _generator(name: str) -> Callable[[random.Random], bytes]:
    seeds = SEEDS[name]

    def generate(rng: random.Random) -> bytes:
        if rng.random() < 0.3:
            return rng.randbytes(rng.randrange(0, 96))
        return mutate(rng, rng.choice(seeds))

    return generate


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    check: Callable[[bytes], None]
    generate: Callable[[random.Random], bytes]


TARGETS: Final[dict[str, Target]] = {
    name: Target(name, check, _generator(name))
    for name, check in (
        ("frame", check_frame),
        ("session", check_session),
        ("offset", check_offset),
        ("token", check_token),
    )
}
