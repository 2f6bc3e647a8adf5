"""The edge server's configuration: one frozen struct, each field declared once.

Every field carries its help, flag and environment variable (``TOKENRELAY_<FIELD>``,
listed in :data:`ENV`) through :func:`relay.service.settings.opt`; the flags and the
environment reading are generated from it. Precedence: command-line flag > environment
variable > default.

Order of use: the CLI builds its parser with :func:`add_arguments`, then calls
:func:`from_args` (which reads ``os.environ`` unless given a mapping) and gets a
validated :class:`RelayConfig`, or :class:`ConfigError` with a one-line reason. Tests
build ``RelayConfig(...)`` directly and call :meth:`RelayConfig.validate`.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from typing import Annotated, Final

import msgspec

from relay.broker.rediscluster.connect import RedisTLS
from relay.protocol.auth import DEFAULT_KID, KeySet
from relay.protocol.keys import BACKLOG_MAX_BYTES, BACKLOG_MAXLEN, SESSION_TTL_S
from relay.service import settings
from relay.service.clientaddr import DEFAULT_IPV6_PREFIX, parse_networks
from relay.service.settings import (
    AdminKey,
    BacklogMaxBytes,
    BacklogMaxlen,
    BodyTimeout,
    ConfigError,
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

__all__ = [
    "ENV",
    "RelayConfig",
    "add_arguments",
    "default_relay_id",
    "from_args",
]

_MIN_BUFFER: Final = 512 * 1024


def default_relay_id() -> str:
    """``<hostname>-<pid>``: unique per process, readable on the demo page."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the edge server needs. Times in seconds unless the name says ms."""

    host: Host = "127.0.0.1"
    port: Annotated[int, opt("port to bind", ge=0, le=65535)] = 8080
    redis_url: RedisURL = "redis://127.0.0.1:7000"
    redis_ca: RedisCA = ""
    redis_cert: RedisCert = ""
    redis_key: RedisKey = ""
    secret: Secret = ""
    kid: Kid = DEFAULT_KID
    keys_file: KeysFile = ""
    insecure_no_auth: InsecureNoAuth = False
    admin_key: AdminKey = ""
    trusted_proxies: TrustedProxies = ""
    ipv6_prefix: IPv6Prefix = DEFAULT_IPV6_PREFIX
    fail_fast: FailFast = False
    backlog_maxlen: BacklogMaxlen = BACKLOG_MAXLEN
    backlog_max_bytes: BacklogMaxBytes = BACKLOG_MAX_BYTES
    session_ttl_s: SessionTTL = SESSION_TTL_S
    relay_id: Annotated[str, opt("name shown to clients (empty: <hostname>-<pid>)")] = ""
    heartbeat_s: Annotated[float, opt("SSE comment / WS idle interval", gt=0)] = 15.0
    retry_ms: Annotated[int, opt("SSE retry: hint", ge=0)] = 1000
    queue_frames: Annotated[int, opt("per-watch queue before conflation", ge=1)] = 1024
    hard_limit_frames: Annotated[int, opt("slow-client cutoff", ge=1)] = 4096
    max_pending_bytes: Annotated[
        int, opt("per-stream bytes pending after merging; past it: slow_consumer", ge=_MIN_BUFFER)
    ] = 1 << 20
    replay_budget_bytes: Annotated[
        int, opt("replay pages in memory, relay-wide; more replays wait", ge=_MIN_BUFFER)
    ] = 64 << 20
    unsubscribe_delay_s: Annotated[float, opt("linger before SUNSUBSCRIBE", ge=0)] = 2.0
    presence_interval_s: Annotated[
        float,
        opt(
            "least time between two writes of a session's screen count; 0: no presence frames", ge=0
        ),
    ] = 1.0
    reap_after_s: Annotated[
        float, opt("end a silent, unlocked turn whose worker is gone after this; 0: never", ge=0)
    ] = 2.0
    drain_deadline_s: Annotated[float, opt("SIGTERM drain deadline", ge=0)] = 10.0
    write_timeout_s: Annotated[float, opt("slow-client write cutoff", gt=0)] = 10.0
    head_timeout_s: HeadTimeout = 10.0
    body_timeout_s: BodyTimeout = 30.0
    keepalive_timeout_s: KeepaliveTimeout = 75.0
    # streams are not counted here (--max-streams-per-address counts them): 2 x its default
    max_connections_per_address: MaxConnectionsPerAddress = 512
    max_connections: Annotated[int, opt("streams at once; more get 503", ge=1)] = 10_000
    ws_max_message_bytes: Annotated[int, opt("largest WS client message", ge=16)] = 4096
    cors_origin: CorsOrigin = "*"
    max_streams_per_token: Annotated[
        int, opt("open streams per token; more get 429; 0: no limit", ge=0)
    ] = 16
    max_streams_per_address: Annotated[
        int, opt("open streams per client address; 0: no limit", ge=0)
    ] = 256
    gateway_keys: Annotated[
        tuple[str, ...],
        opt("a bearer key (>= 16 characters, the workers' --gateway-key) for the Responses "
            "API's resumable stream GET /v1/responses/{id}?stream=true (repeatable; "
            "comma-separated in the environment); without one that route answers 401",
            flag="--gateway-key", metavar="KEY"),
    ] = ()  # fmt: skip
    durable_open_prefix: Annotated[
        str,
        opt("Durable Streams paths under this prefix (of /<path> in /v1/stream/<path>; '/': "
            "all) need no token; for the "
            "conformance suite and local experiments, refused with a key file (--keys)",
            metavar="PREFIX"),
    ] = ""  # fmt: skip
    durable_long_poll_s: Annotated[
        float, opt("Durable Streams long-poll wait before 204", gt=0, le=300)
    ] = 20.0
    durable_sse_close_s: Annotated[
        float, opt("Durable Streams SSE connections end after this (clients reconnect)", gt=0)
    ] = 60.0
    durable_max_body_bytes: Annotated[
        int, opt("largest Durable Streams write body; larger gets 413", ge=1, le=64 << 20)
    ] = 4 << 20
    durable_max_stream_bytes: Annotated[
        int, opt("bytes one Durable Stream may hold (its messages + 16 each, since its "
                 "creation); a write past it gets 413; 0: no bound", ge=0)
    ] = 16 << 20  # fmt: skip
    durable_token_bytes: Annotated[
        int, opt("bytes one token may write into Durable Streams per --durable-budget-window-s "
                 "(counted in Redis, by every relay); past it 429; 0: no budget", ge=0)
    ] = 32 << 20  # fmt: skip
    durable_address_bytes: Annotated[
        int, opt("bytes one client address may write into Durable Streams per "
                 "--durable-budget-window-s (counted in Redis, by every relay); past it "
                 "429; 0: no budget", ge=0)
    ] = 64 << 20  # fmt: skip
    durable_budget_window_s: Annotated[
        int, opt("the sliding window of --durable-token-bytes and --durable-address-bytes",
                 ge=60)
    ] = SESSION_TTL_S  # fmt: skip

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    @property
    def auth_enabled(self) -> bool:
        """Tokens are required unless ``insecure_no_auth`` (which allows an empty secret)."""
        return not self.insecure_no_auth

    def keyset(self) -> KeySet | None:
        """The keys tokens are verified with; None when auth is off. Raises ConfigError."""
        keys = settings.check_auth(self.secret, self.kid, self.keys_file, self.insecure_no_auth)
        private = keys.has_private_keys() if keys is not None else []
        if private:
            raise ConfigError(
                f"the key file holds the private key {private[0]!r}: a relay verifies "
                "tokens and needs only public keys"
            )
        return keys

    def validate(self) -> RelayConfig:
        """Return self, or raise :class:`ConfigError`; fills ``relay_id`` if empty."""
        settings.check_fields(self)
        if any(len(k) < 16 for k in self.gateway_keys):
            raise ConfigError("a --gateway-key must be at least 16 characters")
        self.keyset()
        settings.check_admin_key(self.admin_key)
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise ConfigError(f"--trusted-proxy (TOKENRELAY_TRUSTED_PROXIES): {exc}") from None
        if self.queue_frames > self.hard_limit_frames:
            raise ConfigError("need --queue-frames <= --hard-limit-frames")
        settings.check_redis(self.redis_url, self.redis_tls)
        if self.durable_open_prefix and not self.durable_open_prefix.startswith("/"):
            raise ConfigError(
                "--durable-open-prefix must start with '/' (a prefix of /<stream path>; "
                "'/' opens every stream)"
            )
        if self.durable_open_prefix and self.keys_file:
            raise ConfigError(
                "--durable-open-prefix (TOKENRELAY_DURABLE_OPEN_PREFIX) turns auth off for "
                "a path prefix: refused with a production key file (--keys)"
            )
        if not self.relay_id:
            return msgspec.structs.replace(self, relay_id=default_relay_id())
        return self


ENV: Final[dict[str, str]] = settings.env_names(RelayConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per field (``--redis`` for ``redis_url``); every default is None so
    that an absent flag falls back to the environment, then to the struct's default."""
    settings.add_arguments(parser, RelayConfig)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RelayConfig:
    """Merge flags over environment over defaults and validate."""
    return settings.load(RelayConfig, args, environ)
