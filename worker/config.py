"""The worker's configuration: one frozen struct, each setting declared once.

:class:`WorkerConfig` is the worker's whole configuration. A field annotated with
:func:`relay.service.settings.opt` (or one of its shared declarations) is a setting: its
flag, environment variable (``TOKENRELAY_<FIELD>`` unless it says otherwise), help and
bounds come from that one declaration (:mod:`relay.service.settings`); a field without
one is a plain value with a default (timeouts and bounds no deployment has needed to
change). What the running worker derives from the fields, the static engines and the
coalescing and presence policies, is computed from them in one place (the properties
at the end); nothing is copied field by field.

Order of use: ``tokenrelay worker`` (:mod:`worker.cli`) adds the flags
(``settings.add_arguments(parser, WorkerConfig)``) and loads the struct
(``settings.load``: flag > environment > default, the declared bounds, then
:meth:`WorkerConfig.validate`); tests and embedding code build ``WorkerConfig(...)``
directly and change it with ``msgspec.structs.replace``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from typing import Annotated, Final

import msgspec

from relay.broker.rediscluster.connect import RedisTLS
from relay.producer.coalesce import DEFAULT_POLICY, CoalescePolicy
from relay.producer.presence import PresencePolicy
from relay.protocol.auth import DEFAULT_KID
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    LOCK_TTL_S,
    MAX_LOCK_TTL_S,
    SESSION_TTL_S,
)
from relay.service import settings
from relay.service.clientaddr import DEFAULT_IPV6_PREFIX
from relay.service.settings import (
    AdminKey,
    BacklogMaxBytes,
    BacklogMaxlen,
    BodyTimeout,
    CorsOrigin,
    FailFast,
    HeadTimeout,
    Host,
    InsecureNoAuth,
    IPv6Prefix,
    KeepaliveTimeout,
    KeysFile,
    Kid,
    MaxConnectionsPerAddress,
    RedisCA,
    RedisCert,
    RedisKey,
    RedisURL,
    Secret,
    SessionTTL,
    TrustedProxies,
    opt,
)
from worker.jobs.record import JOB_TTL_S
from worker.routing.control import parse_engine_arg
from worker.routing.key import DEFAULT_PREFIX_CHARS
from worker.routing.kvevents import EventSource, parse_kv_events_arg
from worker.routing.lease import EngineSpec
from worker.routing.policy import (
    DEFAULT_QUEUE,
    DEFAULT_QUEUE_SLO_S,
    DEFAULT_ROUTING,
    DEFAULT_SPILL,
    ROUTING_POLICIES,
    SPILL_POLICIES,
)
from worker.routing.profile import EngineProfile, parse_profile_arg
from worker.routing.tokens import MOCK_MODEL

__all__ = ["LOCK_TTL_S", "WorkerConfig", "default_worker_id"]

# A session's turn lock: refreshed every second; a dead worker's turn is reaped after it
# (the bound every producer keeps: relay.protocol.keys.PRODUCER_LOST_S).
_PRESENCE: Final = PresencePolicy()


def default_worker_id() -> str:
    raw = f"{socket.gethostname()}-{os.getpid()}"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in raw)[:64]


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker needs (see the module docstring). Times in seconds unless
    the name says ms."""

    # -- settings: flags and environment ------------------------------------------------
    port: Annotated[int, opt("TCP port (0 picks a free one)", ge=0, le=65535, required=True)] = 0
    host: Host = "127.0.0.1"
    redis_url: RedisURL = ""
    redis_ca: RedisCA = ""
    redis_cert: RedisCert = ""
    redis_key: RedisKey = ""
    # no secret and no key file: no auth (a loaded config needs --insecure-no-auth for it)
    secret: Secret = ""
    kid: Kid = DEFAULT_KID  # the key the worker signs with (an HS256 secret or a private JWK)
    keys_file: KeysFile = ""  # JWK Set: previous secrets (rotation), an ES256/RS256 key
    insecure_no_auth: InsecureNoAuth = False
    admin_key: AdminKey = ""
    trusted_proxies: TrustedProxies = ""
    ipv6_prefix: IPv6Prefix = DEFAULT_IPV6_PREFIX
    head_timeout_s: HeadTimeout = 10.0
    body_timeout_s: BodyTimeout = 30.0
    keepalive_timeout_s: KeepaliveTimeout = 75.0
    max_connections_per_address: MaxConnectionsPerAddress = 256
    # Redis unreachable at start: False keeps retrying in the background (/healthz 200,
    # /readyz 503 redis_unreachable, turns 503), which is what Kubernetes expects; True
    # exits 1 with one line naming the URL (masked) and the cause.
    fail_fast: FailFast = False
    engine_urls: Annotated[
        tuple[str, ...],
        opt("an OpenAI-compatible engine (repeat); id defaults to host:port", flag="--engine",
            env="TOKENRELAY_ENGINES", metavar="[ID=]URL"),
    ] = ()  # fmt: skip
    engine_cap: Annotated[
        int, opt("in-flight requests per engine: about 1.5 x the engine's concurrent sequences "
                 "(vLLM --max-num-seqs; the mock engine runs 8), see docs/ROUTING.md", ge=1)
    ] = 12  # fmt: skip
    engine_weights: Annotated[
        tuple[str, ...],
        opt("share of the ring and of the load for one engine (default 1; repeatable)",
            flag="--engine-weight", metavar="ID=W"),
    ] = ()  # fmt: skip
    engine_profiles: Annotated[
        tuple[str, ...],
        opt("an engine's cache shape and speed (repeatable; ID * for every engine): slots:N "
            "(llama.cpp -np, Ollama: one conversation per slot), kv:TOKENS (a shared pool), "
            "ctx:TOKENS (one request's context: history is trimmed to it), prefill:TOK/S, "
            "decode:TOK/S, first_token_timeout:S (CPU engines: minutes); what the engines "
            "report (llama-server's /props, timings) fills the rest, see docs/ROUTING.md",
            flag="--engine-profile", metavar="ID=KEY:VALUE,..."),
    ] = ()  # fmt: skip
    discover_engines: Annotated[
        bool, opt("also use engines announced in Redis (tr:engines heartbeats)")
    ] = False
    # precise routing: where an engine publishes its KV-cache events (worker/routing/kvevents.py)
    engine_kv_events: Annotated[
        tuple[str, ...],
        opt("an engine's KV-cache events (vLLM --kv-events-config; repeatable): its ZeroMQ "
            "PUB endpoint, and the replay one (default: the PUB port + 1)",
            flag="--engine-kv-events", metavar="ID=tcp://HOST:PORT[,tcp://HOST:PORT]"),
    ] = ()  # fmt: skip
    kv_block_size: Annotated[
        int, opt("precise: the engines' KV block size in tokens (vLLM --block-size)", ge=1)
    ] = 16
    max_token_ttl_s: Annotated[
        int, opt("longest token lifetime, also capped by --session-ttl-s", ge=1)
    ] = SESSION_TTL_S
    session_rate_per_s: Annotated[
        float, opt("new sessions per second per client address after the burst; 0: off", ge=0,
                   flag="--session-rate", env="TOKENRELAY_SESSION_RATE", metavar="SESSION_RATE"),
    ] = 1.0  # fmt: skip
    session_burst: Annotated[int, opt("new sessions at once per client address", ge=1)] = 20
    turns_per_minute: Annotated[int, opt("turn requests per session per minute; 0: off", ge=0)] = 30
    max_sessions_per_address: Annotated[
        int, opt("live sessions one client address may have created (counted in Redis, by "
                 "every worker; each counts for --session-ttl-s); 0: off", ge=0)
    ] = 64  # fmt: skip
    default_max_tokens: Annotated[int, opt("max_tokens of a turn that gives none", ge=1)] = 1024
    max_reply_bytes: Annotated[
        int, opt("an engine reply is cut (and stored) at this many bytes", ge=1024)
    ] = 256 * 1024
    model: Annotated[str, opt("model name sent to engines")] = MOCK_MODEL
    worker_id: Annotated[str, opt("unique id (empty: hostname-pid)")] = ""
    coalesce_tokens: Annotated[int, opt("flush a frame at this many tokens", ge=1)] = (
        DEFAULT_POLICY.max_tokens
    )
    coalesce_ms: Annotated[float, opt("flush a frame after this many ms", ge=0)] = (
        DEFAULT_POLICY.max_delay_s * 1000
    )
    presence_grace_s: Annotated[
        float, opt("how long a turn may generate with nobody watching", gt=0)
    ] = _PRESENCE.grace_s
    history_messages: Annotated[int, opt("messages of history sent to the engine", ge=1)] = 64
    history_max_bytes: Annotated[
        int, opt("bytes a session's history may store; the oldest messages go first; "
                 "0: no byte bound", ge=0)
    ] = 1 << 20  # fmt: skip
    session_ttl_s: SessionTTL = SESSION_TTL_S
    backlog_maxlen: BacklogMaxlen = BACKLOG_MAXLEN
    backlog_max_bytes: BacklogMaxBytes = BACKLOG_MAX_BYTES
    max_tokens_limit: Annotated[int, opt("largest max_tokens a turn may ask for", ge=1)] = 4096
    first_token_timeout_s: Annotated[
        float, opt("an engine's first token must come this fast", gt=0)
    ] = 60.0
    idle_timeout_s: Annotated[float, opt("longest silence of an engine between tokens", gt=0)] = (
        30.0
    )
    shutdown_deadline_s: Annotated[
        float, opt("SIGTERM: running turns may finish for this long", ge=0)
    ] = 20.0
    spill: Annotated[
        str, opt("where a turn goes when its engine is full", choices=SPILL_POLICIES)
    ] = DEFAULT_SPILL
    routing: Annotated[
        str, opt("cost_aware (default): least expected queue wait + prefill of what the "
                 "engine does not hold; precise: the same with what the engines' KV events "
                 "say they hold (--engine-kv-events); ring: prefix-aware consistent hashing; "
                 "round_robin: a cache-blind baseline for measurements",
                 choices=ROUTING_POLICIES)
    ] = DEFAULT_ROUTING  # fmt: skip
    # cost_aware: turns an engine takes past its cap (x the cap), each expected to get its
    # first token within route_queue_slo_s (worker/routing/router.py); 0: refuse at the cap
    route_queue: Annotated[
        float, opt("cost_aware: turns an engine may take past its cap, as a multiple of the "
                   "cap (0: refuse at the cap)", ge=0, le=16)
    ] = DEFAULT_QUEUE  # fmt: skip
    route_queue_slo_s: Annotated[
        float, opt("cost_aware: a turn queues past the cap only when its first token is "
                   "expected within this many seconds", gt=0)
    ] = DEFAULT_QUEUE_SLO_S  # fmt: skip
    vnodes: Annotated[int, opt("ring points per engine", ge=1)] = 160
    eps: Annotated[float, opt("bounded-load slack", ge=0)] = 0.25
    prefix_chars: Annotated[int, opt("characters of the conversation in the routing key", ge=0)] = (
        DEFAULT_PREFIX_CHARS
    )
    load_exchange: Annotated[
        bool, opt("do not share load with the other workers", flag="--no-load-exchange")
    ] = True  # fmt: skip
    amqp_url: Annotated[
        str, opt("RabbitMQ URL (amqp://user:pass@host:5672/): enables POST/GET /v1/jobs; "
                 "`tokenrelay jobworker` runs the jobs", flag="--amqp", metavar="URL")
    ] = ""  # fmt: skip
    jobs_queue: Annotated[str, opt("job queue name")] = "tokenrelay.jobs"
    gateway_keys: Annotated[
        tuple[str, ...],
        opt("a bearer key (>= 16 characters) for the OpenAI-compatible /v1/chat/completions "
            "(repeatable; comma-separated in the environment); without one the gateway "
            "answers 401", flag="--gateway-key", metavar="KEY"),
    ] = ()  # fmt: skip
    # a resumed Responses stream read from another origin through a door that routes by
    # path only reaches a worker: its preflight and answers name this origin (as a relay's)
    cors_origin: CorsOrigin = "*"
    admit_wait_s: Annotated[
        float, opt("how long a turn waits for an engine slot before 429 (below the session "
                   "lock's TTL, which it holds meanwhile)", ge=0, lt=LOCK_TTL_S)
    ] = 2.0  # fmt: skip

    # -- plain values: no flag ------------------------------------------------------------
    # Every command on the worker's own client is bounded: with no socket timeout a reply
    # from a stalled (SIGSTOPped, partitioned) master is awaited forever. Above a short
    # stall, below a failover; callers see RedisUnavailable and retry (publisher) or
    # end the turn with an error frame.
    redis_timeout_s: float = 2.0
    token_ttl_s: int = SESSION_TTL_S  # of the write token POST /v1/sessions answers
    max_body_bytes: int = 64 * 1024
    max_message_chars: int = 32 * 1024
    lock_ttl_s: float = LOCK_TTL_S
    presence_interval_s: float = _PRESENCE.interval_s  # how often a turn counts its viewers
    control_interval_s: float = 1.0
    connect_timeout_s: float = 3.0
    job_ttl_s: int = JOB_TTL_S

    def __post_init__(self) -> None:
        if not self.worker_id:  # set here, so that a config built in code has one too
            msgspec.structs.force_setattr(self, "worker_id", default_worker_id())

    def validate(self) -> WorkerConfig:
        """The rules between fields (the declared bounds are checked before); raises
        :class:`~relay.service.settings.ConfigError` with a one-line reason."""
        settings.check_redis(self.redis_url, self.redis_tls)
        settings.check_auth(self.secret, self.kid, self.keys_file, self.insecure_no_auth)
        settings.check_admin_key(self.admin_key)
        if not self.engine_urls and not self.discover_engines:
            raise settings.ConfigError("give at least one --engine (or --discover-engines)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise settings.ConfigError("--default-max-tokens must be in [1, --max-tokens-limit]")
        if any(len(k) < 16 for k in self.gateway_keys):
            raise settings.ConfigError("a --gateway-key must be at least 16 characters")
        if not 0 < self.lock_ttl_s <= MAX_LOCK_TTL_S:
            raise settings.ConfigError(
                f"the turn lock's TTL must be in (0, {MAX_LOCK_TTL_S:g}] s: a dead worker's "
                "turn must end within the producers' bound"
            )
        try:
            _ = self.engines  # the URLs and the weights parse
            _ = self.kv_event_sources
            _ = self.profiles
        except ValueError as exc:
            raise settings.ConfigError(str(exc)) from None
        if self.engine_kv_events and self.routing != "precise":
            raise settings.ConfigError("--engine-kv-events needs --routing precise")
        if self.engine_kv_events:  # followed over ZeroMQ (worker/routing/kvevents.py)
            settings.require_extra("zmq", "precise", "--engine-kv-events")
        if self.amqp_url:  # jobs go to RabbitMQ (worker/jobs/queue.py)
            settings.require_extra("aio_pika", "jobs", "--amqp")
        return self

    # -- derived: what the running worker uses, computed from the fields here only ----------

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    @property
    def engines(self) -> list[EngineSpec]:
        """The static engines: each ``--engine`` with ``--engine-cap`` and its
        ``--engine-weight``; ValueError (one line) for a bad URL or weight."""
        weights: dict[str, float] = {}
        for item in self.engine_weights:
            eid, sep, w = item.partition("=")
            try:
                weights[eid] = float(w)
            except ValueError:
                sep = ""
            if not sep or not eid or not weights.get(eid, 0) > 0:
                raise ValueError(f"--engine-weight wants ID=W with W > 0, got {item!r}")
        specs = [parse_engine_arg(e, self.engine_cap) for e in self.engine_urls]
        specs = [replace(s, weight=weights.get(s.id, s.weight)) for s in specs]
        unknown = set(weights) - {s.id for s in specs}
        if unknown and not self.discover_engines:
            raise ValueError(f"--engine-weight names no --engine: {', '.join(sorted(unknown))}")
        return specs

    @property
    def profiles(self) -> dict[str, EngineProfile]:
        """Each ``--engine-profile`` by engine id; ValueError (one line) for a bad one."""
        out: dict[str, EngineProfile] = {}
        for arg in self.engine_profiles:
            eid, profile = parse_profile_arg(arg)
            out[eid] = profile.over(out.get(eid, EngineProfile()))
        known = {s.id for s in self.engines} | {"*"}
        if not self.discover_engines and set(out) - known:
            names = ", ".join(sorted(set(out) - known))
            raise ValueError(f"--engine-profile names no --engine: {names}")
        return out

    @property
    def kv_event_sources(self) -> list[EventSource]:
        """Each ``--engine-kv-events``; ValueError (one line) for a bad one or a repeat."""
        sources = [parse_kv_events_arg(a) for a in self.engine_kv_events]
        names = [s.engine for s in sources]
        if len(set(names)) != len(names):
            raise ValueError("--engine-kv-events names an engine twice")
        return sources

    @property
    def coalesce(self) -> CoalescePolicy:
        return CoalescePolicy(self.coalesce_tokens, self.coalesce_ms / 1000)

    @property
    def presence(self) -> PresencePolicy:
        return PresencePolicy(grace_s=self.presence_grace_s, interval_s=self.presence_interval_s)
