"""Exceptions raised by the engine client; nothing above it sees an aiohttp error.

The tree::

    EngineError                   base; ``engine_url`` says which engine
     +-- EngineUnavailable        connection refused / reset / connect timed out, or the
     |                            connection was lost mid-stream (``mid_stream``)
     +-- EngineTimeout            no first token in time, or the stream went idle
     |                            (``phase`` is "first_token" or "idle", ``timeout_s``)
     +-- EngineProtocolError      the answer is not a valid OpenAI-compatible stream
     +-- EngineHTTPError          a non-200 answer (``status``, ``body``, ``message``,
          |                       ``retry_after_s``, ``retryable``)
          +-- EngineStreamError   an error object inside a 200 stream

``message`` is for the worker's log (it names the engine's URL); ``public_reason`` is
what a client may read in the turn's ``error`` frame: a short reason, no address.

Order of use: ``worker.engines.client`` raises them; the turn runner
(``worker.chat.runner``) moves the turn once to the next engine for its key on an
``EngineUnavailable`` raised before the first token (the connection was refused: the
engine died before the control plane noticed), and ends the turn with an ``error``
frame on every other error. ``retryable`` and ``retry_after_s`` of an
``EngineHTTPError`` (429/503 from an overloaded engine) are carried in the error for
callers that want to retry; the runner does not, since the engine was admitted by
the router's caps and a busy answer means those caps are wrong for it.
"""

from __future__ import annotations

import re

__all__ = [
    "ENGINE_REFUSED",
    "PROMPT_TOO_LONG",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineStreamError",
    "EngineTimeout",
    "EngineUnavailable",
]

_RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
PROMPT_TOO_LONG = "prompt_too_long"  # the error code of a prompt over the engine's context
ENGINE_REFUSED = "engine_refused"  # the engine refused the request itself (a 400, 413, 422)
_REASON_CHARS = 200
# how engines word a prompt over their context: llama-server ("exceeds the available
# context size", type exceed_context_size_error), vLLM ("maximum context length"),
# SGLang and Ollama ("longer than the model's context length", "context length")
_OVERFLOW = ("exceed_context_size", "exceeds the available context", "context length",
             "context window", "context size", "prompt is too long", "too many tokens")  # fmt: skip
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def clean_reason(text: str, limit: int = _REASON_CHARS) -> str:
    """An engine's own message as a client may read it: one line, no control characters,
    no URLs (they may name internal hosts), at most ``limit`` characters."""
    out = _URL.sub("<url>", _CONTROL.sub(" ", text))
    out = " ".join(out.split())
    return out if len(out) <= limit else out[: limit - 1].rstrip() + "…"


class EngineError(Exception):
    """Base of every exception the engine client raises."""

    def __init__(self, message: str, *, engine_url: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.engine_url = engine_url

    @property
    def public_reason(self) -> str:
        """A short reason without internal addresses (the ``error`` frame's text)."""
        return "engine error"

    @property
    def code(self) -> str | None:
        """A distinct error code for the turn's ``error`` frame (None: the generic one)."""
        return None


class EngineUnavailable(EngineError):
    """The engine could not be reached, or the connection broke."""

    def __init__(
        self, message: str, *, engine_url: str | None = None, mid_stream: bool = False
    ) -> None:
        super().__init__(message, engine_url=engine_url)
        self.mid_stream = mid_stream

    @property
    def public_reason(self) -> str:
        return "engine connection lost mid-stream" if self.mid_stream else "engine unreachable"


class EngineTimeout(EngineError):
    """No first token within the deadline, or no bytes for the idle timeout."""

    def __init__(self, phase: str, timeout_s: float, *, engine_url: str | None = None) -> None:
        super().__init__(f"engine {phase} timeout after {timeout_s:g}s", engine_url=engine_url)
        self.phase = phase
        self.timeout_s = timeout_s

    @property
    def public_reason(self) -> str:
        return self.message  # "engine <phase> timeout after <n>s": nothing internal


class EngineProtocolError(EngineError):
    """The engine's answer does not follow the OpenAI streaming protocol."""

    @property
    def public_reason(self) -> str:
        return "engine answered with an invalid stream"


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status."""

    def __init__(
        self,
        status: int,
        body: str,
        *,
        message: str | None = None,
        retry_after_s: float | None = None,
        engine_url: str | None = None,
        engine_message: str = "",
        engine_type: str = "",
    ) -> None:
        super().__init__(message or f"engine answered HTTP {status}", engine_url=engine_url)
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        self.engine_message = engine_message  # the engine's own words (its error object)
        self.engine_type = engine_type  # its error type, when it gives one

    @property
    def public_reason(self) -> str:
        """The status and the engine's own reason, cleaned and bounded: a screen shows
        why (a prompt over the context, a bad parameter), never an address."""
        said = clean_reason(self.engine_message) if self.engine_message else ""
        return (
            f"engine answered HTTP {self.status}: {said}"
            if said
            else (f"engine answered HTTP {self.status}")
        )

    @property
    def code(self) -> str | None:
        if self.status not in (400, 413, 422):
            return None
        words = f"{self.engine_type} {self.engine_message}".lower()
        return PROMPT_TOO_LONG if any(w in words for w in _OVERFLOW) else ENGINE_REFUSED

    @property
    def retryable(self) -> bool:
        """True if another attempt (here or on another engine) may succeed."""
        return self.status in _RETRYABLE


class EngineStreamError(EngineHTTPError):
    """An error object arrived inside a 200 stream (``status`` from its code, else 500)."""
