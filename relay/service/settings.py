"""One configuration model for every process: each setting declared once, flags and
environment generated from the declaration, the same rules everywhere.

A process's settings are a frozen ``msgspec.Struct`` whose fields are annotated with
:func:`opt`::

    class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
        port: Annotated[int, opt("TCP port (0 picks a free one)", ge=0, le=65535)] = 0
        redis_url: RedisURL = ""            # a shared declaration (below)

One declaration per field gives its type, default (the struct's), help text, flag
(``--port``; ``flag=`` for another name) and environment variable (``TOKENRELAY_PORT``;
``env=`` for another name, a class attribute ``env_prefix: ClassVar[str]`` for another
prefix), bounds (``ge``/``gt``/``le``/``lt``), choices, whether it is required, and
``env_only=True`` for a value that must never be on a command line. Then:

- :func:`add_arguments` adds one flag per field (every default None, so an absent flag
  falls back to the environment); a ``bool`` field is a switch that sets the opposite of
  its default, a ``tuple[str, ...]`` field a repeatable flag (comma-separated in the
  environment);
- :func:`load` merges **flag > environment > default**, converts the environment's text
  (naming the variable when it cannot), builds the struct and :func:`check`\\s it: bounds,
  choices and required fields, then the struct's own ``validate()`` if it has one (the
  relations between fields), which returns the final value;
- :func:`check_auth` is the one rule of every process that takes tokens: no start
  without a safe secret (or key file) unless ``--insecure-no-auth`` says so, never both;
- every refusal is a :class:`ConfigError` whose message is one line naming the flag and
  its variable; the commands print ``error: <message>`` and exit 2.

Shared declarations (``RedisURL``, ``Secret``, ``FailFast``, ...) keep a setting that
several processes take (the Redis URL, the token secret) declared once.

Why msgspec (measured on the project's machine, Python 3.11, best of five runs of
``python -X importtime -c 'import M'``, cumulative microseconds of ``M``)::

    msgspec              26,100 us    (5,600 us after aiohttp, redis and prometheus_client)
    pydantic_settings   218,100 us  (150,100 us after the same; pulls pydantic + pydantic-core,
                                     about 10 MB installed, against 0.7 MB for msgspec)
    dataclasses          10,200 us      (900 us after the same)

msgspec is already a dependency that every process imports (``relay.protocol.frame``),
so the model costs no import time at all; pydantic-settings would add about 0.15-0.2 s
to every start and a second validation library. Its generated CLI would also not keep
the flag names the deployments use (``--redis`` for ``redis_url``, ``--keys``,
``--trusted-proxy``, repeatable ``--engine``), so aliases would be needed field by field
anyway; the generator here is this module (about 250 lines). Plain dataclasses would
do the same at the same size, but the relay's config was already a frozen msgspec struct
(``msgspec.structs.replace`` and its users stay as they are).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeVar

import msgspec

from relay.broker.rediscluster.connect import RedisTLS
from relay.protocol.auth import KeySet, WeakSecret, load_keys
from relay.protocol.frame import MAX_FRAME_BYTES
from relay.service.admin import admin_key

__all__ = [
    "ENV_NOTE",
    "PREFIX",
    "AdminKey",
    "BacklogMaxBytes",
    "BacklogMaxlen",
    "BodyTimeout",
    "ConfigError",
    "CorsOrigin",
    "FailFast",
    "HeadTimeout",
    "Host",
    "IPv6Prefix",
    "InsecureNoAuth",
    "KeepaliveTimeout",
    "KeysFile",
    "Kid",
    "MaxConnectionsPerAddress",
    "RedisCA",
    "RedisCert",
    "RedisKey",
    "RedisURL",
    "Secret",
    "SessionTTL",
    "Setting",
    "TrustedProxies",
    "add_arguments",
    "check",
    "check_admin_key",
    "check_auth",
    "check_fields",
    "check_redis",
    "env_names",
    "load",
    "opt",
    "require_extra",
    "settings_of",
]

PREFIX: Final = "TOKENRELAY_"
# for a command's description
ENV_NOTE: Final = (
    "Each flag's environment variable is named in its help: a flag wins over the "
    "environment, the environment over the default."
)
_TRUE: Final = frozenset(("1", "true", "yes", "on"))
_FALSE: Final = frozenset(("0", "false", "no", "off", ""))

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A configuration a process refuses to start with; the message (one line) says why."""


