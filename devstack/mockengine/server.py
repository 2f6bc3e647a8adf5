"""Mock inference engine: an OpenAI-compatible streaming server with a simulated prefix cache.

Lets the whole stack run without a GPU. The simulation itself is pure and lives in
``devstack.mockengine.prefix_cache``; this module is the aiohttp I/O around it. Order of use:

1. ``EngineConfig(...)`` describes one engine (port, cache size, prefill/decode rates,
   concurrency limit, id).
2. ``make_app(cfg)`` builds the ``web.Application``; ``start_engine(cfg)`` also binds it
   (``port=0`` picks a free port) and returns a ``RunningEngine`` whose ``stop()`` shuts it
   down; ``run_engine(cfg)`` serves until SIGTERM/SIGINT.
3. Per ``POST /v1/chat/completions``: validate the body (400/413 with OpenAI-style error
   JSON), wait for a slot in a FIFO queue (``max_concurrency`` running at once), look up
   the cached prefix, send headers ``x-engine-id``, ``x-prefix-cache-hit-tokens``,
   ``x-prompt-tokens``, ``x-prefill-s``, sleep the prefill time of the *uncached* tokens,
   then stream one token per ``1/decode_tok_per_s`` seconds as OpenAI
   ``chat.completion.chunk`` SSE events (the first one also carries a non-standard
   ``"tokenrelay"`` object with the same metadata; reasoning and tool calls:
   ``devstack.mockengine.parts``), a final chunk with
   ``finish_reason``, an optional usage chunk (``stream_options.include_usage``), and
   ``data: [DONE]``. The prompt and reply blocks are then in the cache. The reply is a
   function of the prompt (the same prompt, the same reply), and of the request header
   ``X-Reply-Seed`` (an integer) when it is sent: the worker sends the turn number with
   a turn that regenerates another, so that a regenerate says something else, as a
   sampling engine would (a real engine ignores the header).
4. A client that disconnects aborts its request at once: the handler is cancelled
   (the server runs with ``handler_cancellation=True``), the slot is released and
   ``vllm:request_success_total{finished_reason="abort"}`` and
   ``tokenrelay_engine_aborted_requests_total`` count it.

``GET /metrics`` serves vLLM-style Prometheus metrics from a per-engine
``CollectorRegistry``; ``GET /health`` and ``GET /v1/models`` complete the surface.

With ``kv_events_port`` set (``python -m devstack engine --kv-events-port``), every change of the
prefix cache (a request's blocks stored after its prefill and after its reply, LRU
evictions) is published as vLLM's KV events (``devstack.mockengine.kvpub``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import generate_latest

from devstack.mockengine import parts as mp
from devstack.mockengine import prefix_cache as pc
from devstack.mockengine.kvpub import KVEventPublisher
from devstack.mockengine.metrics import EngineMetrics
from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.request import ChatRequest, RequestError, parse_chat, reply_seed
from relay.protocol import sse
from relay.service import runtime
from worker.engines.client import REPLY_SEED_HEADER

__all__ = [
    "ENGINE_KEY",
    "EngineConfig",
    "FifoGate",
    "MockEngine",
    "RunningEngine",
    "make_app",
    "run_engine",
    "start_engine",
]


@dataclass(slots=True)
class EngineConfig:
    """Options of one mock engine (rates are per second; 0 means instantaneous)."""

    port: int = 8000
    host: str = "127.0.0.1"
    kv_tokens: int = 65_536
    prefill_tok_per_s: float = 4_000.0
    decode_tok_per_s: float = 40.0
    max_concurrency: int = 8
    engine_id: str = "mock-0"
    model: str = "tokenrelay-mock"
    block_size: int = pc.DEFAULT_BLOCK_SIZE
    max_body_bytes: int = 1 << 20
    # KV events as vLLM publishes them (ZeroMQ PUB + replay ROUTER on ``host``):
    # None: off; 0: free ports; the replay port defaults to the next one
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    # natural reply lengths (tokens): log-normal, mean 300, tail to 2,000, per prompt
    reply: ReplyLength = field(default_factory=ReplyLength)
    # where it reports the request's tokens: "first" (headers and the first chunk's
    # "tokenrelay" field, and usage at the end), "last" (only the final usage chunk, as
    # vLLM and SGLang do), "llamacpp" (llama-server's "timings" in the finish chunk and
    # the usage chunk, no headers; its GET /props: max_concurrency slots, n_ctx; /slots)
    report: str = "first"
    # context size in tokens (prompt + max_tokens); a longer request is refused with
    # llama-server's error ("exceed_context_size_error"); 0: unbounded
    n_ctx: int = 0


class FifoGate:
    """Admission in strict arrival order: at most ``limit`` holders, the rest wait."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        # Hand the slot directly to the next waiter, so ``running`` never drops below
        # the number of admitted requests.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


