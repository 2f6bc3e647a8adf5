"""Tool calling on a real engine: llama.cpp's ``llama-server`` with the SmolLM2 tool
template (devstack/llama/smollm2-tools.jinja, ``--jinja``), through the worker's
chat-completions gateway and the official ``openai`` SDK, into a session's backlog and
onto every screen of a relay.

``tool_choice: "required"`` makes llama.cpp constrain the reply with a grammar built
from the tool's schema, so the 135M model's call is valid JSON of that schema; the
conversation shows it one call first (without it the model writes prose to
``max_tokens``: the grammar allows text before the call). The tool's result then gets a
text reply (a session-less request: a session's turn is a user's message). SmolLM2
does not reason: llama-server sends no ``reasoning_content`` for it (checked here, so a
model that starts reasoning would be noticed); with a template that opens a ``<think>``
block (devstack/llama/smollm2-think.jinja) llama-server streams the reply as
``reasoning_content``, and that reaches the SDK and the session's part frames. Kept to a
few requests of a few dozen tokens: the engine is a CPU one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from pydantic import BaseModel
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.llama.build import Built
from devstack.llama.serve import MODEL, THINK_TEMPLATE, TOOLS_TEMPLATE, LlamaServer, llama_servers
from relay.client.transcript import Transcript
from tests.e2e.test_real_engine import CTX, KEY, SLOTS, built, start_worker  # noqa: F401
from tests.integration.test_chat_screens import Screen
from tests.support import relay as relay_support
from tests.support.worker import Harness, wait_turn

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.real_engine]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str


TOOL = openai.pydantic_function_tool(GetWeather, name="get_weather")
SHOWN: list[Any] = [  # one call shown, no result: the model copies the form
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_rome", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }]},
    {"role": "user", "content": "What is the weather in Paris?"},
]  # fmt: skip


@pytest.fixture
async def engine(built: Built, tmp_path: Path) -> AsyncIterator[list[LlamaServer]]:  # noqa: F811
    async with llama_servers(built, 1, tmp_path, slots=SLOTS, ctx=CTX) as servers:
        yield servers


async def test_a_required_tool_call_reaches_the_sdk_the_backlog_and_every_screen(
    engine: list[LlamaServer], cluster: ClusterInfo, h: Harness, redis: RedisCluster
) -> None:
    await start_worker(h, engine)
    sid, token = await h.session()
    tied = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=token, max_retries=0,
                              default_headers={"X-Session-Id": sid})  # fmt: skip
    bare = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    async with relay_support.running(cluster) as relay:
        live = Screen(relay.base, sid, token, "sse")
        late: Screen | None = None
        try:
            reasoning = ""
            async with tied.chat.completions.stream(
                model=MODEL, messages=SHOWN, tools=[TOOL], tool_choice="required",
                max_tokens=40, temperature=0,
            ) as stream:  # fmt: skip
                async for ev in stream:
                    if ev.type == "chunk":
                        for c in ev.chunk.choices:
                            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                final = await stream.get_final_completion()
            choice = final.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            [call] = choice.message.tool_calls or []
            # the SDK reassembled the streamed call and parsed it with the tool's schema
            assert call.function.name == "get_weather"
            assert isinstance(call.function.parsed_arguments, GetWeather)
            assert json.loads(call.function.arguments) == {
                "city": call.function.parsed_arguments.city
            }
            assert call.function.parsed_arguments.city.strip()
            assert reasoning == ""  # SmolLM2 does not reason
            # the session's backlog holds the call as part frames: start, deltas, end
            frames = await wait_turn(redis, sid, 1, timeout_s=120)
            assert frames[-1].kind == "done", frames[-1]
            parts = [f for f in frames if f.kind == "part"]
            metas = [f.meta or {} for f in parts]
            assert {(m["part"], m["id"]) for m in metas} == {("tool-call", call.id)}
            assert [m["phase"] for m in metas] == ["start"] + ["delta"] * (len(parts) - 2) + ["end"]
            assert metas[0]["name"] == "get_weather"
            assert "".join(f.text for f in parts[1:-1]) == call.function.arguments
            assert (frames[-1].meta or {})["parts"] == 1
            # a screen that came live and one that reads the backlog through the relay
            late = Screen(relay.base, sid, token, "ws")
            for s in (live, late):
                await s.until(frames[-1].offset, timeout_s=30)
            assert live.transcript.entries == late.transcript.entries
            replay = Transcript(sid)
            for f in frames:
                replay.apply(f)
            [got] = late.transcript.entries[-1].parts
            assert (got.part, got.id, got.name) == ("tool-call", call.id, "get_weather")
            assert got.value() == json.loads(call.function.arguments)
            assert late.transcript.entries == replay.entries

            # session-less, the engine's own tool-call chunks pass through to the SDK
            async with bare.chat.completions.stream(
                model=MODEL, messages=SHOWN, tools=[TOOL], tool_choice="required",
                max_tokens=40, temperature=0,
            ) as passed:  # fmt: skip
                again = (await passed.get_final_completion()).choices[0]
            assert again.finish_reason == "tool_calls"
            [call2] = again.message.tool_calls or []
            assert call2.function.name == "get_weather"
            assert isinstance(call2.function.parsed_arguments, GetWeather)

            # the tool's result, sent back (a session's turn is a user's message: the
            # gateway refuses one ending in a tool's result, so this one is session-less)
            result = {"city": got.value()["city"], "temp_c": 18, "sky": "clear"}
            fn = {"name": "get_weather", "arguments": call.function.arguments}
            history: list[Any] = [
                *SHOWN,
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.id, "type": "function", "function": fn}]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
            ]  # fmt: skip
            after = await bare.chat.completions.create(
                model=MODEL, messages=history, tools=[TOOL], max_tokens=24, temperature=0
            )
            reply = after.choices[0]
            assert reply.finish_reason in ("stop", "length"), reply
            assert not reply.message.tool_calls
            assert (reply.message.content or "").strip()
        finally:
            await tied.close()
            await bare.close()
            for screen in (live, late):
                if screen is not None:
                    await screen.close()


async def test_the_tool_template_renders_a_conversation_without_tools_as_the_models_own(
    built: Built,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same prompt as before the template, so the same replies, cached prefixes and
    routing figures: llama-server's own rendering (``/apply-template``) with the model's
    template and with ours."""
    conversations: list[list[dict[str, str]]] = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sea?"},
         {"role": "assistant", "content": "Water."}, {"role": "user", "content": "More?"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c"}],
    ]  # fmt: skip
    prompts: list[list[str]] = []
    async with aiohttp.ClientSession() as http:
        for ours in (False, True):
            template = TOOLS_TEMPLATE if ours else None
            async with llama_servers(built, 1, tmp_path, template=template) as [server]:
                got = []
                for messages in conversations:
                    async with http.post(server.url + "/apply-template",
                                         json={"messages": messages}) as r:  # fmt: skip
                        assert r.status == 200, await r.text()
                        got.append((await r.json())["prompt"])
                async with http.get(server.url + "/props") as r:
                    caps = (await r.json())["chat_template_caps"]
                assert caps["supports_tool_calls"] is ours
                prompts.append(got)
    assert prompts[0] == prompts[1]
    assert prompts[0][0].startswith("<|im_start|>system\nYou are a helpful AI assistant")


