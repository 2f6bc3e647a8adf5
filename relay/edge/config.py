"""The edge server's configuration: one frozen struct, filled from flags and environment.

Precedence: command-line flag > environment variable > default. Every field has one
environment variable, ``TOKENRELAY_<FIELD>`` (upper case), listed in :data:`ENV`.

Order of use: the CLI builds its parser with :func:`add_arguments`, then calls
:func:`from_args` (which reads ``os.environ`` unless given a mapping) and gets a
validated :class:`RelayConfig`, or :class:`ConfigError` with a reason. Tests build
``RelayConfig(...)`` directly and call :meth:`RelayConfig.validate`.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from relay.protocol.auth import DEFAULT_KID, KeySet, WeakSecret, load_keys
from relay.redisio.connect import RedisTLS
from relay.service.clientaddr import parse_networks

__all__ = [
    "ENV",
    "ConfigError",
    "RelayConfig",
    "add_arguments",
    "default_relay_id",
    "from_args",
]


class ConfigError(ValueError):
    """A configuration the relay refuses to start with; the message says why."""


def default_relay_id() -> str:
    """``<hostname>-<pid>``: unique per process, readable on the demo page."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the edge server needs. Times in seconds unless the name says ms."""

    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str = "redis://127.0.0.1:7000"
    redis_ca: str = ""  # TLS (rediss://): CA bundle, client certificate and key files
    redis_cert: str = ""
    redis_key: str = ""
    secret: str = ""  # HS256 secret of key ``kid``; prefer TOKENRELAY_SECRET to the flag
    kid: str = DEFAULT_KID
    keys_file: str = ""  # a JWK Set: more HS256 secrets (rotation), ES256/RS256 public keys
    insecure_no_auth: bool = False
    relay_id: str = ""
    heartbeat_s: float = 15.0
    retry_ms: int = 1000
    queue_frames: int = 1024
    hard_limit_frames: int = 4096
    max_pending_bytes: int = 1 << 20  # per stream, after merging; past it: slow_consumer
    replay_budget_bytes: int = 64 << 20  # replay pages in memory, relay-wide; past it: wait
    unsubscribe_delay_s: float = 2.0
    reap_after_s: float = 2.0  # an open turn silent this long and unlocked is reaped; 0: never
    drain_deadline_s: float = 10.0
    write_timeout_s: float = 10.0
    head_timeout_s: float = 10.0  # a connection's first request head must arrive this fast
    max_connections: int = 10_000
    ws_max_message_bytes: int = 4096
    cors_origin: str = "*"
    max_streams_per_token: int = 16  # 0: no limit
    max_streams_per_address: int = 256  # 0: no limit
    trusted_proxies: str = ""  # comma-separated addresses / CIDRs allowed to set X-Forwarded-For

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    @property
    def auth_enabled(self) -> bool:
        """Tokens are required unless ``insecure_no_auth`` (which allows an empty secret)."""
        return not self.insecure_no_auth

    def keyset(self) -> KeySet | None:
        """The keys tokens are verified with; None when auth is off. Raises ConfigError."""
        if self.insecure_no_auth:
            return None
        try:
            keys = load_keys(self.secret or None, self.kid, self.keys_file or None)
        except WeakSecret as exc:
            raise ConfigError(str(exc)) from None
        private = keys.has_private_keys()
        if private:
            raise ConfigError(
                f"the key file holds the private key {private[0]!r}: a relay verifies "
                "tokens and needs only public keys"
            )
        return keys

    def validate(self) -> RelayConfig:
        """Return self, or raise :class:`ConfigError`; fills ``relay_id`` if empty."""
        if self.insecure_no_auth and (self.secret or self.keys_file):
            raise ConfigError(
                "a token secret and --insecure-no-auth (TOKENRELAY_INSECURE_NO_AUTH) are both "
                "set: choose one"
            )
        if not self.secret and not self.keys_file and not self.insecure_no_auth:
            raise ConfigError(
                "no token secret: set TOKENRELAY_SECRET (or --keys FILE), "
                "or --insecure-no-auth for local experiments"
            )
        self.keyset()
        if self.max_streams_per_token < 0 or self.max_streams_per_address < 0:
            raise ConfigError("max_streams_per_token and max_streams_per_address must be >= 0")
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise ConfigError(f"trusted_proxies: {exc}") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} out of range")
        if (
            self.heartbeat_s <= 0
            or self.write_timeout_s <= 0
            or self.head_timeout_s <= 0
            or self.drain_deadline_s < 0
            or self.unsubscribe_delay_s < 0
            or self.reap_after_s < 0
        ):
            raise ConfigError(
                "heartbeat_s, write_timeout_s and head_timeout_s must be > 0; "
                "drain, unsubscribe and reap delays must be >= 0"
            )
        if self.retry_ms < 0:
            raise ConfigError("retry_ms must be >= 0")
        if not 1 <= self.queue_frames <= self.hard_limit_frames:
            raise ConfigError("need 1 <= queue_frames <= hard_limit_frames")
        if self.max_pending_bytes < 512 * 1024 or self.replay_budget_bytes < 512 * 1024:
            raise ConfigError("max_pending_bytes and replay_budget_bytes must be >= 524288")
        if self.max_connections < 1 or self.ws_max_message_bytes < 16:
            raise ConfigError("max_connections must be >= 1, ws_max_message_bytes >= 16")
        try:
            self.redis_tls.check(self.redis_url)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.relay_id:
            return msgspec.structs.replace(self, relay_id=default_relay_id())
        return self


