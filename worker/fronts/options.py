"""The engine's options of a request, checked once for every front: pure.

Every front that starts generation (chat completions, the Responses API, the AI SDK's
chat POST, the turns API) lets a client set what the engine gets besides the prompt:
:data:`PASS_THROUGH` (tools, ``tool_choice``, ``parallel_tool_calls``,
``response_format``, logprobs, ``seed``, ``stop``, sampling, ``reasoning_effort``), in
the chat-completions shape the engine client sends. :func:`engine_options` checks each
one's type and refuses by name any field that is neither an option nor one the front
reads itself, so a setting is never dropped silently; what the engine itself cannot do
it refuses by name, and that 400 is passed on. A front with another shape (the Responses
API's flat function tools) translates to this one first and checks here.

Order of use: ``engine_options(body, own=<the front's own fields>)`` (raises
:class:`worker.fronts.errors.WireError`, status 400, ``param`` the field, ``code``
``unsupported_parameter`` or ``invalid_option``; a front of the own wire answers it as a
``Reject`` with :func:`refusal_code`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from relay.protocol.codes import Refusal
from worker.fronts.errors import WireError

__all__ = ["PASS_THROUGH", "engine_options", "refusal_code"]

# Options forwarded to the engine unchanged when the client sets them.
PASS_THROUGH: Final = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "reasoning_effort",
)


def _named(fn: object) -> bool:
    """A ``function`` object with a string ``name``."""
    return isinstance(fn, dict) and isinstance(fn.get("name"), str)


def _is_tools(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and _named(t.get("function"))
        for t in value
    )


def _is_choice(value: object) -> bool:
    if isinstance(value, str):
        return value in ("none", "auto", "required")
    return isinstance(value, dict) and _named(value.get("function"))


def _is_stop(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and len(value) <= 4 and all(isinstance(x, str) for x in value)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# each option's check and what it must be (the refusal's words)
_CHECKS: Final = {
    "tools": (_is_tools, "a list of {'type': 'function', 'function': {'name', ...}}"),
    "tool_choice": (
        _is_choice,
        "'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
    ),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "logprobs": (lambda v: isinstance(v, bool), "a boolean"),
    "seed": (_is_int, "an integer"),
    "top_logprobs": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "presence_penalty": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"),
    "stop": (_is_stop, "a string or a list of up to 4 strings"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string"),
}


def engine_options(body: Mapping[str, Any], own: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The engine's options of ``body`` (those set, not null), each checked for its
    type; a field neither in :data:`PASS_THROUGH` nor in ``own`` (what the front reads
    itself) is refused by name."""
    for k in body:
        if k not in own and k not in PASS_THROUGH:
            raise WireError(400, f"unsupported parameter '{k}': it is not forwarded to the "
                            "engine", param=k, code=Refusal.UNSUPPORTED_PARAMETER)  # fmt: skip
    opts = {k: body[k] for k in PASS_THROUGH if body.get(k) is not None}
    for k, v in opts.items():
        check, must = _CHECKS[k]
        if not check(v):
            raise WireError(400, f"'{k}' must be {must}", param=k, code=Refusal.INVALID_OPTION)
    return opts


def refusal_code(exc: WireError) -> Refusal:
    """The own wire's code of a refusal of :func:`engine_options`."""
    return Refusal(exc.code) if exc.code in set(Refusal) else Refusal.INVALID_OPTION
