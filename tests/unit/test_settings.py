"""The one configuration model (relay.service.settings): a declaration gives the flag,
the environment variable, the help and the checks, for every process alike."""

from __future__ import annotations

import argparse
from typing import Annotated, ClassVar, TypeVar

import msgspec
import pytest

from devstack.demo.cli import DemoSettings
from devstack.mockengine.cli import EngineSettings
from relay.edge.config import RelayConfig
from relay.service import settings
from relay.service.settings import ConfigError, FailFast, Secret, opt
from tokenrelay.cli import build_parser
from worker.config import WorkerConfig
from worker.jobs.cli import JobWorkerSettings

K = "settings-test-secret-7c1e9a3f5b2d4e6a8c0f"  # strong: >= 32 bytes, varied


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    port: Annotated[int, opt("a port", ge=0, le=65535)] = 8080
    ratio: Annotated[float, opt("a ratio", gt=0, lt=1)] = 0.5
    name: Annotated[str, opt("a name", flag="--called")] = "x"
    keys: Annotated[tuple[str, ...], opt("repeatable", flag="--key")] = ()
    exchange: Annotated[bool, opt("on unless told", flag="--no-exchange")] = True
    fail_fast: FailFast = False
    mode: Annotated[str, opt("a choice", choices=("a", "b"))] = "a"
    secret: Secret = ""
    hidden: Annotated[str, opt("from the environment only", env_only=True)] = ""
    plain: int = 3  # not a setting: no flag, no variable


class Prefixed(msgspec.Struct, frozen=True, kw_only=True):
    env_prefix: ClassVar[str] = "TOKENRELAY_DEMO_"
    port: Annotated[int, opt("a port")] = 1
    shared: Annotated[str, opt("a shared one", env="TOKENRELAY_SHARED")] = ""


class Needs(msgspec.Struct, frozen=True, kw_only=True):
    port: Annotated[int, opt("a port", required=True)] = 0


S = TypeVar("S", bound=msgspec.Struct)


def parse(cls: type[S], argv: list[str], env: dict[str, str]) -> S:
    p = argparse.ArgumentParser()
    settings.add_arguments(p, cls)
    return settings.load(cls, p.parse_args(argv), env)


def test_defaults_then_environment_then_flags() -> None:
    assert parse(Sample, [], {}) == Sample()
    env = {
        "TOKENRELAY_PORT": "9000", "TOKENRELAY_RATIO": "0.25", "TOKENRELAY_NAME": "env",
        "TOKENRELAY_KEYS": "k1, k2,", "TOKENRELAY_EXCHANGE": "off",
        "TOKENRELAY_FAIL_FAST": "yes", "TOKENRELAY_MODE": "b", "TOKENRELAY_HIDDEN": "h",
        "TOKENRELAY_PLAIN": "99",
    }  # fmt: skip
    from_env = parse(Sample, [], env)
    assert from_env == Sample(port=9000, ratio=0.25, name="env", keys=("k1", "k2"),
                              exchange=False, fail_fast=True, mode="b", hidden="h")  # fmt: skip
    argv = ["--port", "9001", "--ratio", "0.75", "--called", "flag", "--key", "f1",
            "--key", "f2", "--no-exchange", "--fail-fast", "--mode", "a"]  # fmt: skip
    both = parse(Sample, argv, {**env, "TOKENRELAY_EXCHANGE": "on", "TOKENRELAY_FAIL_FAST": "0"})
    assert both == Sample(port=9001, ratio=0.75, name="flag", keys=("f1", "f2"),
                          exchange=False, fail_fast=True, mode="a", hidden="h")  # fmt: skip


def test_env_names_prefixes_and_flagless_fields() -> None:
    names = settings.env_names(Sample)
    assert names["name"] == "TOKENRELAY_NAME"  # the variable follows the field, not the flag
    assert "plain" not in names
    assert settings.env_names(Prefixed) == {
        "port": "TOKENRELAY_DEMO_PORT",
        "shared": "TOKENRELAY_SHARED",
    }
    p = argparse.ArgumentParser()
    settings.add_arguments(p, Sample)
    with pytest.raises(SystemExit):
        p.parse_args(["--hidden", "x"])  # env_only: no flag, never visible in ps
    assert "TOKENRELAY_PORT" in p.format_help()


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"TOKENRELAY_PORT": "eighty"}, "TOKENRELAY_PORT='eighty': expected int"),
        ([], {"TOKENRELAY_FAIL_FAST": "maybe"}, "TOKENRELAY_FAIL_FAST='maybe': expected true"),
        (["--port", "70000"], {}, r"--port \(TOKENRELAY_PORT\) must be <= 65535, got 70000"),
        ([], {"TOKENRELAY_RATIO": "1"}, r"--ratio \(TOKENRELAY_RATIO\) must be < 1, got 1"),
        ([], {"TOKENRELAY_MODE": "c"}, r"--mode \(TOKENRELAY_MODE\) must be one of a, b"),
    ],
)
def test_a_bad_value_is_one_line_naming_flag_and_variable(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse(Sample, argv, env)
    assert "\n" not in str(info.value)


def test_a_required_setting_comes_from_the_flag_or_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"give --port \(or set TOKENRELAY_PORT\)"):
        parse(Needs, [], {})
    assert parse(Needs, [], {"TOKENRELAY_PORT": "0"}) == Needs(port=0)  # 0 is a value


