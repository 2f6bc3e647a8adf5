"""What the worker app's handlers share: :class:`WorkerState` under the app key
:data:`STATE` (built by :mod:`worker.lifecycle` at startup), and the access rules.

Its own module so that the handlers' modules (:mod:`worker.api`,
:mod:`worker.fronts.aisdk.http`) import it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from relay.broker.port import Store
from relay.protocol.auth import load_keys
from relay.service.supervise import Supervisor
from worker.access import WorkerAccess
from worker.chat.turn import TurnManager
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.routing.control import ControlPlane
from worker.routing.kvevents import KVEventFollower
from worker.routing.loadshare import LoadExchange
from worker.routing.router import Router

__all__ = ["STATE", "WorkerState", "access_check"]


@dataclass(slots=True)
class WorkerState:
    """What the app's handlers share (built at startup)."""

    cfg: WorkerConfig
    store: Store  # every read and write of the worker's (a Redis store: lifecycle's)
    http: aiohttp.ClientSession
    router: Router
    metrics: WorkerMetrics
    turns: TurnManager
    control: ControlPlane
    exchange: LoadExchange | None
    own_store: bool  # connected at startup (closed at cleanup), not given to make_app
    access: WorkerAccess
    supervisor: Supervisor
    kv_events: KVEventFollower | None = None  # precise routing: the engines' KV events


STATE: Final = web.AppKey("tokenrelay_worker", WorkerState)


def access_check(cfg: WorkerConfig) -> WorkerAccess:
    """The worker's access rules from ``cfg`` (no auth without a secret or a key file, or
    with ``insecure_no_auth``); ValueError (one line) for weak or default secrets, an
    unreadable key file, no signing key, a bad trusted-proxy list."""
    auth = bool(cfg.secret or cfg.keys_file) and not cfg.insecure_no_auth
    keys = load_keys(cfg.secret or None, cfg.kid, cfg.keys_file or None) if auth else None
    if keys is not None and keys.signing is None:
        raise ValueError(f"no signing key {cfg.kid!r}: the worker mints tokens with it")
    return WorkerAccess(
        keys,
        trusted_proxies=cfg.trusted_proxies,
        ipv6_prefix=cfg.ipv6_prefix,
        max_token_ttl_s=cfg.max_token_ttl_s,
        session_ttl_s=cfg.session_ttl_s,
        session_rate_per_s=cfg.session_rate_per_s,
        session_burst=cfg.session_burst,
        turns_per_minute=cfg.turns_per_minute,
        max_sessions_per_address=cfg.max_sessions_per_address,
    )
