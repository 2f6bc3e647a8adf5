"""What an engine says of itself: its slots and context, learned at run time.

llama.cpp's ``llama-server`` answers ``GET /props`` with ``total_slots`` (``-np``) and
``default_generation_settings.n_ctx`` (each slot's context); engines without the route
(vLLM, SGLang, the mock) answer 404 and stay as their flags say. :class:`PropsReader`
reads every routable engine about every ``interval_s`` (a supervised loop of the worker,
``engine_props``) into :class:`worker.routing.profile.Profiles`, where a flag's value
wins. :func:`props_shape` is the pure part: the numbers out of the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from worker.engines.report import to_int
from worker.routing.lease import EngineSpec
from worker.routing.profile import Profiles

__all__ = ["PropsReader", "props_shape"]

log = logging.getLogger(__name__)
_MAX_BYTES = 1 << 20


def props_shape(obj: object) -> tuple[int, int]:
    """(slots, context tokens) from a ``/props`` answer; 0 where it does not say."""
    if not isinstance(obj, Mapping):
        return 0, 0
    slots = to_int(obj.get("total_slots")) or 0
    settings = obj.get("default_generation_settings")
    ctx = to_int(settings.get("n_ctx")) if isinstance(settings, Mapping) else None
    return slots, ctx or 0


def _base(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class PropsReader:
    """Reads the engines' ``/props`` into ``profiles`` (one GET each, bounded)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        profiles: Profiles,
        engines: Callable[[], Iterable[EngineSpec]],
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self.http = http
        self.profiles = profiles
        self.engines = engines
        self.timeout_s = timeout_s
        self._said: dict[str, tuple[int, int]] = {}

    async def read(self, spec: EngineSpec) -> tuple[int, int] | None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.http.get(_base(spec.url) + "/props", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                raw = await resp.content.read(_MAX_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        try:
            obj: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return props_shape(obj)

    async def step(self) -> None:
        specs = list(self.engines())
        shapes = await asyncio.gather(*(self.read(s) for s in specs))
        for spec, shape in zip(specs, shapes, strict=True):
            if shape is None or shape == (0, 0):
                continue
            slots, ctx = shape
            self.profiles.learn_props(spec.id, slots=slots, context_tokens=ctx)
            if self._said.get(spec.id) != shape:
                self._said[spec.id] = shape
                log.info("engine %s: %d slots, context %d tokens (its /props)", spec.id,
                         slots, ctx)  # fmt: skip