@dataclass(slots=True)
class MockEngine:
    """The state of one engine: config, cache, admission gate, metrics."""

    cfg: EngineConfig
    cache: pc.PrefixCache = field(init=False)
    gate: FifoGate = field(init=False)
    metrics: EngineMetrics = field(init=False)
    kv_events: KVEventPublisher | None = None

    def __post_init__(self) -> None:
        record = self.cfg.kv_events_port is not None
        self.cache = pc.PrefixCache(self.cfg.kv_tokens, self.cfg.block_size, record_events=record)
        self.gate = FifoGate(self.cfg.max_concurrency)
        self.metrics = EngineMetrics(self.cfg.engine_id, self.cfg.model, self)


ENGINE_KEY = web.AppKey("tokenrelay_mock_engine", MockEngine)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _too_long(n_prompt: int, n_ctx: int) -> web.Response:
    """llama-server's answer to a prompt over its context (its type and fields)."""
    message = (
        f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
        "try increasing it"
    )
    body = {"error": {"code": 400, "message": message, "type": "exceed_context_size_error",
                      "n_prompt_tokens": n_prompt, "n_ctx": n_ctx}}  # fmt: skip
    return web.Response(status=400, body=orjson.dumps(body), content_type="application/json")


def _sse(obj: object) -> bytes:
    return sse.event(orjson.dumps(obj))


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    cfg = engine.cfg
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"request body larger than {cfg.max_body_bytes} bytes")
    try:
        req = parse_chat(raw, cfg.model, cfg.reply.max_tokens)
        seed = request.headers.get(REPLY_SEED_HEADER)
        if seed is not None:
            req = replace(req, seed=reply_seed(seed))
    except RequestError as exc:
        return _error(exc.status, exc.message, exc.param)

    finished = "abort"
    try:
        await engine.gate.acquire()
    except asyncio.CancelledError:
        engine.metrics.finished(finished)
        raise
    try:
        resp, finished = await _generate(request, engine, req)
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        finished = "abort"
        raise
    finally:
        engine.gate.release()
        engine.metrics.finished(finished)


async def _generate(
    request: web.Request, engine: MockEngine, req: ChatRequest
) -> tuple[web.StreamResponse, str]:
    cfg = engine.cfg
    tokens = pc.prompt_tokens(req.messages)
    if cfg.n_ctx and len(tokens) >= cfg.n_ctx:
        return _too_long(len(tokens), cfg.n_ctx), "error"
    cached = engine.cache.lookup(tokens)
    engine.metrics.queries.inc(len(tokens))
    engine.metrics.hits.inc(cached)
    engine.metrics.prompt_tokens.inc(len(tokens))
    prefill_s = pc.prefill_seconds(len(tokens) - cached, cfg.prefill_tok_per_s)
    natural = cfg.reply.length(tokens)
    pieces, finish = pc.reply_pieces(
        tokens, req.max_tokens, min_len=natural, max_len=natural, seed=req.seed
    )
    pieces, finish = mp.cut_at_stop(pieces, finish, req.body.get("stop"))
    todo = mp.plan(req.body, req.messages, tokens)  # reasoning and tool calls (no text)
    pieces, finish = ([], "tool_calls") if todo.calls else (pieces, finish)
    meta = {
        "engine_id": cfg.engine_id,
        "cached_tokens": cached,
        "prompt_tokens": len(tokens),
        "prefill_s": round(prefill_s, 6),
    }
    headers = {
        "x-engine-id": cfg.engine_id,
        "x-prefix-cache-hit-tokens": str(cached),
        "x-prompt-tokens": str(len(tokens)),
        "x-prefill-s": f"{prefill_s:.6f}",
    }
    if cfg.report != "first":
        headers = {}
    usage = {
        "prompt_tokens": len(tokens),
        "completion_tokens": len(pieces) + len(todo.reasoning),
        "total_tokens": len(tokens) + len(pieces) + len(todo.reasoning),
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    step = 1.0 / cfg.decode_tok_per_s if cfg.decode_tok_per_s > 0 else 0.0
    t0 = time.monotonic()

    if not req.stream:
        await _sleep_until(t0 + prefill_s + step * max(0, len(pieces) - 1))
        _finish_cache(engine, tokens, pieces)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": mp.message(pieces, todo),
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
            "tokenrelay": meta,
        }
        out = web.Response(
            body=orjson.dumps(body), headers=headers, content_type="application/json"
        )
        return out, finish

    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, object]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [choice],
        }

    try:
        await _sleep_until(t0 + prefill_s)
        _cache_insert(engine, tokens)  # the prompt's KV blocks exist once prefill is done
        first = chunk({"role": "assistant", "content": ""})
        if cfg.report == "first":
            first["tokenrelay"] = meta
        await resp.write(_sse(first))
        t_first = time.monotonic()
        for i, delta in enumerate(mp.deltas(pieces, todo)):
            await _sleep_until(t_first + i * step)
            await resp.write(_sse(chunk(delta)))
            engine.metrics.generation_tokens.inc()
        last = chunk({}, finish)
        timings = {
            "cache_n": cached,
            "prompt_n": len(tokens) - cached,
            "prompt_ms": round(prefill_s * 1000, 3),
            "predicted_n": len(pieces),
            "predicted_ms": round((time.monotonic() - t_first) * 1000, 3),
        }
        if cfg.report == "llamacpp":
            last["timings"] = timings
        await resp.write(_sse(last))
        if req.include_usage:
            tail = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": usage,
            }
            if cfg.report == "llamacpp":
                tail["timings"] = timings
            await resp.write(_sse(tail))
        await resp.write(sse.DONE)
        _finish_cache(engine, tokens, pieces)
        await resp.write_eof()
    except ConnectionResetError:  # the client left mid-stream: an abort, not a server error
        return resp, "abort"
    return resp, finish


