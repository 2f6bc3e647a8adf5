"""The Redis Cluster client of every tokenrelay process: redis-py's, made to wait.

redis-py's asyncio :class:`~redis.asyncio.cluster.RedisCluster` keeps at most
``max_connections`` (default 100) connections per node and, when a command needs one
more, raises ``MaxConnectionsError`` at once instead of waiting for one to come back.
A burst therefore fails where it should queue: measured here, 400 concurrent turn
POSTs on one worker got 100 answers ``503 redis_unavailable``.

:class:`GatedRedisCluster` holds one of ``concurrency`` permits for each command and
each pipeline execution, and lets each node's pool hold ``concurrency`` connections.
A command uses one connection on one node and a pipeline at most one per node, so no
node can run out: the caller past the bound waits for a permit. Work a permit holder
starts itself (a pipeline retrying a redirected command through the client, in the
same task or in tasks it spawns) runs under the holder's permit (a context variable),
so a permit never waits for another permit.

A dead default node: every (re)initialization of redis-py's client sends ``COMMAND``
to its default node, the first primary of the slot map, and a failure there fails the
whole initialization. After a master dies (its slots still listed until it is
replaced), every command of the client then fails, on every shard, until that node
is back: measured here, a turn on a healthy shard answered 503 for as long as the
dead master stayed down. :class:`GatedRedisCluster` asks the other primaries in turn
and makes the first that answers the default node.

TLS: a ``rediss://`` URL makes every connection of the client TLS; :class:`RedisTLS`
names the files (CA bundle, client certificate and key) the relay's and the worker's
``--redis-ca`` / ``--redis-cert`` / ``--redis-key`` flags give, :meth:`RedisTLS.check`
refuses a combination that cannot work (a file with a plain ``redis://`` URL, a
certificate without its key, a file that cannot be read) with a one-line reason, and
:func:`ssl_context_of` rebuilds the client's TLS context for the connections that do
not go through redis-py (the relay's shard subscriber). :func:`mask_url` is the URL
as it may be logged: the password replaced by ``***``.

Order of use::

    tls = RedisTLS(ca="ca.pem", cert="client.pem", key="client.key")
    tls.check(url)                             # ValueError: a one-line reason
    redis = connect("rediss://127.0.0.1:7000", tls=tls, concurrency=128)
    await redis.initialize(); ...; await redis.aclose()
    log.info("redis %s", mask_url(url))
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import RedisSSLContext, SSLConnection
from redis.cluster import PRIMARY
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "DEFAULT_CONCURRENCY",
    "GatedRedisCluster",
    "RedisTLS",
    "check_url",
    "connect",
    "mask_url",
    "ssl_context_of",
    "startup_error",
]

DEFAULT_CONCURRENCY: Final = 128

_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("redis_permit", default=False)


class GatedRedisCluster(RedisCluster):
    """A :class:`RedisCluster` whose callers wait (see the module docstring)."""

    def __init__(self, *args: Any, concurrency: int = DEFAULT_CONCURRENCY, **kwargs: Any) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        kwargs.setdefault("max_connections", concurrency)
        if kwargs["max_connections"] < concurrency:
            raise ValueError("max_connections per node must be >= concurrency")
        super().__init__(*args, **kwargs)
        self.concurrency = concurrency
        self.waiting = 0  # callers waiting for a permit now
        self._permits = asyncio.Semaphore(concurrency)
        self.commands_parser = _AnyPrimaryCommandsParser(self)

    @contextlib.asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        """Hold one permit for the block; inside a holder's context, hold nothing more."""
        if _holding.get():
            yield
            return
        self.waiting += 1
        try:
            await self._permits.acquire()
        finally:
            self.waiting -= 1
        token = _holding.set(True)
        try:
            yield
        finally:
            _holding.reset(token)
            self._permits.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.permit():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:  # what redis-py refuses, refused the same way
            return super().pipeline(transaction, shard_hint)
        return _GatedPipeline(self, transaction)  # type: ignore[abstract]  # redis-py stub


class _GatedPipeline(ClusterPipeline):
    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client = self.cluster_client
        assert isinstance(client, GatedRedisCluster)
        async with client.permit():
            return await super().execute(raise_on_error, allow_redirections)


class _AnyPrimaryCommandsParser(AsyncCommandsParser):
    """redis-py's parser, initialized from the given node or, where that node does not
    answer, from the next primary that does (which becomes the client's default node)."""

    __slots__ = ("_client",)

    def __init__(self, client: RedisCluster) -> None:
        super().__init__()
        self._client = client

    async def initialize(self, node: ClusterNode | None = None) -> None:
        manager = self._client.nodes_manager
        first = node or manager.default_node
        others = [n for n in manager.get_nodes_by_server_type(PRIMARY) if n is not first]
        last: Exception | None = None
        for candidate in [first, *others]:
            if candidate is None:
                continue
            try:
                await super().initialize(candidate)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                last = exc
                continue
            if candidate is not first:
                manager.default_node = candidate
            return
        assert last is not None, "a cluster with no primary"
        raise last


