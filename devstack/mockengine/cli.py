"""The ``python -m devstack engine`` subcommand: run one mock inference engine.

``register(subparsers)`` adds the parser (:mod:`devstack.cli` calls it), whose default
``func`` (``run``) takes the parsed arguments.
``run`` reads :class:`EngineSettings` (flags over ``TOKENRELAY_*`` environment over
defaults, see :mod:`relay.service.settings`), builds an ``EngineConfig`` and serves the
engine on uvloop (plain asyncio where uvloop is missing) until SIGTERM or SIGINT.
With ``--redis`` the engine announces itself to workers with expiring heartbeats: a
supervised loop (:class:`relay.service.supervise.Supervisor`) that retries with backoff
while Redis is away and withdraws the announcement on a clean stop.
``python -m devstack.mockengine.cli --port P ...`` does the same without the subcommand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import EngineConfig, start_engine
from relay.broker.rediscluster.connect import RedisTLS, connect
from relay.service import runtime, settings
from relay.service.settings import ConfigError, Host, RedisCA, RedisCert, RedisKey, opt
from relay.service.supervise import Supervisor

__all__ = ["EngineSettings", "config_from_args", "main", "register", "run", "serve"]

_D = EngineConfig()
_R = ReplyLength()


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The mock engine's flags and environment, declared once."""

    port: Annotated[int, opt("TCP port (0 picks a free one)", ge=0, le=65535, required=True)] = 0
    host: Host = _D.host
    kv_tokens: Annotated[int, opt("prefix-cache capacity in tokens", ge=0)] = _D.kv_tokens
    prefill_tok_per_s: Annotated[
        float, opt("prefill rate of uncached prompt tokens; 0: instantaneous", ge=0)
    ] = _D.prefill_tok_per_s
    decode_tok_per_s: Annotated[
        float, opt("tokens streamed per second; 0: instantaneous", ge=0)
    ] = _D.decode_tok_per_s
    max_concurrency: Annotated[int, opt("requests generating at once", ge=1)] = _D.max_concurrency
    engine_id: Annotated[str, opt("engine id (empty: mock-PORT)", flag="--id")] = ""
    model: Annotated[str, opt("model name served")] = _D.model
    reply_mean_tokens: Annotated[
        float, opt("mean natural reply length, log-normal per prompt", gt=0)
    ] = _R.mean
    reply_max_tokens: Annotated[int, opt("longest natural reply, the tail's end", ge=1)] = (
        _R.max_tokens
    )
    reply_min_tokens: Annotated[int, opt("shortest natural reply", ge=1)] = _R.min_tokens
    reply_sigma: Annotated[
        float, opt("spread of the log-normal (0: every reply the mean)", ge=0)
    ] = _R.sigma
    report: Annotated[
        str,
        opt(
            "where the request's tokens are reported: first (headers, first chunk), last "
            "(the final usage chunk only, as vLLM), llamacpp (llama-server's timings)",
            choices=("first", "last", "llamacpp"),
        ),
    ] = _D.report
    n_ctx: Annotated[
        int, opt("context size in tokens; a longer prompt gets llama-server's 400 (0: none)", ge=0)
    ] = _D.n_ctx
    # Its own variable: the processes beside an engine (compose, the demo) have
    # TOKENRELAY_REDIS_URL set, and an engine must announce itself only when asked to.
    redis_url: Annotated[
        str,
        opt(
            "announce this engine to workers (tr:engines heartbeats) on this cluster",
            flag="--redis",
            env="TOKENRELAY_ANNOUNCE_REDIS_URL",
        ),
    ] = ""
    redis_ca: RedisCA = ""
    redis_cert: RedisCert = ""
    redis_key: RedisKey = ""
    announce_url: Annotated[str, opt("URL workers should use (empty: http://HOST:PORT)")] = ""
    cap: Annotated[
        int,
        opt("announced in-flight cap (0: --max-concurrency)", ge=0, env="TOKENRELAY_ENGINE_CAP"),
    ] = 0
    kv_events_port: Annotated[
        int,
        opt(
            "publish vLLM's KV-cache events on this ZeroMQ PUB port of --host (vLLM's "
            "default 5557; 0: off)",
            ge=0,
            le=65535,
        ),
    ] = 0
    kv_events_replay_port: Annotated[
        int,
        opt("the replay (ROUTER) port of the KV events (0: --kv-events-port + 1)", ge=0, le=65535),
    ] = 0

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    def validate(self) -> EngineSettings:
        if self.reply_min_tokens > self.reply_max_tokens:
            raise ConfigError("need --reply-min-tokens <= --reply-max-tokens")
        if self.redis_url:
            settings.check_redis(self.redis_url, self.redis_tls)
            if self.port == 0 and not self.announce_url:
                raise ConfigError("--redis needs a fixed --port (or --announce-url)")
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            port=self.port,
            host=self.host,
            kv_tokens=self.kv_tokens,
            prefill_tok_per_s=self.prefill_tok_per_s,
            decode_tok_per_s=self.decode_tok_per_s,
            max_concurrency=self.max_concurrency,
            engine_id=self.engine_id or f"mock-{self.port}",
            model=self.model,
            report=self.report,
            n_ctx=self.n_ctx,
            kv_events_port=self.kv_events_port or None,
            kv_events_replay_port=self.kv_events_replay_port or None,
            reply=ReplyLength(
                mean=self.reply_mean_tokens,
                max_tokens=self.reply_max_tokens,
                min_tokens=self.reply_min_tokens,
                sigma=self.reply_sigma,
            ),
        )