def opt(
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[str] | None = None,
    required: bool = False,
    metavar: str | None = None,
    env_only: bool = False,
) -> msgspec.Meta:
    """The declaration of one setting, for ``Annotated[type, opt(...)]``."""
    extra = {"flag": flag, "env": env, "ge": ge, "gt": gt, "le": le, "lt": lt,
             "choices": tuple(choices) if choices else None, "required": required,
             "metavar": metavar, "env_only": env_only}  # fmt: skip
    return msgspec.Meta(description=help, extra=extra)


@dataclass(frozen=True, slots=True)
class Setting:
    """One declared field, as :func:`settings_of` reads it from the annotations."""

    name: str
    kind: type  # str, int, float, bool, or tuple (of str)
    default: Any
    help: str
    flag: str
    env: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    metavar: str | None = None
    env_only: bool = False  # no flag (a secret that must not show in ps)

    @property
    def names(self) -> str:
        """How a message names it: ``--port (TOKENRELAY_PORT)``."""
        return f"{self.flag} ({self.env})"


@functools.cache
def settings_of(cls: type[msgspec.Struct]) -> tuple[Setting, ...]:
    """The declared fields of ``cls`` (those annotated with :func:`opt`), in order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    prefix = getattr(cls, "env_prefix", PREFIX)
    out = []
    for f in msgspec.structs.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *metas = typing.get_args(hint)
        meta = next((m for m in metas if isinstance(m, msgspec.Meta)), None)
        if meta is None or meta.extra is None:
            continue
        kind = tuple if typing.get_origin(base) is tuple else base
        if kind not in (str, int, float, bool, tuple):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported setting type {base!r}")
        x = meta.extra
        default = f.default if f.default is not msgspec.NODEFAULT else None
        out.append(
            Setting(
                name=f.name,
                kind=kind,
                default=default,
                help=meta.description or "",
                flag=x["flag"] or "--" + f.name.replace("_", "-"),
                env=x["env"] or prefix + f.name.upper(),
                ge=x["ge"],
                gt=x["gt"],
                le=x["le"],
                lt=x["lt"],
                choices=x["choices"],
                required=x["required"],
                metavar=x["metavar"],
                env_only=x["env_only"],
            )
        )
    return tuple(out)


def env_names(cls: type[msgspec.Struct]) -> dict[str, str]:
    """Field name -> environment variable, for every declared field of ``cls``."""
    return {s.name: s.env for s in settings_of(cls)}


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return str(value) if value != "" else "none"


def add_arguments(parser: argparse.ArgumentParser, cls: type[msgspec.Struct]) -> None:
    """One flag per declared field of ``cls``; see the module docstring."""
    for s in settings_of(cls):
        if s.env_only:
            continue
        env = f"env {s.env}"
        if s.required:
            where = "required"
        elif s.kind is bool:  # a switch sets the opposite of the default
            where, env = "a switch", f"env {s.env}={str(not s.default).lower()}"
        else:
            where = f"default {_shown(s.default)}"
        text = f"{s.help} ({where}; {env})" if s.help else f"({where}; {env})"
        kw: dict[str, Any] = {"dest": s.name, "default": None, "help": text}
        if s.kind is bool:
            kw.update(action="store_const", const=not s.default)
        elif s.kind is tuple:
            kw.update(action="append", metavar=s.metavar)
        else:
            kw.update(type=s.kind, choices=s.choices, metavar=s.metavar)
        parser.add_argument(s.flag, **kw)


def _from_env(s: Setting, text: str) -> Any:
    if s.kind is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{s.env}={text!r}: expected true or false")
    if s.kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    try:
        return s.kind(text)
    except ValueError:
        raise ConfigError(f"{s.env}={text!r}: expected {s.kind.__name__}") from None


def load(cls: type[S], args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> S:
    """Flag > environment (``os.environ`` unless given) > default; then :func:`check`."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in settings_of(cls):
        flag = getattr(args, s.name, None)
        if flag is not None:
            values[s.name] = tuple(flag) if s.kind is tuple else flag
        elif s.env in env:
            values[s.name] = _from_env(s, env[s.env])
        elif s.required:
            raise ConfigError(f"give {s.flag} (or set {s.env})")
    return check(cls(**values))