@pytest.mark.parametrize(
    ("secret", "insecure", "refusal"),
    [
        ("", False, "no token secret"),
        (K, True, "choose one"),
        ("short", False, "at least 32"),
        ("change-me-in-production-0123456789abcdef", False, "example"),
    ],
)
def test_every_process_that_takes_tokens_has_the_same_auth_rule(
    secret: str, insecure: bool, refusal: str
) -> None:
    with pytest.raises(ConfigError, match=refusal):
        settings.check_auth(secret, "k1", "", insecure)
    env = {"TOKENRELAY_SECRET": secret} if secret else {}
    if insecure:
        env["TOKENRELAY_INSECURE_NO_AUTH"] = "1"
    worker_env = {**env, "TOKENRELAY_REDIS_URL": "redis://127.0.0.1:7000", "TOKENRELAY_PORT": "0",
                  "TOKENRELAY_ENGINES": "http://127.0.0.1:9000"}  # fmt: skip
    with pytest.raises(ConfigError, match=refusal):
        parse(RelayConfig, [], env)
    with pytest.raises(ConfigError, match=refusal):
        parse(WorkerConfig, [], worker_env)


def test_auth_off_only_when_said_and_a_safe_secret_is_accepted() -> None:
    assert settings.check_auth("", "k1", "", True) is None
    keys = settings.check_auth(K, "k1", "", False)
    assert keys is not None
    assert keys.signing is not None
    assert keys.signing.kid == "k1"
    assert len(parse(DemoSettings, [], {}).secret) >= 32  # random per run
    with pytest.raises(ConfigError, match="choose one"):
        parse(DemoSettings, ["--insecure-no-auth"], {"TOKENRELAY_SECRET": K})


def test_relay_and_worker_declare_fail_fast_off_by_default() -> None:
    assert parse(RelayConfig, [], {"TOKENRELAY_SECRET": K}).fail_fast is False
    env = {"TOKENRELAY_SECRET": K, "TOKENRELAY_FAIL_FAST": "true"}
    assert parse(RelayConfig, [], env).fail_fast is True
    worker_env = {
        "TOKENRELAY_SECRET": K,
        "TOKENRELAY_REDIS_URL": "redis://127.0.0.1:7000",
        "TOKENRELAY_ENGINES": "e1=http://127.0.0.1:9000,e2=http://127.0.0.1:9001",
    }
    cfg = parse(WorkerConfig, ["--port", "0", "--fail-fast"], worker_env)
    assert cfg.fail_fast is True
    assert [e.id for e in cfg.engines] == ["e1", "e2"]


def test_every_process_reads_the_deployments_variables() -> None:
    """The names docker-compose.yml, deploy/k8s and the Makefile set keep working."""
    relay = settings.env_names(RelayConfig)
    worker = settings.env_names(WorkerConfig)
    jobs = settings.env_names(JobWorkerSettings)
    engine = settings.env_names(EngineSettings)
    for name in ("TOKENRELAY_REDIS_URL", "TOKENRELAY_SECRET", "TOKENRELAY_KID",
                 "TOKENRELAY_KEYS_FILE", "TOKENRELAY_INSECURE_NO_AUTH",
                 "TOKENRELAY_TRUSTED_PROXIES", "TOKENRELAY_REDIS_CA", "TOKENRELAY_REDIS_CERT",
                 "TOKENRELAY_REDIS_KEY", "TOKENRELAY_FAIL_FAST"):  # fmt: skip
        assert name in relay.values(), name
        assert name in worker.values(), name
    assert {"TOKENRELAY_HOST", "TOKENRELAY_PORT", "TOKENRELAY_RELAY_ID",
            "TOKENRELAY_DRAIN_DEADLINE_S"} <= set(relay.values())  # fmt: skip
    assert {"TOKENRELAY_AMQP_URL", "TOKENRELAY_GATEWAY_KEYS", "TOKENRELAY_MODEL",
            "TOKENRELAY_ENGINE_CAP", "TOKENRELAY_SHUTDOWN_DEADLINE_S"} <= set(
        worker.values())  # fmt: skip
    assert {"TOKENRELAY_REDIS_URL", "TOKENRELAY_AMQP_URL"} <= set(jobs.values())
    # an engine announces itself only when asked: not from the TOKENRELAY_REDIS_URL that
    # compose gives every service
    assert engine["redis_url"] == "TOKENRELAY_ANNOUNCE_REDIS_URL"


def test_gateway_keys_from_the_environment_are_comma_separated() -> None:
    env = {"TOKENRELAY_GATEWAY_KEYS": "gateway-key-one-0001,gateway-key-two-0002"}
    args = build_parser().parse_args(
        ["worker", "--port", "0", "--redis", "redis://127.0.0.1:7000", "--insecure-no-auth",
         "--engine", "http://127.0.0.1:9000"]
    )  # fmt: skip
    cfg = settings.load(WorkerConfig, args, env)
    assert cfg.gateway_keys == ("gateway-key-one-0001", "gateway-key-two-0002")
    with pytest.raises(ConfigError, match="at least 16"):
        settings.load(WorkerConfig, args, {"TOKENRELAY_GATEWAY_KEYS": "short"})
