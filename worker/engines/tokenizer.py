"""The served model's tokenizer and chat template, asked of the engine itself.

What it is for: precise routing (``--routing precise``) looks a prompt up in the block
index by its token ids as the engine computes them (:mod:`worker.routing.tokens`), so it
needs the served model's chat template and tokenizer. The mock engine's are known to the
worker; for any other model :class:`EngineTokenizer` asks an engine serving it:

- llama.cpp's ``llama-server``: ``POST /apply-template`` ``{"messages"}`` gives the
  rendered prompt, ``POST /tokenize`` ``{"content", "add_special": false,
  "parse_special": true}`` its ids (the template writes its own special tokens);
- vLLM (and engines answering 404 to ``/apply-template``): ``POST /tokenize``
  ``{"model", "messages", "add_generation_prompt": true}`` renders and tokenizes at once.

Bounded: one prompt's look-up takes at most ``timeout_s`` (default 0.25 s) over every
engine tried; past it, or on any error, the answer is ``None`` and the turn is routed by
the estimate (never held long: the turn's wait for an engine is its own, bounded too).

Cached per prompt prefix: a conversation's prompt this turn begins with its previous
prompt (the history, then the reply and the new message). Each answer is kept under the
digest of its messages; a new prompt whose first messages were tokenized before asks
the engine for the ids of its new text only (the rendered text after that earlier
prompt, which ends at a line break: byte-level BPE never merges across one) and appends
them. A whole prompt seen before (a regenerate, a retried request) costs no request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import aiohttp
import orjson

from worker.routing.lease import EngineSpec
from worker.routing.tokens import message_text

__all__ = ["EngineTokenizer", "messages_digests"]

log = logging.getLogger(__name__)
_MAX_BYTES: Final = 8 << 20


def messages_digests(messages: Sequence[Mapping[str, object]]) -> list[bytes]:
    """The digest of each prefix of ``messages`` (``[i]``: the first ``i + 1``), chained so
    that all of them cost one pass."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    for m in messages:
        h.update(str(m.get("role", "user")).encode("utf-8", "surrogatepass") + b"\x1e")
        h.update(message_text(m.get("content")).encode("utf-8", "surrogatepass") + b"\x1f")
        out.append(h.copy().digest())
    return out


def _base(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class EngineTokenizer:
    """Token ids of chat messages as the served model renders them, asked of an engine."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        engines: Callable[[], Iterable[EngineSpec]],
        model: str,
        *,
        timeout_s: float = 0.25,
        max_prompts: int = 4096,
    ) -> None:
        self.http = http
        self.engines = engines
        self.model = model
        self.timeout_s = timeout_s
        self.max_prompts = max_prompts
        # digest of a prompt's messages -> (its rendered text, its ids)
        self._cache: OrderedDict[bytes, tuple[str, list[int]]] = OrderedDict()
        self._no_template: set[str] = set()  # engines that answered 404 to /apply-template
        self.asked = 0  # prompts that needed the engine
        self.partial = 0  # ... of which only the text after a cached prefix was tokenized
        self.failed = 0  # no answer in time: the turn was routed by the estimate

    async def ids(self, messages: Sequence[Mapping[str, object]]) -> list[int] | None:
        """The prompt's ids (with the generation prompt), or ``None`` within ``timeout_s``."""
        if not messages:
            return None
        digests = messages_digests(messages)
        hit = self._cache.get(digests[-1])
        if hit is not None:
            self._cache.move_to_end(digests[-1])
            return list(hit[1])
        self.asked += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                got = await self._ask(messages, digests)
        except TimeoutError:
            got = None
        if got is None:
            self.failed += 1
            return None
        text, ids = got
        self._cache[digests[-1]] = (text, ids)
        while len(self._cache) > self.max_prompts:
            self._cache.popitem(last=False)
        return list(ids)

    def _prefix(self, digests: Sequence[bytes]) -> tuple[str, list[int]] | None:
        for d in reversed(digests[:-1]):
            hit = self._cache.get(d)
            if hit is not None:
                return hit
        return None

    async def _ask(
        self, messages: Sequence[Mapping[str, object]], digests: Sequence[bytes]
    ) -> tuple[str, list[int]] | None:
        for spec in list(self.engines()):
            base = _base(spec.url)
            try:
                if spec.id not in self._no_template:
                    got = await self._llama(base, spec.id, messages, digests)
                    if got is not None:
                        return got
                if spec.id in self._no_template:
                    ids = await self._vllm(base, messages)
                    if ids is not None:
                        return "", ids
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                log.debug("engine %s could not tokenize: %r", spec.id, exc)
        return None

    async def _llama(
        self,
        base: str,
        engine_id: str,
        messages: Sequence[Mapping[str, object]],
        digests: Sequence[bytes],
    ) -> tuple[str, list[int]] | None:
        body = {"messages": [{"role": m.get("role", "user"), "content": message_text(
            m.get("content"))} for m in messages]}  # fmt: skip
        status, obj = await self._post(base + "/apply-template", body)
        if status == 404:
            self._no_template.add(engine_id)
            return None
        text = obj.get("prompt") if status == 200 and isinstance(obj, dict) else None
        if not isinstance(text, str):
            return None
        head: list[int] = []
        rest = text
        prefix = self._prefix(digests)
        if prefix is not None and prefix[0].endswith("\n") and text.startswith(prefix[0]):
            head, rest = list(prefix[1]), text[len(prefix[0]) :]
            self.partial += 1
        ids = await self._tokenize(base, rest)
        return None if ids is None else (text, head + ids)

    async def _tokenize(self, base: str, content: str) -> list[int] | None:
        if not content:
            return []
        body = {"content": content, "add_special": False, "parse_special": True}
        status, obj = await self._post(base + "/tokenize", body)
        return _tokens(obj) if status == 200 else None

    async def _vllm(self, base: str, messages: Sequence[Mapping[str, object]]) -> list[int] | None:
        body = {"model": self.model, "add_generation_prompt": True, "messages": [
            {"role": m.get("role", "user"), "content": message_text(m.get("content"))}
            for m in messages]}  # fmt: skip
        status, obj = await self._post(base + "/tokenize", body)
        return _tokens(obj) if status == 200 else None

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, object]:
        headers = {"Content-Type": "application/json"}
        async with self.http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            raw = await resp.content.read(_MAX_BYTES)
            if resp.status != 200:
                return resp.status, None
        return 200, orjson.loads(raw)


def _tokens(obj: object) -> list[int] | None:
    """``{"tokens": [ids]}`` (llama-server, vLLM); llama-server's ``with_pieces`` form
    (``[{"id", "piece"}]``) too. ``None`` for anything else."""
    toks = obj.get("tokens") if isinstance(obj, dict) else None
    if not isinstance(toks, list):
        return None
    out: list[int] = []
    for t in toks:
        if isinstance(t, dict):
            t = t.get("id")
        if not isinstance(t, int) or isinstance(t, bool):
            return None
        out.append(t)
    return out