async def test_a_real_engines_reasoning_reaches_the_sdk_and_the_sessions_parts(
    built: Built,  # noqa: F811
    tmp_path: Path,
    h: Harness,
    redis: RedisCluster,
) -> None:
    async with llama_servers(built, 1, tmp_path, slots=SLOTS, ctx=CTX,
                             template=THINK_TEMPLATE) as engines:  # fmt: skip
        await start_worker(h, engines)
        sid, token = await h.session()
        tied = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=token, max_retries=0,
                                  default_headers={"X-Session-Id": sid})  # fmt: skip
        try:
            stream = await tied.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Is 7 a prime number?"}],
                max_tokens=12, temperature=0, stream=True,
            )  # fmt: skip
            reasoning, content = "", ""
            async for ch in stream:
                for c in ch.choices:
                    reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                    content += c.delta.content or ""
        finally:
            await tied.close()
    assert reasoning.strip()
    frames = await wait_turn(redis, sid, 1, timeout_s=120)
    assert frames[-1].kind == "done", frames[-1]
    t = Transcript(sid)
    for f in frames:
        t.apply(f)
    assert t.refused == []
    reply = t.entries[-1]
    assert [(p.part, p.done) for p in reply.parts] == [("reasoning", True)]
    assert reply.parts[0].text == reasoning
    assert reply.text == content
    assert (frames[-1].meta or {})["parts"] == 1
