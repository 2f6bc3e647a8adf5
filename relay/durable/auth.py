"""Who may read or write a Durable Stream: a token scoped to the stream (its subject
``ds:<stream id>``, the hash of the path :func:`relay.durable.core.stream_id` names; a
session's token never opens a stream, nor a stream's a session: the namespace rule of
:mod:`relay.protocol.auth`) and
to ``watch`` (read) or ``write``, signed with the relays' keys like a session's; or no
token under ``--durable-open-prefix`` (a prefix of ``/<path>``; ``/``: all). A chat
session read as a stream takes the session's own watch token. Reads (catch-up, long-poll
and SSE) count against ``--max-streams-per-token`` and ``--max-streams-per-address`` while
they last (429 past either).

Order of use::

    grant = gate.check(request, path, "write")      # raises Refused
    with gate.live(grant):                           # raises Refused (429)
        ...
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from relay.durable.core import stream_id
from relay.edge.http.limits import token_key
from relay.protocol.auth import AuthError, KeySet, Scope
from relay.protocol.subjects import stream_subject
from relay.service.tokens import challenge, request_claims

__all__ = ["Gate", "Grant", "Refused", "token_subject"]


class Refused(Exception):
    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


@dataclass(frozen=True)
class Grant:
    token: int | None  # the token's count key; None: an open path
    address: str
    public: bool  # no token: responses may be cached publicly
    identity: str | None = None  # the token's identity as text (its byte budget's key)


def token_subject(path: str) -> str:
    """The ``sub`` of a token for the stream at ``path``: ``ds:<stream id>``, a name no
    session can have (:func:`relay.protocol.subjects.stream_subject`: the namespace rule)."""
    return stream_subject(stream_id(path))


class Gate:
    def __init__(
        self,
        keys: KeySet | None,
        open_prefix: str,
        *,
        max_lifetime_s: int,
        per_token: int,
        per_address: int,
    ) -> None:
        self.keys, self.open_prefix = keys, open_prefix
        self.max_lifetime_s = max_lifetime_s
        self.per_token, self.per_address = per_token, per_address
        self._tokens: Counter[int] = Counter()
        self._addresses: Counter[str] = Counter()

    def check(self, request: web.Request, subject: str, need: Scope, address: str, *,
              path: str | None = None, header: str | None = None) -> Grant:  # fmt: skip
        """The grant for ``subject`` (a stream's :func:`token_subject` or a session id);
        ``path``: the stream's, open when under the open prefix; ``header``: the
        request header that carries the token instead (a fork's source's)."""
        if self.keys is None or (
            path is not None and self.open_prefix and f"/{path}".startswith(self.open_prefix)
        ):
            return Grant(None, address, True)
        try:
            claims = request_claims(self.keys, request, subject, need,
                                    max_lifetime_s=self.max_lifetime_s, header=header)  # fmt: skip
        except AuthError as exc:
            raise Refused(exc.status, f"{exc.error}: {exc}", challenge(exc)) from None
        return Grant(token_key(claims), address, False, repr(claims.identity))

    @contextlib.contextmanager
    def live(self, grant: Grant) -> Iterator[None]:
        """Count one read (catch-up, long-poll or SSE) of ``grant`` while it lasts."""
        if (
            grant.token is not None
            and self.per_token
            and self._tokens[grant.token] >= self.per_token
        ):
            raise Refused(429, "too many reads at once with this token (--max-streams-per-token)")
        if self.per_address and self._addresses[grant.address] >= self.per_address:
            raise Refused(
                429, "too many reads at once from this address (--max-streams-per-address)"
            )
        if grant.token is not None:
            self._tokens[grant.token] += 1
        self._addresses[grant.address] += 1
        try:
            yield
        finally:
            self._addresses[grant.address] -= 1
            if self._addresses[grant.address] <= 0:
                del self._addresses[grant.address]
            if grant.token is not None:
                self._tokens[grant.token] -= 1
                if self._tokens[grant.token] <= 0:
                    del self._tokens[grant.token]
