"""A Responses stream resumed on another relay after the first one is SIGKILLed.

The official ``openai`` SDK against a live stack: the real cluster, a mock engine and a
worker in this process, two ``tokenrelay relay`` processes with the workers' gateway
key. The response is created in background on the worker; the SDK streams it from
relay A (``responses.retrieve(id, stream=True)``); relay A is SIGKILLed (by its pid)
mid-response; the SDK resumes on relay B with ``starting_after`` = the last
``sequence_number`` it read. The events read before and after are exactly the
uninterrupted stream's (relay B's and the worker's, read from the start once it ended):
none repeated, none skipped, the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from devstack.cluster.launcher import ClusterInfo
from tests.integration.test_responses import KEY, MODEL, typed
from tests.support.relay import relay_process
from tests.support.worker import Harness, expected_reply

pytestmark = pytest.mark.integration


async def test_a_stream_resumes_on_another_relay_after_a_sigkill(
    h: Harness, cluster: ClusterInfo, tmp_path: Path
) -> None:
    await h.start_engines(1, decode_tok_per_s=15.0)
    await h.start_worker(cap=4, gateway_keys=(KEY,))
    flags = ("--gateway-key", KEY)
    async with (
        relay_process(cluster, tmp_path, "edge-a", *flags) as a,
        relay_process(cluster, tmp_path, "edge-b", *flags) as b,
        openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0) as worker,
        openai.AsyncOpenAI(base_url=a.base + "/v1", api_key=KEY, max_retries=0) as ra,
        openai.AsyncOpenAI(base_url=b.base + "/v1", api_key=KEY, max_retries=0) as rb,
    ):
        prompt = "tell me a long story about the sea"
        r = await worker.responses.create(model=MODEL, input=prompt, background=True,
                                          max_output_tokens=48)  # fmt: skip
        before: list[Any] = []
        stream = await ra.responses.retrieve(r.id, stream=True)
        try:
            async for ev in stream:
                before.append(typed(ev))
                if len(before) == 8:
                    a.proc.kill()  # SIGKILL, mid-response
        except (openai.APIConnectionError, openai.APIError, OSError) as exc:
            print(f"relay A's stream broke: {exc!r}")
        kinds = [e.type for e in before]
        assert "response.completed" not in kinds, "the response ended before the kill"
        assert "response.incomplete" not in kinds, "the response ended before the kill"
        last = before[-1].sequence_number
        after = [typed(ev) async for ev in
                 await rb.responses.retrieve(r.id, stream=True, starting_after=last)]  # fmt: skip
        whole = [typed(ev) async for ev in await rb.responses.retrieve(r.id, stream=True)]
        from_worker = [typed(ev) async for ev in
                       await worker.responses.retrieve(r.id, stream=True)]  # fmt: skip
    got = [e.to_dict() for e in before + after]
    assert got == [e.to_dict() for e in whole]
    assert got == [e.to_dict() for e in from_worker]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    text = "".join(e.delta for e in before + after if e.type == "response.output_text.delta")
    assert text == expected_reply([{"role": "user", "content": prompt}], 48)
    assert whole[-1].response.output_text == text