def register(subparsers: Any) -> None:
    """Add ``engine`` to the ``tokenrelay`` subcommands."""
    p = subparsers.add_parser(
        "engine",
        help="run a mock OpenAI-compatible engine with a simulated prefix cache",
        description="A GPU-free stand-in for vLLM/SGLang: streams deterministic text, "
        "simulates prefill of uncached prompt tokens and an LRU prefix cache, and serves "
        "vLLM-style /metrics. " + settings.ENV_NOTE,
    )
    settings.add_arguments(p, EngineSettings)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from flags and environment; ValueError (one line) if refused."""
    return settings.load(EngineSettings, args).engine_config()


async def serve(opts: EngineSettings) -> None:
    """Run the engine until SIGTERM/SIGINT; with ``--redis``, announce it meanwhile
    (withdrawn on a clean stop; after a crash the heartbeat expires by itself)."""
    from worker.routing.control import EngineAnnouncer
    from worker.routing.lease import EngineSpec

    cfg = opts.engine_config()
    async with runtime.stop_on_signals() as stop:
        running = await start_engine(cfg)
        print(f"mock engine {cfg.engine_id} listening on {running.url}", flush=True)
        if running.engine.kv_events is not None:
            kv = running.engine.kv_events
            print(f"kv events on {kv.endpoint} (replay {kv.replay_endpoint})", flush=True)
        loops = Supervisor(running.engine.metrics.registry)
        announcer = None
        if opts.redis_url:
            url = opts.announce_url or f"http://{cfg.host}:{running.port}"
            spec = EngineSpec(id=cfg.engine_id, url=url, cap=opts.cap or cfg.max_concurrency)
            announcer = EngineAnnouncer(connect(opts.redis_url, tls=opts.redis_tls), spec)
            # critical=False: an engine serves requests whether or not Redis is up
            loops.every("engine-announce", announcer.ttl_s / 3, announcer.beat, critical=False)
        try:
            await stop.wait()
        finally:
            await loops.stop()
            if announcer is not None:
                await announcer.stop(withdraw=True)
                await announcer.redis.aclose()
            await running.stop()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    try:
        opts = settings.load(EngineSettings, args)
        opts.engine_config()  # ValueError for what only the config can tell
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runtime.run(serve(opts))
    except OSError as exc:  # binding the port: one line, never a traceback
        print(f"error: {runtime.listen_error(opts.host, opts.port, exc)}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone ``python -m devstack.mockengine.cli`` (the same as ``python -m devstack
    engine``)."""
    parser = argparse.ArgumentParser(prog="python -m devstack.mockengine.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
