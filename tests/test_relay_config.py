"""Pure tests of the relay configuration: flags over environment over defaults."""

from __future__ import annotations

import argparse

import pytest

from relay.config import ConfigError, RelayConfig, add_arguments, from_args


def parse(argv: list[str], env: dict[str, str]) -> RelayConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv), env)


def test_defaults_with_a_secret():
    cfg = parse([], {"TOKENRELAY_SECRET": "k"})
    assert (cfg.host, cfg.heartbeat_s, cfg.retry_ms, cfg.secret) == ("127.0.0.1", 15.0, 1000, "k")
    assert cfg.relay_id  # hostname-pid
    assert cfg.auth_enabled


def test_empty_secret_refused_unless_insecure():
    with pytest.raises(ConfigError, match="secret"):
        parse([], {})
    cfg = parse(["--insecure-no-auth"], {})
    assert not cfg.auth_enabled


def test_flags_override_environment():
    env = {
        "TOKENRELAY_REDIS_URL": "redis://127.0.0.1:7100",
        "TOKENRELAY_PORT": "9000",
        "TOKENRELAY_SECRET": "env",
        "TOKENRELAY_HEARTBEAT_S": "2.5",
    }
    cfg = parse(["--port", "9001", "--secret", "flag", "--relay-id", "r7"], env)
    assert (cfg.port, cfg.secret, cfg.relay_id) == (9001, "flag", "r7")
    assert (cfg.redis_url, cfg.heartbeat_s) == ("redis://127.0.0.1:7100", 2.5)


def test_insecure_flag_overrides_secret_in_environment():
    cfg = parse(["--insecure-no-auth"], {"TOKENRELAY_SECRET": "env"})
    assert not cfg.auth_enabled
    assert cfg.secret == ""


def test_secret_flag_overrides_insecure_environment():
    cfg = parse(["--secret", "k"], {"TOKENRELAY_INSECURE_NO_AUTH": "true"})
    assert cfg.auth_enabled


def test_bad_environment_values_say_which_variable():
    with pytest.raises(ConfigError, match="TOKENRELAY_PORT"):
        parse([], {"TOKENRELAY_SECRET": "k", "TOKENRELAY_PORT": "eighty"})
    with pytest.raises(ConfigError, match="TOKENRELAY_INSECURE_NO_AUTH"):
        parse([], {"TOKENRELAY_INSECURE_NO_AUTH": "maybe"})


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="queue_frames"):
        RelayConfig(secret="k", queue_frames=10, hard_limit_frames=5).validate()
    with pytest.raises(ConfigError, match="redis"):
        RelayConfig(secret="k", redis_url="http://x").validate()


def test_reaper_delay_from_flag_and_environment_zero_disables_negative_refused():
    assert parse([], {"TOKENRELAY_SECRET": "k"}).reap_after_s == 2.0
    assert parse(["--reap-after-s", "0"], {"TOKENRELAY_SECRET": "k"}).reap_after_s == 0.0
    env = {"TOKENRELAY_SECRET": "k", "TOKENRELAY_REAP_AFTER_S": "5"}
    assert parse([], env).reap_after_s == 5.0
    with pytest.raises(ConfigError, match="reap"):
        parse(["--reap-after-s", "-1"], {"TOKENRELAY_SECRET": "k"})
