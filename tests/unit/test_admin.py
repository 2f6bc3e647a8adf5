"""The rule of the operator's endpoints (relay.service.admin): with a key, only that key as
a Bearer token; without one, only a local request that names no forwarded client."""

from __future__ import annotations

import pytest

from relay.protocol.codes import Refusal
from relay.service.admin import admin_key, admin_refusal

KEY = admin_key("admin-key-for-tests-5c1e9a7f3b2d8e4a6c0f")


def _code(*args: object) -> Refusal | None:
    refused = admin_refusal(*args)  # type: ignore[arg-type]
    return None if refused is None else refused.error


def test_with_a_key_only_the_key_is_served() -> None:
    assert KEY is not None
    bearer = f"Bearer {KEY.decode()}"
    assert _code(KEY, bearer, "203.0.113.9", True) is None  # from anywhere, through anything
    assert _code(KEY, f"bearer  {KEY.decode()} ", "127.0.0.1", False) is None
    assert _code(KEY, None, "127.0.0.1", False) is Refusal.ADMIN_KEY_MISSING  # local too
    assert _code(KEY, "Basic abc", "127.0.0.1", False) is Refusal.ADMIN_KEY_MISSING
    assert _code(KEY, "Bearer ", "127.0.0.1", False) is Refusal.ADMIN_KEY_MISSING
    assert _code(KEY, bearer + "x", "127.0.0.1", False) is Refusal.ADMIN_KEY_INVALID
    assert _code(KEY, bearer[:-1], "127.0.0.1", False) is Refusal.ADMIN_KEY_INVALID
    missing = admin_refusal(KEY, None, None, False)
    assert missing is not None
    assert missing.status == 401


@pytest.mark.parametrize(
    ("peer", "forwarded", "served"),
    [
        ("127.0.0.1", False, True),
        ("127.8.9.10", False, True),
        ("::1", False, True),
        ("::ffff:127.0.0.1", False, True),
        ("127.0.0.1", True, False),  # a proxy on this host, for someone else
        ("10.0.0.5", False, False),
        ("203.0.113.9", False, False),
        ("::ffff:203.0.113.9", False, False),
        (None, False, False),
        ("not-an-address", False, False),
    ],
)
def test_without_a_key_only_local_requests_are_served(
    peer: str | None, forwarded: bool, served: bool
) -> None:
    refused = admin_refusal(None, "Bearer anything", peer, forwarded)
    assert (refused is None) == served
    if refused is not None:
        assert (refused.status, refused.error) == (403, Refusal.ADMIN_LOOPBACK_ONLY)
        assert "--admin-key" in refused.reason


def test_a_weak_admin_key_is_refused() -> None:
    assert admin_key("") is None
    for weak in ("short", "x" * 40, "change-me-0123456789abcdefghijklmnopqrs"):
        with pytest.raises(ValueError, match="admin key"):
            admin_key(weak)


def test_relays_and_workers_refuse_a_weak_admin_key_at_start() -> None:
    from relay.edge.config import RelayConfig
    from relay.service.settings import ConfigError
    from worker.config import WorkerConfig

    secret = "test-secret-9d41c7e2b8a05f36c1d4e7a2b9f0"
    with pytest.raises(ConfigError, match="TOKENRELAY_ADMIN_KEY"):
        RelayConfig(secret=secret, admin_key="short").validate()
    with pytest.raises(ConfigError, match="TOKENRELAY_ADMIN_KEY"):
        WorkerConfig(port=1, redis_url="redis://127.0.0.1:1", engine_urls=("http://e:1",),
                     secret=secret, admin_key="x" * 40).validate()  # fmt: skip
