"""Pure tests of the relay configuration: flags over environment over defaults, and
unsafe configurations refused (weak or default secrets, secret plus insecure mode)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from relay.edge.config import RelayConfig, add_arguments, from_args
from relay.service.settings import ConfigError

K = "relay-config-test-secret-4c2e8a6f1b3d5e7a"  # a strong secret (>= 32 bytes, varied)
K2 = "another-relay-test-secret-9b7d5f3a1c2e4f6a"


def parse(argv: list[str], env: dict[str, str]) -> RelayConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv), env)


def test_defaults_with_a_secret() -> None:
    cfg = parse([], {"TOKENRELAY_SECRET": K})
    assert (cfg.host, cfg.heartbeat_s, cfg.retry_ms, cfg.secret) == ("127.0.0.1", 15.0, 1000, K)
    assert (cfg.max_streams_per_token, cfg.max_streams_per_address) == (16, 256)
    assert cfg.relay_id  # hostname-pid
    assert cfg.auth_enabled


def test_empty_secret_refused_unless_insecure() -> None:
    with pytest.raises(ConfigError, match="secret"):
        parse([], {})
    cfg = parse(["--insecure-no-auth"], {})
    assert not cfg.auth_enabled


def test_flags_override_environment() -> None:
    env = {
        "TOKENRELAY_REDIS_URL": "redis://127.0.0.1:7100",
        "TOKENRELAY_PORT": "9000",
        "TOKENRELAY_SECRET": K,
        "TOKENRELAY_HEARTBEAT_S": "2.5",
        "TOKENRELAY_MAX_STREAMS_PER_TOKEN": "4",
    }
    cfg = parse(["--port", "9001", "--secret", K2, "--relay-id", "r7"], env)
    assert (cfg.port, cfg.secret, cfg.relay_id) == (9001, K2, "r7")
    assert (cfg.redis_url, cfg.heartbeat_s, cfg.max_streams_per_token) == (
        "redis://127.0.0.1:7100",
        2.5,
        4,
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--insecure-no-auth"], {"TOKENRELAY_SECRET": K}),
        (["--secret", K], {"TOKENRELAY_INSECURE_NO_AUTH": "true"}),
        ([], {"TOKENRELAY_SECRET": K, "TOKENRELAY_INSECURE_NO_AUTH": "1"}),
        (["--secret", K, "--insecure-no-auth"], {}),
    ],
)
def test_a_secret_and_insecure_mode_together_are_refused(
    argv: list[str], env: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match="choose one"):
        parse(argv, env)


@pytest.mark.parametrize(
    "secret",
    ["k", "x" * 31, "y" * 64, "change-me-in-production", "demo-secret-change-me-0123456789abcd"],
)
def test_weak_or_default_secrets_are_refused(secret: str) -> None:
    with pytest.raises(ConfigError):
        parse([], {"TOKENRELAY_SECRET": secret})


def test_a_relay_refuses_a_private_key_and_accepts_the_public_one(tmp_path: Path) -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    for name, key in (("priv", private), ("pub", private.public_key())):
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key))
        (tmp_path / f"{name}.json").write_text(json.dumps({"keys": [{**jwk, "kid": "e1"}]}))
    with pytest.raises(ConfigError, match="private key 'e1'"):
        parse(["--keys", str(tmp_path / "priv.json")], {})
    cfg = parse([], {"TOKENRELAY_KEYS_FILE": str(tmp_path / "pub.json")})
    keys = cfg.keyset()
    assert keys is not None
    assert list(keys.keys) == ["e1"]
    assert keys.signing is None


def test_bad_environment_values_say_which_variable() -> None:
    with pytest.raises(ConfigError, match="TOKENRELAY_PORT"):
        parse([], {"TOKENRELAY_SECRET": K, "TOKENRELAY_PORT": "eighty"})
    with pytest.raises(ConfigError, match="TOKENRELAY_INSECURE_NO_AUTH"):
        parse([], {"TOKENRELAY_INSECURE_NO_AUTH": "maybe"})
    with pytest.raises(ConfigError, match="--trusted-proxy"):
        parse([], {"TOKENRELAY_SECRET": K, "TOKENRELAY_TRUSTED_PROXIES": "10.0.0.0/8,nope"})


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="--queue-frames"):
        RelayConfig(secret=K, queue_frames=10, hard_limit_frames=5).validate()
    with pytest.raises(ConfigError, match="redis"):
        RelayConfig(secret=K, redis_url="http://x").validate()
    with pytest.raises(ConfigError, match="--max-streams-per-token"):
        RelayConfig(secret=K, max_streams_per_token=-1).validate()


def test_reaper_delay_from_flag_and_environment_zero_disables_negative_refused() -> None:
    assert parse([], {"TOKENRELAY_SECRET": K}).reap_after_s == 2.0
    assert parse(["--reap-after-s", "0"], {"TOKENRELAY_SECRET": K}).reap_after_s == 0.0
    env = {"TOKENRELAY_SECRET": K, "TOKENRELAY_REAP_AFTER_S": "5"}
    assert parse([], env).reap_after_s == 5.0
    with pytest.raises(ConfigError, match="reap"):
        parse(["--reap-after-s", "-1"], {"TOKENRELAY_SECRET": K})


def test_gateway_keys_come_from_flags_or_the_environment_and_are_long() -> None:
    """The Responses stream's keys: the workers' ``--gateway-key`` (an empty variable,
    as docker-compose passes it unset, is none)."""
    assert parse([], {"TOKENRELAY_SECRET": K, "TOKENRELAY_GATEWAY_KEYS": ""}).gateway_keys == ()
    env = {"TOKENRELAY_SECRET": K, "TOKENRELAY_GATEWAY_KEYS": "a" * 16 + "," + "b" * 16}
    assert parse([], env).gateway_keys == ("a" * 16, "b" * 16)
    assert parse(["--gateway-key", "c" * 20], {"TOKENRELAY_SECRET": K}).gateway_keys == ("c" * 20,)
    with pytest.raises(ConfigError, match="at least 16"):
        parse(["--gateway-key", "short"], {"TOKENRELAY_SECRET": K})
