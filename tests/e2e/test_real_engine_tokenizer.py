"""Precise routing's tokenizer on a real engine: the served model's chat template and
tokenizer asked of llama.cpp's ``llama-server`` (``/apply-template``, ``/tokenize``;
:mod:`worker.engines.tokenizer`), checked against what the engine itself computes.

Skips, saying why, where the engine is not built (``python -m devstack llama build``).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from devstack.llama.build import find, missing_toolchain
from devstack.llama.serve import MODEL, llama_servers
from devstack.procs import HOST, free_port
from worker.engines.tokenizer import EngineTokenizer
from worker.routing.lease import EngineSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.real_engine]

SYSTEM = "You are a helpful assistant who answers about ships, harbours and the sea."


async def test_the_engines_tokenizer_gives_the_ids_the_engine_computes(tmp_path: Path) -> None:
    built = find()
    if built is None:
        pytest.skip(missing_toolchain() or "llama-server is not built: make llama-engine")
    async with (
        llama_servers(built, 1, tmp_path, slots=1, ctx=2048) as (server,),
        aiohttp.ClientSession() as http,
    ):
        spec = EngineSpec(id=server.id, url=server.url, cap=1)
        tok = EngineTokenizer(http, lambda: [spec], MODEL, timeout_s=10.0)  # a loaded CPU

        async def engines_count(messages: list[dict[str, str]]) -> int:
            body = {"model": MODEL, "messages": messages, "max_tokens": 1,
                    "cache_prompt": False}  # fmt: skip
            async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            return int(usage["prompt_tokens"])

        first = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "How does a harbour work?"}]  # fmt: skip
        ids1 = await tok.ids(first)
        assert ids1 is not None
        assert len(ids1) == await engines_count(first)
        assert (tok.asked, tok.partial) == (1, 0)

        # the next turn: only the text after the first prompt is tokenized, and the ids
        # are the ones the engine computes for the whole prompt
        second = [*first, {"role": "assistant", "content": "Ships dock at its piers.\nThen"},
                  {"role": "user", "content": "And what do sailors eat in winter?"}]  # fmt: skip
        ids2 = await tok.ids(second)
        assert ids2 is not None
        assert (tok.asked, tok.partial) == (2, 1)
        assert ids2[: len(ids1)] == ids1
        assert len(ids2) == await engines_count(second)
        async with http.post(server.url + "/apply-template", json={"messages": second}) as r:
            whole = (await r.json())["prompt"]
        body = {"content": whole, "add_special": False, "parse_special": True}
        async with http.post(server.url + "/tokenize", json=body) as r:
            assert ids2 == (await r.json())["tokens"]

        # a prompt seen before costs no request
        assert await tok.ids(second) == ids2
        assert tok.asked == 2

        # an engine that does not answer: None within the bound, and the turn is routed
        # by the estimate
        gone = EngineSpec(id="gone", url=f"http://{HOST}:{free_port()}", cap=1)
        dead = EngineTokenizer(http, lambda: [gone], MODEL, timeout_s=0.5)
        assert await dead.ids(first) is None
        assert dead.failed == 1