def _bound_error(s: Setting, value: float) -> str | None:
    tests = (("ge", s.ge, value >= (s.ge or 0)), ("gt", s.gt, value > (s.gt or 0)),
             ("le", s.le, value <= (s.le or 0)), ("lt", s.lt, value < (s.lt or 0)))  # fmt: skip
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    failed = [f"{words[k]} {bound:g}" for k, bound, ok in tests if bound is not None and not ok]
    return " and ".join(failed) or None


def check_fields(obj: msgspec.Struct) -> None:
    """Required fields given, numbers within their bounds, choices respected."""
    for s in settings_of(type(obj)):
        value = getattr(obj, s.name)
        if s.required and s.kind in (str, tuple) and not value:
            raise ConfigError(f"give {s.flag} (or set {s.env})")
        if s.kind in (int, float) and not isinstance(value, bool):
            bad = _bound_error(s, value)
            if bad:
                raise ConfigError(f"{s.names} must be {bad}, got {_shown(value)}")
        if s.choices and value not in s.choices:
            raise ConfigError(f"{s.names} must be one of {', '.join(s.choices)}, got {value!r}")


def check(obj: S) -> S:
    """:func:`check_fields`, then the struct's ``validate()`` (if it has one: the rules
    between fields), whose return value is the result."""
    check_fields(obj)
    validate = getattr(obj, "validate", None)
    return validate() if callable(validate) else obj


def check_auth(secret: str, kid: str, keys_file: str, insecure_no_auth: bool) -> KeySet | None:
    """The rule of every process that takes tokens: a safe secret (or a key file), or
    ``--insecure-no-auth`` said explicitly, never both. Returns the key set (None when
    auth is off); :class:`ConfigError` for a missing, weak or example secret or an
    unreadable key file."""
    if insecure_no_auth and (secret or keys_file):
        raise ConfigError(
            "a token secret and --insecure-no-auth (TOKENRELAY_INSECURE_NO_AUTH) are both "
            "set: choose one"
        )
    if insecure_no_auth:
        return None
    if not secret and not keys_file:
        raise ConfigError(
            "no token secret: set TOKENRELAY_SECRET (or --keys FILE), "
            "or --insecure-no-auth for local experiments"
        )
    try:
        return load_keys(secret or None, kid, keys_file or None)
    except WeakSecret as exc:
        raise ConfigError(str(exc)) from None


def check_admin_key(text: str) -> bytes | None:
    """The admin key as bytes (None: unset); :class:`ConfigError` naming the setting when
    it is weak."""
    try:
        return admin_key(text)
    except ValueError as exc:
        raise ConfigError(f"--admin-key (TOKENRELAY_ADMIN_KEY): {exc}") from None


