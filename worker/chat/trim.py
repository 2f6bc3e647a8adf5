"""The history sent to an engine, trimmed to its context in tokens.

A conversation that outgrows the engine's context (prompt + ``max_tokens`` over its
``n_ctx``) is refused by the engine on every later turn. Before a turn is sent, its
prompt is cut to fit: the oldest turns go first, whole (a user message with the reply
that follows it), the system prompt and the new message always stay. What was left out
is counted (``trimmed_messages`` in the turn's ``meta`` frame and its ``done`` meta);
the stored history keeps everything.

The worker has no tokenizer of the served model: a message's tokens are estimated from
its UTF-8 bytes, ``bytes / BYTES_PER_TOKEN`` plus the chat template's per-message
overhead, on the safe side for BPE tokenizers (English averages about 4 bytes a token).
A prompt still over the context after trimming goes to the engine as it is: its refusal
(``prompt_too_long``) is the answer. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["BYTES_PER_TOKEN", "estimate_tokens", "trim_to_context"]

BYTES_PER_TOKEN: Final = 3.0
MESSAGE_OVERHEAD: Final = 8  # role markers and separators of a chat template, per message
REPLY_MARGIN: Final = 16  # the template's assistant header and rounding


def estimate_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """An upper-side estimate of the tokens ``messages`` take in a chat template (an
    assistant's tool calls counted as their JSON)."""
    total = 0
    for m in messages:
        size = len(str(m.get("content") or "").encode())
        if m.get("tool_calls"):
            size += len(json.dumps(m["tool_calls"]).encode())
        total += MESSAGE_OVERHEAD + int(size / BYTES_PER_TOKEN + 1)
    return total


def trim_to_context(
    prompt: Sequence[Mapping[str, Any]], context_tokens: int, max_tokens: int | None
) -> tuple[list[dict[str, Any]], int]:
    """``prompt`` (an optional system message first, the new user message last) with its
    oldest turns left out until it and ``max_tokens`` fit ``context_tokens``; returns the
    prompt and how many messages were left out. ``context_tokens`` 0: not known, kept whole.
    """
    out = [dict(m) for m in prompt]
    if context_tokens <= 0 or len(out) < 3:
        return out, 0
    budget = context_tokens - (max_tokens or 0) - REPLY_MARGIN
    head = 1 if out[0].get("role") == "system" else 0
    dropped = 0
    while estimate_tokens(out) > budget and len(out) - head > 1:
        # the oldest turn: its user message and the replies up to the next user message
        end = head + 1
        while end < len(out) - 1 and out[end].get("role") != "user":
            end += 1
        dropped += end - head
        del out[head:end]
    return out, dropped
