"""What a ``done`` frame says about its reply, so that a client can check the text it
assembled (docs/PROTOCOL.md, "Frames a client checks"). Pure."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["reply_integrity"]


def reply_integrity(text: str, tokens: int) -> dict[str, Any]:
    """``tokens`` (the deltas the producer wrote), ``chars`` (Unicode code points) and
    ``sha256`` (lowercase hex of the UTF-8 bytes) of the reply ``text``."""
    return {
        "tokens": tokens,
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
    }
