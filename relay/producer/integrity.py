"""What a ``done`` frame says about its reply, so that a client can check the text it
assembled (docs/PROTOCOL.md, "Frames a client checks"), and what a ``meta`` frame
carries of the user's message (bounded: every frame stays in the backlog for the
session's lifetime; the history keeps the whole message). Pure."""

from __future__ import annotations

import hashlib
from typing import Any, Final

__all__ = ["META_MESSAGE_BYTES", "message_meta", "reply_integrity"]

# What a turn's meta frame carries of the user's message: a screen shows it, the history
# keeps the whole. Every frame stays in the backlog for the session's lifetime.
META_MESSAGE_BYTES: Final = 2048


def reply_integrity(text: str, tokens: int) -> dict[str, Any]:
    """``tokens`` (the deltas the producer wrote), ``chars`` (Unicode code points) and
    ``sha256`` (lowercase hex of the UTF-8 bytes) of the reply ``text``."""
    return {
        "tokens": tokens,
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
    }


def message_meta(text: str, max_bytes: int = META_MESSAGE_BYTES) -> dict[str, Any]:
    """The user's message as a meta frame carries it: whole up to ``max_bytes`` of UTF-8;
    else its start (whole code points, at most ``max_bytes``), ``message_truncated`` true,
    and the whole message's ``message_chars`` (code points) and ``message_sha256``."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= max_bytes:
        return {"message": text}
    return {
        "message": raw[:max_bytes].decode("utf-8", "ignore"),
        "message_truncated": True,
        "message_chars": len(text),
        "message_sha256": hashlib.sha256(raw).hexdigest(),
    }