_FIELDS: Final[dict[str, type]] = {
    "host": str,
    "port": int,
    "redis_url": str,
    "redis_ca": str,
    "redis_cert": str,
    "redis_key": str,
    "secret": str,
    "kid": str,
    "keys_file": str,
    "insecure_no_auth": bool,
    "relay_id": str,
    "heartbeat_s": float,
    "retry_ms": int,
    "queue_frames": int,
    "hard_limit_frames": int,
    "max_pending_bytes": int,
    "replay_budget_bytes": int,
    "unsubscribe_delay_s": float,
    "reap_after_s": float,
    "drain_deadline_s": float,
    "write_timeout_s": float,
    "head_timeout_s": float,
    "max_connections": int,
    "ws_max_message_bytes": int,
    "cors_origin": str,
    "max_streams_per_token": int,
    "max_streams_per_address": int,
    "trusted_proxies": str,
}
ENV: Final[dict[str, str]] = {name: f"TOKENRELAY_{name.upper()}" for name in _FIELDS}
_TRUE: Final = frozenset(("1", "true", "yes", "on"))
_FALSE: Final = frozenset(("0", "false", "no", "off", ""))


def _from_env(name: str, text: str) -> Any:
    kind = _FIELDS[name]
    if kind is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{ENV[name]}={text!r}: expected true/false")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{ENV[name]}={text!r}: expected {kind.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per field (``--redis`` for ``redis_url``); every default is None so
    that an absent flag falls back to the environment, then to the struct's default."""
    d = RelayConfig()
    a = parser.add_argument
    a("--host", help=f"address to bind (default {d.host})")
    a("--port", type=int, help=f"port to bind (default {d.port})")
    a("--redis", dest="redis_url", help=f"a Redis Cluster node URL, rediss:// for TLS (default {d.redis_url})")  # noqa: E501  # fmt: skip
    a("--redis-ca", help="rediss://: CA bundle (PEM) of the servers' certificates (default: system store)")  # noqa: E501  # fmt: skip
    a("--redis-cert", help="rediss://: client certificate (PEM), with --redis-key")
    a("--redis-key", help="rediss://: the client certificate's private key (PEM)")
    a("--secret", help="HS256 secret of tokens, >= 32 bytes; prefer TOKENRELAY_SECRET "
      "(a flag is visible in ps)")  # fmt: skip
    a("--kid", help=f"key id of --secret in token headers ({d.kid})")
    a("--keys", dest="keys_file", help="JWK Set file: more HS256 secrets (rotation), "
      "ES256 / RS256 public keys")  # fmt: skip
    a(
        "--insecure-no-auth",
        action="store_const",
        const=True,
        help="accept every request without a token (local experiments only)",
    )
    a("--relay-id", help="name shown to clients (default <hostname>-<pid>)")
    a("--heartbeat-s", type=float, help=f"SSE comment / WS idle interval ({d.heartbeat_s})")
    a("--retry-ms", type=int, help=f"SSE retry: hint ({d.retry_ms})")
    a("--queue-frames", type=int, help=f"per-watch queue before conflation ({d.queue_frames})")
    a("--hard-limit-frames", type=int, help=f"slow-client cutoff ({d.hard_limit_frames})")
    a("--max-pending-bytes", type=int, help=f"per-stream bytes pending before the slow-client cutoff ({d.max_pending_bytes})")  # noqa: E501  # fmt: skip
    a("--replay-budget-bytes", type=int, help=f"replay pages in memory, relay-wide; more replays wait ({d.replay_budget_bytes})")  # noqa: E501  # fmt: skip
    a("--unsubscribe-delay-s", type=float, help=f"linger before SUNSUBSCRIBE ({d.unsubscribe_delay_s})")  # noqa: E501  # fmt: skip
    a("--reap-after-s", type=float, help=f"end a silent turn whose worker is gone after this; 0: never ({d.reap_after_s})")  # noqa: E501  # fmt: skip
    a("--drain-deadline-s", type=float, help=f"SIGTERM drain deadline ({d.drain_deadline_s})")
    a("--write-timeout-s", type=float, help=f"slow-client write cutoff ({d.write_timeout_s})")
    a("--head-timeout-s", type=float, help=f"408 for a request head slower than this ({d.head_timeout_s})")  # noqa: E501  # fmt: skip
    a("--max-connections", type=int, help=f"streams at once; more get 503 ({d.max_connections})")
    a("--ws-max-message-bytes", type=int, help=f"largest WS client message ({d.ws_max_message_bytes})")  # noqa: E501  # fmt: skip
    a("--cors-origin", help=f"Access-Control-Allow-Origin ({d.cors_origin!r})")
    a("--max-streams-per-token", type=int, help=f"open streams per token; more get 429; 0: no limit ({d.max_streams_per_token})")  # noqa: E501  # fmt: skip
    a("--max-streams-per-address", type=int, help=f"open streams per client address; 0: no limit ({d.max_streams_per_address})")  # noqa: E501  # fmt: skip
    a("--trusted-proxy", dest="trusted_proxies", help="addresses / CIDRs (comma-separated) whose X-Forwarded-For is believed (none)")  # noqa: E501  # fmt: skip


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RelayConfig:
    """Merge flags over environment over defaults and validate."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in _FIELDS:
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
        elif ENV[name] in env:
            values[name] = _from_env(name, env[ENV[name]])
    return RelayConfig(**values).validate()
