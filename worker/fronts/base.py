"""The OpenAI gateway's shared state: its configuration, the :class:`Gateway` the app
holds under :data:`GATEWAY`, and the error answer in OpenAI's body.

Apart from the handlers so that both :mod:`worker.fronts.openai.http` (bare engine
requests) and :mod:`worker.fronts.openai.session` (requests tied to a session) import it,
and neither imports the other's module for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from aiohttp import web

from relay.broker.errors import RelayError
from relay.broker.port import RecordStore
from relay.protocol.codes import Refusal
from relay.protocol.keys import conversation_route_key
from relay.service.apikeys import caller, check_api_key
from relay.service.errors import openai_refusal
from relay.service.httpbody import read_json, refused_openai
from relay.service.jsonbody import BodyRefused
from worker.access import WorkerAccess
from worker.chat.turn import TurnManager
from worker.engines.client import EngineClient
from worker.fronts.errors import WireError
from worker.metrics import WorkerMetrics
from worker.routing.cost import turn_info
from worker.routing.key import routing_key
from worker.routing.lease import Lease
from worker.routing.router import Router
from worker.routing.wait import route_wait

__all__ = ["GATEWAY", "Gateway", "GatewayConfig", "Routed", "error_response"]

_MEMO_TIMEOUT_S: Final = 0.25  # a conversation's engine record: read or write, at most


class Routed(Protocol):
    """What routing reads of a request (a front's checked request, e.g.
    :class:`worker.fronts.openai.wire.ChatRequest`): its system prompt and conversation."""

    @property
    def system(self) -> str | None: ...

    @property
    def conversation(self) -> list[dict[str, str]]: ...


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    model: str
    keys: tuple[str, ...] = ()
    auth: bool = True  # False: --insecure-no-auth
    default_max_tokens: int = 1024
    max_tokens_limit: int = 4096
    max_chars: int = 256 * 1024
    admit_wait_s: float = 2.0
    prefix_chars: int = 2048
    max_body_bytes: int = 64 * 1024  # the worker's --max-body-bytes
    route_memory_ttl_s: int = 3600  # a session-less conversation's engine, remembered


class Gateway:
    """The gateway's state: the worker's router, engine client and metrics."""

    def __init__(
        self,
        cfg: GatewayConfig,
        router: Router,
        engine: EngineClient,
        metrics: WorkerMetrics,
        draining: Callable[[], bool] | None = None,
        turns: TurnManager | None = None,
        access: WorkerAccess | None = None,
        records: RecordStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.engine = engine
        self.metrics = metrics
        self._draining = draining  # a callable returning True while the worker drains
        self.turns = turns  # for requests tied to a session (worker.fronts.openai.session)
        self.access = access
        self.records = records  # where session-less conversations' engines are kept

    @staticmethod
    def error(exc: WireError, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(exc, headers)

    def draining(self) -> bool:
        return bool(self._draining()) if self._draining is not None else False

    def authorized(self, header: str | None) -> WireError | None:
        if not self.cfg.auth:
            return None
        code = check_api_key(self.cfg.keys, header)
        if code is None:
            return None
        reason = {
            Refusal.GATEWAY_DISABLED: "the OpenAI gateway is off: start the worker with "
            "--gateway-key",
            Refusal.MISSING_API_KEY: "send 'Authorization: Bearer <gateway key>'",
        }.get(code, "invalid gateway key")
        return WireError(401, reason, kind="authentication_error", code=code)

    def caller(self, header: str | None) -> str:
        """Who an authorized request is: the key its objects belong to
        (:func:`relay.service.apikeys.caller`)."""
        return caller(header, auth=self.cfg.auth)

    def first_token_timeout_s(self, engine_id: str) -> float | None:
        """The engine's own first-token timeout (its profile), else None: the client's."""
        return self.router.profiles.get(engine_id).first_token_timeout_s or None

    async def lease(self, req: Routed) -> Lease:
        """The engine for a session-less request. Its conversation has no session meta
        to name its last engine, so the gateway keeps one record per conversation in the
        store (under a digest of the routing key, which every worker computes the same
        way from the system prompt and the conversation's head): read before routing,
        written after, each bounded; a store that does not answer in time costs the
        request its affinity, never the request."""
        key = routing_key(req.system, req.conversation, prefix_chars=self.cfg.prefix_chars)
        memo = conversation_route_key(hashlib.sha256(key.encode("utf-8", "surrogatepass"))
                                      .hexdigest()[:32])  # fmt: skip
        last = await self._recall(memo)
        convo = req.conversation
        message = convo[-1].get("content", "") if convo else ""
        info = turn_info(key, req.system, convo[:-1], message, last)
        lease = await route_wait(self.router, key, self.cfg.admit_wait_s, info)
        if lease.spilled:
            self.metrics.spills.inc()
        if lease.engine.id != last:
            await self._remember(memo, lease.engine.id)
        return lease

    async def _recall(self, memo: str) -> str | None:
        if self.records is None:
            return None
        try:
            async with asyncio.timeout(_MEMO_TIMEOUT_S):
                return await self.records.get(memo)
        except (TimeoutError, RelayError):
            return None

    async def _remember(self, memo: str, engine_id: str) -> None:
        if self.records is None:
            return
        with contextlib.suppress(TimeoutError, RelayError):
            async with asyncio.timeout(_MEMO_TIMEOUT_S):
                await self.records.put(memo, engine_id, self.cfg.route_memory_ttl_s)

    async def create_body(self, request: web.Request) -> object | web.Response:
        """A create's body, or the refusal to answer: 503 while the worker drains, else
        the kit's bounded read (any media type, any JSON value: the SDKs send objects,
        the front's parser says what else), refused in OpenAI's shape (413, 400, or the
        client gone, counted by the HTTP guard)."""
        if self.draining():
            return error_response(WireError(503, "the worker is shutting down; retry",
                                            kind="api_error", code="draining"),
                                  {"Retry-After": "1"})  # fmt: skip
        try:
            body: object = await read_json(
                request, self.cfg.max_body_bytes, content_type=None, want_object=False
            )
        except BodyRefused as r:
            return refused_openai(r)
        return body


GATEWAY: Final = web.AppKey("tokenrelay_gateway", Gateway)


def error_response(exc: WireError, headers: dict[str, str] | None = None) -> web.Response:
    return openai_refusal(exc.status, exc.message, kind=exc.kind, code=exc.code,
                          param=exc.param, headers=headers)  # fmt: skip
