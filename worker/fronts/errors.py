"""What an OpenAI-convention front of the worker refuses, as a value: pure.

Chat completions (:mod:`worker.fronts.openai`) and the Responses API
(:mod:`worker.fronts.responses`) both answer in OpenAI's error shape; a check raises
:class:`WireError` and the route answers it with
:func:`worker.fronts.base.error_response` (:func:`relay.service.errors.openai_refusal`),
or writes it as a stream's error event (:func:`relay.service.errors.error_body`).
"""

from __future__ import annotations

from typing import Final

__all__ = ["REFUSED_BY_ENGINE", "WireError"]

# a turn's error code that says the engine refused the request itself (retrying will not
# help) -> OpenAI's code for it, a 400 in both fronts
REFUSED_BY_ENGINE: Final = {
    "prompt_too_long": "context_length_exceeded",
    "engine_refused": "engine_bad_request",
}


class WireError(Exception):
    """A request the gateway refuses: HTTP ``status``, OpenAI ``type`` and ``code``."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error",
        code: str | None = None, param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = (
            status, message, kind, code, param,
        )  # fmt: skip