@dataclass(frozen=True, slots=True)
class RedisTLS:
    """Files for TLS to Redis; empty means "not given". With none given, a ``rediss://``
    URL still encrypts and verifies the servers against the system's CA store."""

    ca: str = ""  # CA bundle (PEM) that signed the servers' certificates
    cert: str = ""  # client certificate (PEM), for servers with tls-auth-clients yes
    key: str = ""  # its private key (PEM, unencrypted)

    @property
    def given(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def check(self, url: str) -> None:
        """Raise ``ValueError`` with a one-line reason where TLS cannot work as asked."""
        scheme = check_url(url)
        if self.given and scheme != "rediss":
            raise ValueError(
                "--redis-ca/--redis-cert/--redis-key need a rediss:// URL "
                "(redis:// is plain TCP; the files would be ignored)"
            )
        if bool(self.cert) != bool(self.key):
            raise ValueError("--redis-cert and --redis-key go together (a client certificate and its key)")  # noqa: E501  # fmt: skip
        for flag, path in (("--redis-ca", self.ca), ("--redis-cert", self.cert), ("--redis-key", self.key)):  # noqa: E501  # fmt: skip
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: no such readable file")

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments for these files (``ssl_*``), none for empty ones;
        server certificates are always verified, host names included."""
        kw: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        if self.ca:
            kw["ssl_ca_certs"] = self.ca
        if self.cert:
            kw["ssl_certfile"] = self.cert
            kw["ssl_keyfile"] = self.key
        return kw


def check_url(url: str) -> str:
    """The scheme of a Redis node URL (``redis`` or ``rediss``); ``ValueError`` with a
    one-line reason (the URL's password masked) when it is not one: another scheme, no
    host, a port that is not a number in 1..65535."""
    example = "e.g. redis://127.0.0.1:7000"
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        given = f", not {parts.scheme}://" if parts.scheme else f" ({example})"
        raise ValueError(f"the Redis URL must start with redis:// or rediss://{given}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is no number, or out of range
        raise ValueError(f"the Redis URL {mask_url(url)} has no valid port ({example})") from None
    if not host:
        raise ValueError(f"the Redis URL {mask_url(url)} names no host ({example})")
    if port == 0:
        raise ValueError(f"the Redis URL {mask_url(url)} has no valid port ({example})")
    return parts.scheme


def mask_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: the URL as it may be logged."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:  # not a URL at all: say nothing of it
        return "<unparsable url>"


def startup_error(url: str, exc: BaseException) -> str:
    """The one line a process prints when it cannot reach Redis at start: the masked URL
    and the first line of the error, with the password scrubbed wherever it appears."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        first = first.replace(password, "***")
    return f"cannot connect to Redis at {mask_url(url)}: {first}"


def ssl_context_of(redis: RedisCluster) -> ssl.SSLContext | None:
    """The TLS context of ``redis``'s connections (None for plain TCP), for connections
    opened outside redis-py: the same CA, client certificate and checks."""
    kw = redis.get_connection_kwargs()
    cls = kw.get("connection_class")
    if not (isinstance(cls, type) and issubclass(cls, SSLConnection)):
        return None
    return RedisSSLContext(
        keyfile=kw.get("ssl_keyfile"),
        certfile=kw.get("ssl_certfile"),
        cert_reqs=kw.get("ssl_cert_reqs", "required"),
        ca_certs=kw.get("ssl_ca_certs"),
        ca_data=kw.get("ssl_ca_data"),
        ca_path=kw.get("ssl_ca_path"),
        check_hostname=bool(kw.get("ssl_check_hostname", True)),
        min_version=kw.get("ssl_min_version"),
        ciphers=kw.get("ssl_ciphers"),
        password=kw.get("ssl_password"),
    ).get()


def connect(
    url: str,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    tls: RedisTLS | None = None,
    **kwargs: Any,
) -> GatedRedisCluster:
    """A :class:`GatedRedisCluster` for ``url`` (``redis://host:port``, or ``rediss://``
    for TLS with ``tls``'s files); call ``await client.initialize()`` before use,
    ``await client.aclose()`` after. Raises ``ValueError`` as :meth:`RedisTLS.check`."""
    tls = tls or RedisTLS()
    tls.check(url)
    if urlsplit(url).scheme == "rediss":
        kwargs = {**tls.client_kwargs(), **kwargs}
    client = GatedRedisCluster.from_url(url, concurrency=concurrency, **kwargs)
    assert isinstance(client, GatedRedisCluster)
    return client
