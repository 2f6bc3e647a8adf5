"""The routing key: which part of a prompt decides the engine. Pure.

What it is for: an engine's KV cache is a prefix tree, so the part of a prompt that can be
reused is a *prefix*: the system prompt, then the conversation from its first message. The
key must (1) stay the same for every turn of one conversation (later turns only append),
and (2) differ between conversations that share a system prompt, or hundreds of sessions
built on one popular system prompt hash to one engine and the bounded-load rule has to
spill most of them, away from their own caches.

So the key is ``digest(system) + the first N characters of the conversation`` (N = 256 by
default), where the conversation is read *up to and including its first user message*: that
is all of it that exists at turn 1. Were a short first message followed by the assistant's
reply inside the N characters, turn 2's key would differ from turn 1's and the conversation
would lose its engine exactly when its cache starts to pay.

The system prompt enters as a 128-bit MurmurHash3 digest, not verbatim: the key stays
short whatever the system prompt's size (route cost is bounded) and two different system
prompts still give different keys. Sessions that share a system prompt spread over the ring
by their first message; each engine they land on pays the shared system prompt's prefill
once and then serves it from cache.

Call order: ``routing_key(system, messages)`` once per turn, then ``Router.route(key)``.
``prefix_chars=0`` keys by the system prompt alone (maximal sharing, hot spots);
a very large ``prefix_chars`` makes the key change as the chat grows (no affinity).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import mmh3

__all__ = ["DEFAULT_PREFIX_CHARS", "conversation_text", "routing_key"]

DEFAULT_PREFIX_CHARS: Final = 256
_SEP: Final = "\x1f"  # unit separator: cannot be confused with message text boundaries
_NO_SYSTEM: Final = "-"


def conversation_text(messages: Iterable[Mapping[str, str] | str], limit: int) -> str:
    """The first ``limit`` characters of the conversation up to its first user message, as
    ``role:content`` records.

    ``messages`` are OpenAI-style ``{"role", "content"}`` mappings (system messages are
    skipped: pass the system prompt separately) or bare strings (user turns). Stops at the
    first user message or at ``limit`` characters, so a long history costs nothing and the
    result is the same at every turn of the conversation."""
    if limit <= 0:
        return ""
    parts: list[str] = []
    size = 0
    for m in messages:
        if isinstance(m, str):
            role, content = "user", m
        else:
            role = m.get("role", "user")
            if role == "system":
                continue
            content = m.get("content", "")
        piece = role + ":" + content + _SEP
        parts.append(piece)
        size += len(piece)
        if role == "user" or size >= limit:
            break
    return "".join(parts)[:limit]


def routing_key(
    system: str | None,
    messages: Iterable[Mapping[str, str] | str],
    *,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
) -> str:
    """The key for :meth:`worker.routing.router.Router.route`: system digest + prefix."""
    if system:
        h = mmh3.hash128(system, 0, False)
        head = f"{h:032x}"
    else:
        head = _NO_SYSTEM
    return head + _SEP + conversation_text(messages, prefix_chars)
