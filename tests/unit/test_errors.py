"""Pure tests of the one place where redis-py errors become relay errors."""

from __future__ import annotations

import pytest
import redis.exceptions as rex
from redis.asyncio.connection import Connection

from relay.broker.errors import RedisCommandError, RedisUnavailable
from relay.broker.rediscluster.errors import convert, is_closed_connection_race, map_redis_errors


async def test_a_write_on_a_connection_closed_under_it_is_redis_unavailable() -> None:
    """redis-py 8.1's race (#3546): another task's disconnect() cleared ``_writer``
    between the connected check and the write, and the write raised AttributeError.
    The same call, on a real Connection: RedisUnavailable whichever redis-py answers
    (8.2 checks the writer itself and raises its ConnectionError)."""
    conn = Connection(host="127.0.0.1", port=1)  # never connected: _writer is None
    with pytest.raises(RedisUnavailable) as info:  # noqa: SIM117
        with map_redis_errors():
            await conn._send_packed_command([b"*1\r\n$4\r\nPING\r\n"])
    cause = info.value.__cause__
    assert isinstance(cause, AttributeError | rex.ConnectionError), repr(cause)
    if isinstance(cause, AttributeError):
        assert "closed under the command" in str(info.value)


def test_the_same_exception_types_from_our_own_code_stay_bugs() -> None:
    for exc in (AttributeError("ours"), TypeError("ours"), RuntimeError("ours")):
        with pytest.raises(type(exc)) as info, map_redis_errors():
            raise exc
        assert not is_closed_connection_race(info.value)


def test_redis_errors_are_converted_by_kind() -> None:
    cases: list[tuple[Exception, type[Exception]]] = [
        (rex.ConnectionError("refused"), RedisUnavailable),
        (rex.TimeoutError("slow"), RedisUnavailable),
        (rex.TryAgainError("TRYAGAIN"), RedisUnavailable),
        (rex.ResponseError("WRONGTYPE"), RedisCommandError),
        (ConnectionResetError(104, "reset"), RedisUnavailable),
        (rex.RedisClusterException("Argument 'db' must be 0"), RedisCommandError),
    ]
    for exc, kind in cases:
        with pytest.raises(kind), map_redis_errors():
            raise exc


def test_a_cluster_with_no_reachable_start_up_node_is_unavailable() -> None:
    """redis-py raises RedisClusterException("cannot be connected") from the node's
    connection error: an outage to retry, not a command the server refused."""
    exc = rex.RedisClusterException("Redis Cluster cannot be connected.")
    exc.__cause__ = rex.ConnectionError("Error 111 connecting to 127.0.0.1:1")
    assert isinstance(convert(exc), RedisUnavailable)
