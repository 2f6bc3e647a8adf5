"""The Durable Streams protocol's pure rules: offsets, header parsing, JSON mode, the
cursor, ETags and Cache-Control (no I/O, no clock of its own: callers pass ``now``).

A malformed input raises :class:`BadRequest` (400 with its reason); the handlers of
:mod:`relay.durable.http` turn it into the response before anything reaches Redis.

Offsets: ``0000000000000000_<16 digits>``, the count of messages before the position,
zero-padded, so that they sort lexicographically as they do by number, hold only digits
and ``_`` (URL-safe, never ``-1`` nor ``now``) and are strictly increasing with every
append. The first part (always zeros) is the reference server's shape, which the
conformance suite writes itself for "the start" (``0000000000000000_0000000000000000``).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import re
from typing import Final

from relay.protocol import sse
from relay.service.jsonbody import BodyRefused, parse_json

__all__ = [
    "MAX_WRITE_MESSAGES",
    "BadRequest",
    "Offset",
    "TooLarge",
    "body_messages",
    "cache_control",
    "cursor",
    "etag",
    "format_offset",
    "is_true",
    "join_body",
    "media_type",
    "parse_epoch_ms",
    "parse_expires_at",
    "parse_offset",
    "parse_producer",
    "parse_ttl",
    "sse_data",
    "stream_id",
]

OFFSET_DIGITS: Final = 16
MAX_SAFE_INT: Final = (1 << 53) - 1
CURSOR_EPOCH_S: Final = 1728432000  # 2024-10-09T00:00:00Z, the spec's default
CURSOR_INTERVAL_S: Final = 20
_OFFSET: Final = re.compile(r"0{16}_([0-9]{16})")
_DECIMAL: Final = re.compile(r"0|[1-9][0-9]*")
_PATH: Final = re.compile(r"[A-Za-z0-9._~!$'()*+,;=:@%/-]{1,512}")
Offset = int | None  # None: "now" (the tail)
# messages of one write (a JSON array's elements): each is one Redis list element, and
# the write one atomic call whose length this bounds (docs/DURABLE.md)
MAX_WRITE_MESSAGES: Final = 10_000


class BadRequest(ValueError):
    """A 400 with this reason."""

    status = 400


class TooLarge(BadRequest):
    """A 413 with this reason: a write past a bound of the front (its messages)."""

    status = 413


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _loads(raw: bytes) -> object:
    """:func:`json.loads` (any integer survives as it was written) without the NaN and
    Infinity it accepts by default."""
    return json.loads(raw, parse_constant=_no_constant)


_WS: Final = re.compile(r"[ \t\n\r]*")
_DECODER: Final = json.JSONDecoder(parse_constant=_no_constant)


def _skip(text: str, i: int) -> int:
    m = _WS.match(text, i)
    return i if m is None else m.end()


def _refuse_past(body: bytes, limit: int) -> None:
    """:class:`TooLarge` when ``body`` is a JSON array of more than ``limit`` elements,
    found after ``limit + 1`` of them (a million tiny ones cost no more than that); any
    other body is left to the parse (which says what is wrong with it)."""
    if body.count(b",") < limit:  # fewer commas than that: not that many elements
        return
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return
    i = _skip(text, 0)
    if not text.startswith("[", i):
        return
    i = _skip(text, i + 1)
    n = 0
    while not text.startswith("]", i):
        try:
            _, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return
        n += 1
        if n > limit:
            raise TooLarge(f"more than {limit} JSON messages in one write (at most {limit}): "
                           "split it")  # fmt: skip
        i = _skip(text, i)
        if not text.startswith(",", i):
            return
        i = _skip(text, i + 1)


def _compact(value: object) -> bytes:
    """One message's stored form; refuses what JSON.parse would not read back."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number that overflows a double (1e400) became inf
        raise BadRequest("a number out of the range of a double (it reads as Infinity)") from None
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise BadRequest("a lone UTF-16 surrogate escape (\\ud800-\\udfff) in a string") from None


def format_offset(n: int) -> str:
    return f"{0:0{OFFSET_DIGITS}d}_{n:0{OFFSET_DIGITS}d}"


def parse_offset(text: str | None) -> Offset:
    """The message index an ``offset`` query value names: ``-1`` (or absent) is 0, ``now``
    is None (the tail); anything else must be an offset this server minted."""
    if text is None or text == "-1":
        return 0
    if text == "now":
        return None
    m = _OFFSET.fullmatch(text)
    if m is None:
        raise BadRequest(f"malformed offset {text[:40]!r}: use -1, now or a Stream-Next-Offset")
    return int(m.group(1))


def stream_id(path: str) -> str:
    """The hash tag of a stream path: its keys are ``ds:{<id>}:...`` on one slot."""
    if _PATH.fullmatch(path) is None or "//" in path or path.startswith("/"):
        raise BadRequest("malformed stream path (1-512 URL characters, no empty segment)")
    return hashlib.sha1(path.encode()).hexdigest()[:20]


