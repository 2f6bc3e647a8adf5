"""Pure tests of the client address rule (relay.service.clientaddr) and the per-address token
buckets (relay.service.ratelimit): who is counted, and how fast a bucket refills."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.service.clientaddr import client_address, parse_networks
from relay.service.ratelimit import Buckets

PROXIES = parse_networks("10.0.0.0/8, 127.0.0.1, ::1")


def test_the_peer_is_the_client_unless_it_is_a_trusted_proxy() -> None:
    assert client_address("203.0.113.5", None, PROXIES) == "203.0.113.5"
    assert client_address("203.0.113.5", "1.2.3.4", PROXIES) == "203.0.113.5"  # not a proxy
    assert client_address("203.0.113.5", "1.2.3.4", ()) == "203.0.113.5"
    assert client_address("127.0.0.1", "1.2.3.4", PROXIES) == "1.2.3.4"
    assert client_address(None, None, PROXIES) == "unknown"


def test_forwarded_for_is_read_from_the_right_past_trusted_hops() -> None:
    # client-supplied junk on the left, then the real client, then our proxies
    xff = "6.6.6.6, 198.51.100.9, 10.1.2.3"
    assert client_address("127.0.0.1", xff, PROXIES) == "198.51.100.9"
    assert client_address("127.0.0.1", "10.0.0.1, 10.0.0.2", PROXIES) == "10.0.0.1"
    assert client_address("::1", "2001:db8::1", PROXIES) == "2001:db8::1"
    # a malformed hop stops the walk at the last address we can vouch for
    assert client_address("127.0.0.1", "1.2.3.4, garbage", PROXIES) == "127.0.0.1"
    assert client_address("127.0.0.1", "garbage, 10.0.0.7", PROXIES) == "10.0.0.7"


@given(st.lists(st.ip_addresses(v=4).map(str), min_size=1, max_size=40))
def test_a_client_can_only_add_entries_it_does_not_control_the_answer(left: list[str]) -> None:
    """Whatever a client puts in front, a proxy appending the real peer decides."""
    xff = ", ".join([*left, "198.51.100.77"])
    assert client_address("127.0.0.1", xff, PROXIES) == "198.51.100.77"


def test_bad_proxy_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="nope"):
        parse_networks("10.0.0.0/8, nope")
    assert parse_networks("") == ()


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    b = Buckets(rate_per_s=2.0, burst=3)
    assert [b.take("a", 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("a", 100.0) == pytest.approx(0.5)  # one token every half second
    assert b.take("b", 100.0) == 0.0  # another key has its own bucket
    assert b.take("a", 100.6) == 0.0
    assert b.take("a", 100.6) > 0


def test_refused_requests_do_not_drain_the_bucket_further() -> None:
    b = Buckets(rate_per_s=1.0, burst=1)
    assert b.take("a", 0.0) == 0.0
    for _ in range(100):
        assert b.take("a", 0.5) == pytest.approx(0.5)
    assert b.take("a", 1.0) == 0.0


def test_buckets_are_bounded_in_memory_and_zero_rate_disables() -> None:
    b = Buckets(rate_per_s=1.0, burst=1, max_keys=100)
    for i in range(1000):
        b.take(f"k{i}", 0.0)
    assert len(b) == 100
    off = Buckets(rate_per_s=0.0, burst=1)
    assert all(off.take("a", 0.0) == 0.0 for _ in range(100))
    with pytest.raises(ValueError):
        Buckets(rate_per_s=-1, burst=1)
