"""The kit's ownership rule (relay.service.apikeys): who made an object, as its record
stores it: a keyed digest of the caller's key, never the key."""

from __future__ import annotations

from relay.service.apikeys import caller, owner_tag, owns

K1 = "gateway-key-one-7c2f1e9a4b5d6083"
K2 = "gateway-key-two-0e4d8b1a6c3f2957"


def test_the_tag_names_the_api_and_hides_the_key() -> None:
    tag = owner_tag("responses", K1, "sess1")
    api, _, digest = tag.partition(":")
    assert api == "responses"
    assert len(digest) == 32
    assert int(digest, 16) >= 0
    assert K1 not in tag
    assert K1[:8] not in tag
    assert owner_tag("responses", K1, "sess1") == tag  # the same on every worker and relay


def test_only_the_maker_owns_the_object() -> None:
    tag = owner_tag("responses", K1, "sess1")
    assert owns(tag, "responses", K1, "sess1")
    assert not owns(tag, "responses", K2, "sess1")
    assert not owns(tag, "responses", K1, "sess2")  # a tag copied to another object
    assert not owns(tag, "jobs", K1, "sess1")  # another API's object
    assert not owns("responses", "responses", K1, "sess1")  # an untagged (older) record
    assert not owns("", "responses", "", "sess1")


def test_the_caller_is_the_bearer_key_or_everyone_without_auth() -> None:
    assert caller(f"Bearer {K1}", auth=True) == K1
    assert caller(f"bearer  {K1} ", auth=True) == K1
    assert caller(f"Bearer {K1}", auth=False) == ""
    assert caller(None, auth=False) == ""
    anyone = owner_tag("responses", caller(None, auth=False), "s")
    assert owns(anyone, "responses", caller(f"Bearer {K2}", auth=False), "s")