def check_redis(url: str, tls: RedisTLS) -> None:
    """The Redis URL's scheme and the TLS files, as every process checks them."""
    if not url:
        raise ConfigError("give --redis (or set TOKENRELAY_REDIS_URL)")
    try:
        tls.check(url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def require_extra(module: str, extra: str, what: str) -> None:
    """:class:`ConfigError` naming the extra (``pip install 'tokenrelay[EXTRA]'``) when
    ``module``, which ``what`` (a flag, a subcommand) needs, cannot be imported: an edge
    install leaves the optional dependencies out (pyproject.toml's extras)."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{what} needs the {extra} extra: pip install 'tokenrelay[{extra}]'"
        ) from None


# -- shared declarations: a setting several processes take, declared once ----------------

Host = Annotated[str, opt("address to bind")]
RedisURL = Annotated[str, opt("a Redis Cluster node URL, rediss:// for TLS", flag="--redis")]
RedisCA = Annotated[
    str, opt("rediss://: CA bundle (PEM) of the servers' certificates (empty: system store)")
]
RedisCert = Annotated[str, opt("rediss://: client certificate (PEM), with --redis-key")]
RedisKey = Annotated[str, opt("rediss://: the client certificate's private key (PEM)")]
Secret = Annotated[
    str,
    opt(
        "HS256 secret of session tokens, >= 32 bytes; prefer the environment variable "
        "(a flag is visible in ps)"
    ),
]
Kid = Annotated[str, opt("id of the key tokens are signed with")]
KeysFile = Annotated[
    str, opt("JWK Set file: previous HS256 secrets (rotation), ES256/RS256 keys", flag="--keys")
]
AdminKey = Annotated[
    str,
    opt(
        "Bearer key (>= 32 bytes) of the operator's endpoints (/metrics, the worker's "
        "/v1/router); unset: they answer local requests only. Prefer the environment "
        "variable (a flag is visible in ps)"
    ),
]
InsecureNoAuth = Annotated[
    bool, opt("accept every request without a token (local experiments only)")
]
TrustedProxies = Annotated[
    str,
    opt(
        "addresses / CIDRs (comma-separated) whose X-Forwarded-For names the client",
        flag="--trusted-proxy",
    ),
]
IPv6Prefix = Annotated[
    int,
    opt(
        "per-address limits count an IPv6 client as its network of this prefix length "
        "(64: one subscriber's block; 128: each address)",
        ge=16,
        le=128,
    ),
]
FailFast = Annotated[
    bool,
    opt(
        "exit 1 at once when Redis cannot be reached at start, instead of retrying "
        "(not ready) until it can"
    ),
]
BacklogMaxlen = Annotated[
    int, opt("frames a session's backlog keeps (relays and workers must agree)", ge=100)
]
BacklogMaxBytes = Annotated[
    int,
    opt(
        "bytes of frames a session's backlog keeps: the oldest go first, a resume past "
        "them gets a gap frame (relays and workers must agree; at least one largest frame)",
        ge=MAX_FRAME_BYTES,
    ),
]
SessionTTL = Annotated[
    int, opt("a session's lifetime in Redis after its last write, seconds (relays and "
             "workers must agree)", ge=1)
]  # fmt: skip
# the cross-origin routes' allowed origin (relay.service.cors)
CorsOrigin = Annotated[str, opt("Access-Control-Allow-Origin")]
# the HTTP guard of relay.service.httpguard: deadlines and the per-address cap
HeadTimeout = Annotated[
    float, opt("408 for a request head slower than this from its first byte (the first "
               "head of a connection: from its opening)", gt=0)
]  # fmt: skip
BodyTimeout = Annotated[float, opt("408 for a request body slower than this from its head", gt=0)]
KeepaliveTimeout = Annotated[
    float, opt("close a keep-alive connection idle this long after its last response "
               "(above a proxy's upstream keep-alive: ingress-nginx keeps them 60 s)", gt=0)
]  # fmt: skip
MaxConnectionsPerAddress = Annotated[
    int, opt("HTTP connections at once from one peer address, trusted proxies not counted; "
             "more get 429 and are closed; 0: no cap", ge=0)
]  # fmt: skip
