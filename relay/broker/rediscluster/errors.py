"""The one place where redis-py errors become relay errors (:mod:`relay.broker.errors`).

Order of use: I/O code wraps every redis-py call in ``with map_redis_errors():`` (or
calls :func:`convert`) so that nothing above the transport sees a ``redis.exceptions``
type.

redis-py 8.1 (asyncio) also leaks ``AttributeError`` / ``TypeError`` / ``RuntimeError``
when one task writes on a pooled connection that another task (or the peer) has just
closed: ``'NoneType' object has no attribute 'writelines'`` after a concurrent
``disconnect()`` (the cluster client disconnects a node's free connections when any
command on it fails), uvloop's ``unable to perform operation on <TCPTransport
closed=True>``. They are connection failures (redis-py issues #3546 and #4287, fixed
upstream by PR #4288, unreleased as of 8.1.0), so :func:`map_redis_errors` turns them
into :class:`RedisUnavailable` when they are raised inside redis-py or the event loop's
transport code, and only then: the same exception types from our own code stay bugs.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import redis
import redis.exceptions as rex

from relay.broker.errors import RedisCommandError, RedisUnavailable, RelayError

__all__ = [
    "LIBRARY_ERRORS",
    "beyond_retry",
    "convert",
    "is_closed_connection_race",
    "map_redis_errors",
]

# What redis-py raises on its own (a start-up that cannot reach the cluster, outside
# map_redis_errors): for callers that catch it without naming the library.
LIBRARY_ERRORS: Final = (rex.RedisError, rex.RedisClusterException)


def convert(exc: BaseException) -> RelayError:
    """The relay exception for a redis-py exception (or any OSError / timeout).

    Failover states are :class:`RedisUnavailable` (retry later), including redis-py's
    ``SlotNotCoveredError``, which is not a ``RedisError`` subclass."""
    if isinstance(exc, RelayError):
        return exc
    if isinstance(exc, rex.ConnectionError | rex.TimeoutError | OSError | TimeoutError):
        return RedisUnavailable(str(exc) or type(exc).__name__)
    if isinstance(
        exc,
        rex.ClusterDownError
        | rex.TryAgainError
        | rex.MasterDownError
        | rex.ReadOnlyError  # a demoted master, before the client's map catches up
        | rex.SlotNotCoveredError,  # mid-failover: no node serves the slot yet
    ):
        return RedisUnavailable(str(exc) or type(exc).__name__)
    if isinstance(exc, rex.RedisClusterException) and isinstance(
        exc.__cause__, rex.ConnectionError | rex.TimeoutError | OSError | TimeoutError
    ):  # "Redis Cluster cannot be connected": no start-up node answered
        return RedisUnavailable(str(exc) or type(exc).__name__)
    return RedisCommandError(str(exc) or type(exc).__name__)


_TRANSPORT_CODE: Final = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (redis, asyncio))


def is_closed_connection_race(exc: BaseException) -> bool:
    """True for the non-Redis exceptions redis-py leaks when a connection is closed under
    a command (see the module docstring): the innermost frame is redis-py or asyncio."""
    if not isinstance(exc, AttributeError | TypeError | RuntimeError):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_TRANSPORT_CODE)


@contextmanager
def map_redis_errors() -> Iterator[None]:
    """Re-raise redis-py / socket errors as :class:`RelayError` subclasses."""
    try:
        yield
    except RelayError:
        raise
    except (rex.RedisError, rex.RedisClusterException, OSError, TimeoutError) as exc:
        raise convert(exc) from exc
    except (AttributeError, TypeError, RuntimeError) as exc:
        if not is_closed_connection_race(exc):
            raise
        raise RedisUnavailable(f"connection closed under the command: {exc}") from exc


def beyond_retry(exc: BaseException) -> bool:
    """A first-connection failure no retry can fix: the server's certificate is not
    trusted, or the password is refused (``exc`` or what it was raised from)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError | rex.AuthenticationError):
            return True
        if any(words in str(e) for words in ("certificate verify failed", "WRONGPASS")):
            return True
        e = e.__cause__ or e.__context__
    return False
