"""`tokenrelay worker` flags become a WorkerConfig; bad values are refused with a reason."""

from __future__ import annotations

import argparse

import pytest

from relay.producer.coalesce import CoalescePolicy
from relay.producer.presence import PresencePolicy
from relay.protocol.keys import BACKLOG_MAXLEN, SESSION_TTL_S
from worker.cli import config_from_args, register
from worker.config import WorkerConfig
from worker.routing.policy import DEFAULT_SPILL

BASE = ["worker", "--port", "0", "--redis", "redis://127.0.0.1:7000", "--insecure-no-auth"]


def _parse(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args([*BASE, "--engine", "e1=http://127.0.0.1:9000", *extra])


def test_defaults_wait_two_seconds_for_a_slot_and_route_by_cost() -> None:
    cfg = config_from_args(_parse())
    assert cfg.routing == "cost_aware"  # what the routing simulator chose
    assert cfg.spill == DEFAULT_SPILL == "least_loaded"  # what the simulator chose
    assert cfg.admit_wait_s == 2.0
    assert cfg.admit_wait_s < cfg.lock_ttl_s
    assert [e.id for e in cfg.engines] == ["e1"]


def test_admit_wait_is_configurable_and_zero_means_no_wait() -> None:
    assert config_from_args(_parse("--admit-wait-s", "0")).admit_wait_s == 0.0
    assert config_from_args(_parse("--admit-wait-s", "0.5")).admit_wait_s == 0.5


@pytest.mark.parametrize("value", ["-1", "5", "60"])
def test_an_admit_wait_outside_the_lock_ttl_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match=r"--admit-wait-s \(TOKENRELAY_ADMIT_WAIT_S\) must be"):
        config_from_args(_parse("--admit-wait-s", value))


def test_the_round_robin_baseline_and_the_walk_are_flags() -> None:
    cfg = config_from_args(_parse("--routing", "round_robin", "--spill", "walk"))
    assert (cfg.routing, cfg.spill) == ("round_robin", "walk")
    with pytest.raises(SystemExit):
        _parse("--routing", "random")


def test_ring_flags_and_engine_weights() -> None:
    args = _parse(
        "--engine", "e2=http://127.0.0.1:9001", "--engine-weight", "e2=2.5",
        "--vnodes", "64", "--eps", "0.5", "--prefix-chars", "128",
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.vnodes, cfg.eps, cfg.prefix_chars) == (64, 0.5, 128)
    assert {e.id: e.weight for e in cfg.engines} == {"e1": 1.0, "e2": 2.5}


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--engine-weight", "e1=0"], "ID=W with W > 0"),
        (["--engine-weight", "e1=heavy"], "ID=W with W > 0"),
        (["--engine-weight", "nope=2"], "names no --engine"),
        (["--vnodes", "0"], r"--vnodes \(TOKENRELAY_VNODES\) must be >= 1, got 0"),
        (["--eps", "-1"], r"--eps \(TOKENRELAY_EPS\) must be >= 0, got -1"),
    ],
)
def test_bad_ring_flags_are_refused_with_a_reason(flags: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        config_from_args(_parse(*flags))


def test_token_and_limit_flags_become_the_config_and_bad_values_are_refused() -> None:
    cfg = config_from_args(
        _parse("--default-max-tokens", "64", "--max-tokens-limit", "128",
               "--max-reply-bytes", "4096", "--session-rate", "0.5", "--session-burst", "3",
               "--turns-per-minute", "0", "--trusted-proxy", "10.0.0.0/8")
    )  # fmt: skip
    assert (cfg.default_max_tokens, cfg.max_tokens_limit, cfg.max_reply_bytes) == (64, 128, 4096)
    assert (cfg.session_rate_per_s, cfg.session_burst, cfg.turns_per_minute) == (0.5, 3, 0)
    assert cfg.trusted_proxies == "10.0.0.0/8"
    assert (cfg.secret, cfg.insecure_no_auth) == ("", True)
    bad = [
        (("--default-max-tokens", "9000"), "--default-max-tokens"),
        (("--default-max-tokens", "0"), "--default-max-tokens"),
        (("--max-reply-bytes", "10"), "--max-reply-bytes"),
        (("--session-burst", "0"), "--session-burst"),
        (("--turns-per-minute", "-1"), "--turns-per-minute"),
        (("--trusted-proxy", "not-an-address"), "not-an-address"),
    ]
    for flags, why in bad:
        with pytest.raises(ValueError, match=why):
            config_from_args(_parse(*flags))


def test_the_retention_settings_are_the_ones_relays_share() -> None:
    cfg = config_from_args(_parse())
    assert (cfg.backlog_maxlen, cfg.session_ttl_s) == (BACKLOG_MAXLEN, SESSION_TTL_S)
    assert cfg.max_token_ttl_s == cfg.token_ttl_s == SESSION_TTL_S
    cfg = config_from_args(_parse("--backlog-maxlen", "500", "--session-ttl-s", "600"))
    assert (cfg.backlog_maxlen, cfg.session_ttl_s) == (500, 600)
    with pytest.raises(ValueError, match=r"--backlog-maxlen \(TOKENRELAY_BACKLOG_MAXLEN\) must"):
        config_from_args(_parse("--backlog-maxlen", "10"))


def test_the_derived_policies_come_from_the_declared_fields() -> None:
    cfg = config_from_args(
        _parse("--coalesce-tokens", "3", "--coalesce-ms", "20", "--presence-grace-s", "4")
    )
    assert cfg.coalesce == CoalescePolicy(max_tokens=3, max_delay_s=0.02)
    assert cfg.presence == PresencePolicy(grace_s=4.0, interval_s=cfg.presence_interval_s)
    assert WorkerConfig().worker_id  # a config built in code gets a worker id too


def test_precise_routing_takes_each_engines_kv_events_endpoint() -> None:
    cfg = config_from_args(
        _parse("--routing", "precise", "--engine-kv-events", "e1=tcp://127.0.0.1:5557",
               "--kv-block-size", "32")
    )  # fmt: skip
    (src,) = cfg.kv_event_sources
    assert (src.engine, src.endpoint, src.replay) == (
        "e1",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    assert cfg.kv_block_size == 32


def test_precise_routing_takes_any_model() -> None:
    # the served model's tokenizer is asked of the engines (worker/engines/tokenizer.py),
    # where only the mock's was known and every other model was refused
    cfg = config_from_args(_parse("--routing", "precise", "--model", "Qwen/Qwen3-32B"))
    assert (cfg.routing, cfg.model) == ("precise", "Qwen/Qwen3-32B")


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--engine-kv-events", "e1=tcp://127.0.0.1:5557"], "needs --routing precise"),
        (["--routing", "precise", "--engine-kv-events", "tcp://h:1"], "ID=tcp://HOST:PORT"),
        (["--routing", "precise", "--engine-kv-events", "e1=http://h:1"], "tcp://HOST:PORT"),
        (
            ["--routing", "precise", "--engine-kv-events", "e1=tcp://h:1",
             "--engine-kv-events", "e1=tcp://h:3"],
            "names an engine twice",
        ),
    ],
)  # fmt: skip
def test_bad_kv_events_flags_are_refused_with_a_reason(flags: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        config_from_args(_parse(*flags))
