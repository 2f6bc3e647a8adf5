"""An OpenAI-compatible engine whose every token is the time it was sent.

What it is for: measuring the path from the engine to a screen. Each streamed token is
``[<time.time_ns()>]`` taken just before the chunk is written, so a client anywhere on
this machine computes engine-token -> screen latency from the text it receives, through
whatever path (worker closed loop, relay) carried it, coalesced or not.

``python -m bench.load.stamp_engine --port P [--tokens-per-s R]``: ``POST
/v1/chat/completions`` streams ``max_tokens`` tokens (default 64) at R per second;
``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

__all__ = ["main", "make_app"]


def _chunk(text: str, finish: str | None) -> bytes:
    body = {
        "id": "stamp",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stamp",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def make_app(tokens_per_s: float) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        n = int(body.get("max_tokens") or 64)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        t0 = time.monotonic()
        for i in range(n):
            delay = t0 + i / tokens_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(_chunk(f"[{time.time_ns()}]", None))
        await resp.write(_chunk("", "length"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.stamp_engine")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens-per-s", type=float, default=20.0)
    args = ap.parse_args(argv)
    web.run_app(make_app(args.tokens_per_s), host="127.0.0.1", port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
