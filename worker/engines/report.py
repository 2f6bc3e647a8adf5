"""What an engine says about a request's tokens, read wherever it says it.

Engines report a request's prompt size, its reused (cached) prefix and its timings in
different places, and the engine client reads them all into one :class:`Report`:

================================  ===================================================
where                             who sends it
================================  ===================================================
``x-prefix-cache-hit-tokens``,    the mock engine (``devstack.mockengine``), headers
``x-prompt-tokens``, ``x-prefill-s``
the chunk's ``tokenrelay`` field  the mock engine, first chunk
``usage`` (``prompt_tokens``,     vLLM, SGLang, llama-server, OpenAI: the last chunk
``completion_tokens``,            when asked with ``stream_options.include_usage``
``prompt_tokens_details.cached_tokens``)
``timings`` (``cache_n``,         llama.cpp's ``llama-server``: the last chunk
``prompt_n``, ``prompt_ms``,      (``prompt_n`` prompt tokens computed, ``cache_n``
``predicted_n``, ``predicted_ms``)  reused from the slot's cache)
================================  ===================================================

Each source fills what it knows; a later report's known fields win over an earlier
one's (:meth:`Report.merged`), a field no source gave stays None, so the turn says
``cache: "unknown"`` only when the engine said nothing.

Besides its tokens, a chunk's delta may carry parts of the reply other than text
(:func:`chunk_parts`): tool calls (llama-server: the first delta of a call has its
``index``, ``id``, ``type`` and ``function.name`` with the first piece of its
``arguments``, the next ones ``index`` and an ``arguments`` piece each; the mock sends
the name with empty arguments first), ``reasoning_content`` (or ``reasoning``), and the
choice's ``logprobs``; :func:`parts_bytes` is what they add to the reply's size. Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

__all__ = [
    "Report",
    "chunk_parts",
    "chunk_report",
    "header_report",
    "parts_bytes",
    "to_float",
    "to_int",
]


def to_int(v: object) -> int | None:
    """A non-negative count from JSON or a header; None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, str):
        try:
            n = int(v)
        except ValueError:
            return None
        return n if n >= 0 else None
    return None


def to_float(v: object) -> float | None:
    """A finite non-negative number; None for anything else."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if f >= 0 and f == f and f != float("inf") else None


@dataclass(frozen=True, slots=True)
class Report:
    """A request's tokens and timings as the engine reported them (None: not said).

    ``prompt_tokens`` is the whole prompt, ``cached_tokens`` the part reused from the
    engine's cache, ``computed_tokens`` the part it computed (prefilled);
    ``prefill_s`` and ``decode_s`` the engine's own time for each phase."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    engine_id: str | None = None

    def merged(self, later: Report) -> Report:
        """This report with ``later``'s known fields over it."""
        out = {}
        for f in fields(self):
            new = getattr(later, f.name)
            out[f.name] = new if new is not None else getattr(self, f.name)
        return _complete(Report(**out))

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


def _complete(r: Report) -> Report:
    """Fill a field the others determine (prompt = cached + computed)."""
    prompt, cached, computed = r.prompt_tokens, r.cached_tokens, r.computed_tokens
    if prompt is None and cached is not None and computed is not None:
        prompt = cached + computed
    if cached is None and prompt is not None and computed is not None and computed <= prompt:
        cached = prompt - computed
    if computed is None and prompt is not None and cached is not None and cached <= prompt:
        computed = prompt - cached
    if (prompt, cached, computed) == (r.prompt_tokens, r.cached_tokens, r.computed_tokens):
        return r
    return Report(prompt, r.completion_tokens, cached, computed, r.prefill_s, r.decode_s,
                  r.engine_id)  # fmt: skip


def header_report(headers: Mapping[str, str]) -> Report:
    """The mock engine's headers (``x-engine-id``, ``x-prefix-cache-hit-tokens``, ...)."""
    engine_id = headers.get("x-engine-id")
    return _complete(
        Report(
            prompt_tokens=to_int(headers.get("x-prompt-tokens")),
            cached_tokens=to_int(headers.get("x-prefix-cache-hit-tokens")),
            prefill_s=to_float(headers.get("x-prefill-s")),
            engine_id=engine_id if engine_id else None,
        )
    )


def _usage(obj: object) -> Report:
    if not isinstance(obj, Mapping):
        return Report()
    details = obj.get("prompt_tokens_details")
    cached = to_int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return Report(
        prompt_tokens=to_int(obj.get("prompt_tokens")),
        completion_tokens=to_int(obj.get("completion_tokens")),
        cached_tokens=cached,
    )


def _timings(obj: object) -> Report:
    """llama-server's ``timings``: ``prompt_n`` computed, ``cache_n`` reused."""
    if not isinstance(obj, Mapping):
        return Report()
    prompt_ms, predicted_ms = to_float(obj.get("prompt_ms")), to_float(obj.get("predicted_ms"))
    return Report(
        completion_tokens=to_int(obj.get("predicted_n")),
        cached_tokens=to_int(obj.get("cache_n")),
        computed_tokens=to_int(obj.get("prompt_n")),
        prefill_s=prompt_ms / 1000 if prompt_ms is not None else None,
        decode_s=predicted_ms / 1000 if predicted_ms is not None else None,
    )


def _mock(obj: object) -> Report:
    if not isinstance(obj, Mapping):
        return Report()
    engine_id = obj.get("engine_id")
    return Report(
        prompt_tokens=to_int(obj.get("prompt_tokens")),
        cached_tokens=to_int(obj.get("cached_tokens")),
        prefill_s=to_float(obj.get("prefill_s")),
        engine_id=engine_id if isinstance(engine_id, str) and engine_id else None,
    )


def chunk_report(obj: Mapping[str, Any]) -> Report:
    """Everything one chunk (or a whole JSON answer) says: its ``tokenrelay`` field, then
    ``timings``, then ``usage`` (the engine's own count of the prompt wins)."""
    report = Report()
    for part in (_mock(obj.get("tokenrelay")), _timings(obj.get("timings")),
                 _usage(obj.get("usage"))):  # fmt: skip
        if not part.empty:
            report = report.merged(part)
    return report


_PARTS: Final = ("tool_calls", "reasoning_content", "reasoning")


def chunk_parts(delta: object, choice: Mapping[str, Any]) -> dict[str, Any] | None:
    """A delta's (or a whole answer's message's) parts besides text, as the engine sent
    them, and the choice's logprobs; None when it has none."""
    out = {k: v for k in _PARTS if isinstance(delta, Mapping) and (v := delta.get(k))}
    if choice.get("logprobs"):
        out["logprobs"] = choice["logprobs"]
    return out or None


def parts_bytes(parts: Mapping[str, Any]) -> int:
    """The bytes :func:`chunk_parts` add to the reply: its tool calls' argument pieces
    and its reasoning text (bounded with the text by the engine client)."""
    n = 0
    for k in ("reasoning_content", "reasoning"):
        if isinstance(v := parts.get(k), str):
            n += len(v.encode())
    calls = parts.get("tool_calls")
    for tc in calls if isinstance(calls, list) else ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        args = fn.get("arguments") if isinstance(fn, Mapping) else None
        if isinstance(args, str):
            n += len(args.encode())
    return n
