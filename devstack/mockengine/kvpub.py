"""The mock engine's KV-event publisher: vLLM's ZeroMQ sockets, on loopback.

What vLLM does with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``, from the mock's
simulated prefix cache (:mod:`devstack.mockengine.prefix_cache`, stores and evictions):

- **PUB** (default port 5557): one multipart message per batch, ``[topic, seq, payload]``,
  ``seq`` counting from 0 as 8 bytes big-endian, ``payload`` a msgpack ``KVEventBatch``
  (:mod:`worker.routing.kvwire`).
- **ROUTER** (5558, replay): a request ``[identity, "", start seq]`` is answered with every
  buffered batch from ``start`` on, ``[identity, "", seq, payload]`` each, then the end
  marker ``[identity, "", -1, ""]``. The buffer keeps the last ``buffer_steps`` batches.

Both sockets bind to the given host (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from worker.routing.kvwire import END_SEQ, KVEvent, KVEventBatch, encode_batch, encode_seq

__all__ = ["KVEventPublisher"]

log = logging.getLogger(__name__)


class KVEventPublisher:
    """Publish batches of KV events; answer replay requests. ``await start()`` then
    :meth:`publish` from the event loop; ``await stop()``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5557,
        replay_port: int | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
    ) -> None:
        self.host = host
        self.port = port
        self.replay_port = port + 1 if replay_port is None and port else (replay_port or 0)
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    async def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            self.port = _bind(pub, self.host, self.port)
            self.replay_port = _bind(router, self.host, self.replay_port)
        except zmq.ZMQError as exc:  # the port is taken: an OSError like the HTTP site's
            pub.close()
            router.close()
            raise OSError(exc.errno, f"kv events: {exc}") from None
        self._pub, self._router = pub, router
        self._task = asyncio.create_task(self._serve_replay(router), name="kv-events-replay")

    def publish(self, events: Sequence[KVEvent]) -> None:
        """One batch, numbered, sent without waiting (a slow subscriber loses messages
        past the high-water mark, as with vLLM, and replays them)."""
        if not events or self._pub is None:
            return
        payload = encode_batch(KVEventBatch(time.time(), list(events)))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self._send(seq, payload)
        self.published += 1

    def _send(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart((ident, b"", encode_seq(seq), payload))
            await router.send_multipart((ident, b"", encode_seq(END_SEQ), b""))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")
