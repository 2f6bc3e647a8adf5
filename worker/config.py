"""The worker's configuration: one :class:`WorkerConfig` the CLI fills from flags."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from relay.broker.rediscluster.connect import RedisTLS
from worker.chat.coalesce import DEFAULT_POLICY, CoalescePolicy
from worker.chat.presence import PresencePolicy
from worker.routing.key import DEFAULT_PREFIX_CHARS
from worker.routing.lease import EngineSpec
from worker.routing.policy import (
    DEFAULT_QUEUE,
    DEFAULT_QUEUE_SLO_S,
    DEFAULT_ROUTING,
    DEFAULT_SPILL,
)

__all__ = ["WorkerConfig", "default_worker_id"]


def default_worker_id() -> str:
    raw = f"{socket.gethostname()}-{os.getpid()}"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in raw)[:64]


@dataclass(slots=True)
class WorkerConfig:
    """Everything the worker needs; the CLI fills it from flags."""

    redis_url: str = ""
    redis_tls: RedisTLS = field(default_factory=RedisTLS)  # rediss://: CA, client cert, key
    # Every command on the worker's own client is bounded: with no socket timeout a reply
    # from a stalled (SIGSTOPped, partitioned) master is awaited forever. Above a short
    # stall, below a failover; callers see RedisUnavailable and retry (publisher) or
    # end the turn with an error frame.
    redis_timeout_s: float = 2.0
    engines: list[EngineSpec] = field(default_factory=list)
    secret: str | None = None  # HS256 secret of key ``kid``; None (and no keys_file): no auth
    kid: str = "k1"  # the key the worker signs with (an HS256 secret or a private JWK)
    keys_file: str | None = None  # JWK Set: previous secrets (rotation), an ES256/RS256 key
    trusted_proxies: str = ""  # whose X-Forwarded-For names the client (comma-separated CIDRs)
    max_token_ttl_s: int = 86_400  # and never past the session's lifetime (session_ttl_s)
    session_rate_per_s: float = 1.0  # new sessions per client address, after the burst; 0: off
    session_burst: int = 20
    turns_per_minute: int = 30  # turn requests per session per minute; 0: off
    default_max_tokens: int = 1024  # a turn without max_tokens gets this
    max_reply_bytes: int = 256 * 1024  # the engine's reply is cut here (and stored so)
    model: str = "tokenrelay-mock"
    worker_id: str = field(default_factory=default_worker_id)
    token_ttl_s: int = 86_400
    max_body_bytes: int = 64 * 1024
    max_message_chars: int = 32 * 1024
    max_tokens_limit: int = 4096
    history_messages: int = 64
    history_max_bytes: int = 1 << 20  # what a session's history may store (oldest dropped)
    session_ttl_s: int = 86_400
    backlog_maxlen: int = 10_000
    lock_ttl_s: float = 5.0  # refreshed every second; a dead worker's turn is reaped after it
    coalesce: CoalescePolicy = DEFAULT_POLICY
    presence: PresencePolicy = field(default_factory=PresencePolicy)
    vnodes: int = 160
    eps: float = 0.25
    spill: str = DEFAULT_SPILL
    routing: str = DEFAULT_ROUTING  # "ring", or "round_robin": the cache-blind baseline
    # cost_aware: turns an engine takes past its cap (x the cap), each expected to get its
    # first token within route_queue_slo_s (worker/routing/router.py); 0: refuse at the cap
    route_queue: float = DEFAULT_QUEUE
    route_queue_slo_s: float = DEFAULT_QUEUE_SLO_S
    discover_engines: bool = False
    control_interval_s: float = 1.0
    load_exchange: bool = True
    connect_timeout_s: float = 3.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    shutdown_deadline_s: float = 20.0
    admit_wait_s: float = 2.0  # a turn waits this long for an engine slot before 429
    prefix_chars: int = DEFAULT_PREFIX_CHARS  # of the conversation in the routing key
    gateway_keys: tuple[str, ...] = ()  # bearer keys of the OpenAI gateway (worker.gateway.openai)
    amqp_url: str = ""  # RabbitMQ: enables /v1/jobs (worker.jobs.api)
    jobs_queue: str = "tokenrelay.jobs"
    job_ttl_s: int = 86_400
    # Redis unreachable at start: False keeps retrying in the background (/healthz 200,
    # /readyz 503 redis_unreachable, turns 503), which is what Kubernetes expects; True
    # exits 1 with one line naming the URL (masked) and the cause.
    fail_fast: bool = False