def is_true(value: str | None) -> bool:
    """``Stream-Closed``: present only when exactly ``true`` (any case)."""
    return value is not None and value.strip().lower() == "true"


def media_type(content_type: str | None) -> str:
    """The media type without parameters, lower case (``""`` when absent)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def parse_ttl(value: str | None) -> int | None:
    if value is None:
        return None
    if _DECIMAL.fullmatch(value) is None or int(value) > MAX_SAFE_INT:
        raise BadRequest("Stream-TTL must be a non-negative decimal integer of seconds")
    return int(value)


def parse_expires_at(value: str | None) -> tuple[str, int] | None:
    """``(text, epoch ms)`` of a ``Stream-Expires-At`` RFC 3339 timestamp."""
    if value is None:
        return None
    text = value.strip()
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise BadRequest("Stream-Expires-At must be an RFC 3339 timestamp") from None
    if when.tzinfo is None or "T" not in text.upper():
        raise BadRequest("Stream-Expires-At must be an RFC 3339 timestamp with an offset")
    return text, int(when.timestamp() * 1000)


def parse_epoch_ms(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat().replace("+00:00", "Z")


def _producer_int(name: str, value: str) -> int:
    if _DECIMAL.fullmatch(value) is None or int(value) > MAX_SAFE_INT:
        raise BadRequest(f"{name} must be a non-negative integer <= 2^53-1")
    return int(value)


def parse_producer(
    pid: str | None, epoch: str | None, seq: str | None
) -> tuple[str, int, int] | None:
    """``(id, epoch, seq)`` when all three producer headers are present, None when none."""
    given = [v is not None for v in (pid, epoch, seq)]
    if not any(given):
        return None
    if not all(given):
        raise BadRequest("Producer-Id, Producer-Epoch and Producer-Seq go together")
    assert pid is not None
    assert epoch is not None
    assert seq is not None
    if not pid.strip():
        raise BadRequest("Producer-Id must not be empty")
    return pid, _producer_int("Producer-Epoch", epoch), _producer_int("Producer-Seq", seq)


def body_messages(
    body: bytes, json_mode: bool, *, allow_empty_array: bool, max_messages: int = MAX_WRITE_MESSAGES
) -> list[bytes]:
    """The messages a body stores: in JSON mode one per element of a top-level array
    (exactly one level flattened), each validated and stored compact; otherwise the body
    itself (none when empty). JSON mode refuses (400) what is not RFC 8259 JSON or what
    JSON.parse would not read back (NaN, Infinity, a number past a double's range, a lone
    surrogate), nesting past the kit's depth, and (413, :class:`TooLarge`) more than
    ``max_messages`` messages."""
    if not json_mode:
        return [body] if body else []
    if not body:
        return []
    _refuse_past(body, max_messages)
    try:  # the kit's JSON rule (its depth bound); any integer survives as it was written
        value = parse_json(body, want_object=False, loads=_loads)
    except BodyRefused as exc:
        raise BadRequest(exc.reason) from None
    items = value if isinstance(value, list) else [value]
    if not items and not allow_empty_array:
        raise BadRequest("an empty JSON array appends nothing")
    if len(items) > max_messages:
        n = len(items)
        raise TooLarge(f"{n} JSON messages in one write (at most {max_messages}): split it")
    return [_compact(v) for v in items]


def join_body(messages: list[bytes], json_mode: bool) -> bytes:
    return b"[" + b",".join(messages) + b"]" if json_mode else b"".join(messages)


def sse_data(messages: list[bytes], json_mode: bool, binary: bool) -> bytes:
    """One SSE ``data`` event of ``messages``: a JSON array, text lines, or base64."""
    payload = join_body(messages, json_mode)
    if binary:
        payload = base64.b64encode(payload)
    return sse.event(payload, kind="data", space=False)


def cursor(now_s: float, given: str | None, jitter_s: int) -> str:
    """The interval number since the spec's epoch; strictly past a ``given`` cursor that
    is not behind it (``jitter_s``: 1-3600, the caller's random draw)."""
    current = int((now_s - CURSOR_EPOCH_S) // CURSOR_INTERVAL_S)
    if given is not None and given.isdigit() and int(given) >= current:
        return str(int(given) + max(1, jitter_s // CURSOR_INTERVAL_S))
    return str(current)


def etag(gen: str, start: int, end: int, closed: bool) -> str:
    """Varies with the stream's incarnation, the range and the closure."""
    return f'"{gen}:{start}:{end}{":c" if closed else ""}"'


def cache_control(*, public: bool, tail: bool) -> str:
    """Section 10.1's catch-up rule; ``tail`` (``offset=now``): not cacheable."""
    if tail:
        return "no-store"
    return f"{'public' if public else 'private'}, max-age=60, stale-while-revalidate=300"