def _finish_cache(engine: MockEngine, tokens: list[str], pieces: list[str]) -> None:
    _cache_insert(engine, tokens + pc.reply_tokens(pieces))


def _cache_insert(engine: MockEngine, tokens: list[str]) -> None:
    engine.cache.insert(tokens)
    if engine.kv_events is not None:
        engine.kv_events.publish(engine.cache.take_events())


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = generate_latest(engine.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"status": "ok", "engine_id": engine.cfg.engine_id})


async def _props(request: web.Request) -> web.Response:
    cfg = request.app[ENGINE_KEY].cfg
    body = {"total_slots": cfg.max_concurrency, "model_alias": cfg.model,
            "default_generation_settings": {"n_ctx": cfg.n_ctx}}  # fmt: skip
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _slots(request: web.Request) -> web.Response:
    """llama-server's ``/slots``: which of its slots are generating now."""
    engine = request.app[ENGINE_KEY]
    busy = engine.gate.running
    body = [{"id": i, "n_ctx": engine.cfg.n_ctx, "is_processing": i < busy}
            for i in range(engine.cfg.max_concurrency)]  # fmt: skip
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[ENGINE_KEY].cfg
    model = {"id": cfg.model, "object": "model", "created": 0, "owned_by": "tokenrelay"}
    return web.json_response({"object": "list", "data": [model]})


def make_app(cfg: EngineConfig) -> web.Application:
    """The engine's application. Serve it with ``handler_cancellation=True`` (as
    ``start_engine`` does) so that a client disconnect aborts the generation at once."""
    app = web.Application(client_max_size=cfg.max_body_bytes)
    app[ENGINE_KEY] = MockEngine(cfg)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    if cfg.report == "llamacpp":  # llama-server's self-description: slots and context
        app.router.add_get("/props", _props)
        app.router.add_get("/slots", _slots)
    return app


@dataclass(slots=True)
class RunningEngine:
    """A started engine: its state, bound address, and ``stop()``."""

    engine: MockEngine
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        if self.engine.kv_events is not None:
            await self.engine.kv_events.stop()


async def start_engine(cfg: EngineConfig) -> RunningEngine:
    """Bind and start the engine (``cfg.port == 0`` picks a free port)."""
    app = make_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = int(runner.addresses[0][1]) if runner.addresses else cfg.port
    engine = app[ENGINE_KEY]
    if cfg.kv_events_port is not None:
        pub = KVEventPublisher(cfg.host, cfg.kv_events_port, cfg.kv_events_replay_port)
        try:
            await pub.start()
        except BaseException:
            await runner.cleanup()
            raise
        engine.kv_events = pub
    return RunningEngine(engine, runner, cfg.host, port)


async def run_engine(cfg: EngineConfig) -> None:
    """Serve the engine until SIGTERM or SIGINT, then shut down cleanly."""
    async with runtime.stop_on_signals() as stop:
        running = await start_engine(cfg)
        print(f"mock engine {cfg.engine_id} listening on {running.url}", flush=True)
        try:
            await stop.wait()
        finally:
            await running.stop()
