"""Pure tests of the client address rule (relay.service.clientaddr) and the per-address token
buckets (relay.service.ratelimit): who is counted, and how fast a bucket refills."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.service.clientaddr import BadForwardedFor, client_address, parse_networks
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
    assert client_address("::1", "2001:db8::1", PROXIES, ipv6_prefix=128) == "2001:db8::1"
    # junk left of the client is never read; junk a trusted proxy vouches for is refused
    assert client_address("127.0.0.1", "garbage, 198.51.100.9", PROXIES) == "198.51.100.9"
    for xff in ("1.2.3.4, garbage", "garbage, 10.0.0.7"):  # 10.0.0.7 is a proxy: it vouches
        with pytest.raises(BadForwardedFor, match="garbage"):
            client_address("127.0.0.1", xff, PROXIES)


def test_one_address_has_one_spelling() -> None:
    """An IPv4-mapped IPv6 address, a port, brackets, a zone: the same bucket as the
    plain address; a peer is normalised as a forwarded address is."""
    for spelling in ("203.0.113.6", "::ffff:203.0.113.6", "203.0.113.6:1234",
                     "[::ffff:203.0.113.6]:443", " 203.0.113.6 ", "::FFFF:CB00:7106"):  # fmt: skip
        assert client_address("127.0.0.1", spelling, PROXIES) == "203.0.113.6", spelling
    assert client_address("::ffff:203.0.113.6", None, PROXIES) == "203.0.113.6"
    assert client_address("::ffff:127.0.0.1", "198.51.100.2", PROXIES) == "198.51.100.2"
    six = "2001:db8:1:2::"
    for spelling in ("2001:db8:1:2::5", "[2001:DB8:1:2:0:0:0:5]", "[2001:db8:1:2::5]:8080",
                     "2001:db8:1:2:ffff:ffff:ffff:ffff", "fe80::1%eth0"):  # fmt: skip
        want = "fe80::/64" if spelling.startswith("fe80") else f"{six}/64"
        assert client_address("127.0.0.1", spelling, PROXIES) == want, spelling
    assert client_address("2001:db8:1:3::9", None, PROXIES) == "2001:db8:1:3::/64"


def test_ipv6_grouping_is_a_setting() -> None:
    addr = "2001:db8:1:2:3:4:5:6"
    assert client_address(addr, None, (), ipv6_prefix=128) == addr
    assert client_address(addr, None, (), ipv6_prefix=48) == "2001:db8:1::/48"
    assert client_address("203.0.113.6", None, (), ipv6_prefix=48) == "203.0.113.6"


@pytest.mark.parametrize(
    "hop",
    ["203.000.113.009", "203.0.113", "203.0.113.6.7", "256.1.1.1", "1.2.3.4:99999",
     "1.2.3.4:", "[1.2.3.4]", "::ffff:1.2.3.4:80", "[2001:db8::1", "unknown", "", "0x7f.1"],
)  # fmt: skip
def test_unparsable_addresses_from_a_trusted_proxy_are_refused(hop: str) -> None:
    with pytest.raises(BadForwardedFor) as exc:
        client_address("127.0.0.1", f"198.51.100.1, {hop}", PROXIES)
    assert "X-Forwarded-For" in str(exc.value)
    # from a client that is not a trusted proxy, the header is not read at all
    assert client_address("203.0.113.5", hop, PROXIES) == "203.0.113.5"


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
