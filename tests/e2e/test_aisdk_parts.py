"""A reply's parts through the AI SDK UI stream, read by the real ``ai`` package: the
producer writes reasoning, text, tool calls (streamed arguments), a tool's result and
error, a source and a data part into a memory store; the relay's UI stream translation
(relay/fronts/aisdk/wire.py) turns the frames into the SDK's chunks, which the SDK's own
parser (its chunk schema) and ``readUIMessageStream`` rebuild (clients/aisdk/parts/
read.mjs). The message the SDK builds is the one ``GET .../messages?format=ui`` stores
(:func:`relay.protocol.parts.ui_parts`), also when the stream starts mid-reply as a
compacted join."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relay.broker.memstore import MemoryStore
from relay.client.transcript import Transcript
from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery
from relay.fronts.aisdk.wire import DONE, UiTurn, encode_chunk
from relay.producer import Producer
from relay.protocol.frame import Frame, decode, encode, frame_gen
from relay.protocol.parts import ui_parts
from tests.support.cli import run_cli
from tests.support.npm import npm_ready

AISDK = Path(__file__).resolve().parents[2] / "clients" / "aisdk"


async def _reply() -> tuple[str, list[Frame]]:
    store = MemoryStore("parts", maxlen=10_000, max_bytes=1 << 24, ttl_s=60)
    p = Producer(store, keys="k" * 32)
    s = p.session("ui-parts")
    turn = await s.start_turn("weather?", watch=False)
    turn.reasoning("The user wants ")
    turn.reasoning("the weather.")
    turn.write("Let me check ")
    turn.write("two places.")
    turn.tool_call_start("call_1", "weather")
    for piece in ['{"ci', 'ty": "O', 'slo"}']:
        turn.tool_call_delta("call_1", piece)
    turn.tool_call_end("call_1")
    turn.tool_call("call_2", "weather", {"city": "Nowhere"})
    turn.tool_result("call_1", {"temp": 4})
    turn.tool_result("call_2", "no such city", error=True)
    turn.source("https://example.org/oslo", title="Oslo")
    turn.write("It is 4 degrees.")
    turn.data("weather", {"city": "Oslo", "temp": 4})
    await turn.done(finish_reason="stop")
    page = await store.read_page(s.id, 0, 10_000, 0)
    return s.id, [decode(f) for f in page.frames]


def _ui_body(sid: str, frames: list[Frame]) -> bytes:
    ui = UiTurn(sid, 1)
    body = b"".join(encode_chunk(c) for f in frames for c in ui.feed(f))
    assert ui.finished
    return body + DONE


async def _sdk_message(body: bytes, tmp: Path) -> dict[str, Any]:
    path = tmp / "ui.sse"
    path.write_bytes(body)
    ran = await run_cli(["node", "parts/read.mjs", str(path)], cwd=AISDK, timeout_s=60)
    assert ran.code == 0, ran.out + ran.err
    message: dict[str, Any] = json.loads(ran.out.strip().splitlines()[-1])
    return message


@pytest.mark.timeout(180)
async def test_the_sdk_rebuilds_every_part_as_the_stored_ui_message(tmp_path: Path) -> None:
    why = await npm_ready(AISDK, "ai")
    if why is not None:
        pytest.skip(why)
    sid, frames = await _reply()
    t = Transcript(sid)
    for f in frames:
        t.apply(f)
    stored = ui_parts(t.history()[-1]["parts"])
    live = await _sdk_message(_ui_body(sid, frames), tmp_path)
    assert live["id"] == f"{sid}-1"
    assert live["parts"] == stored
    assert [p["type"] for p in live["parts"]] == [
        "reasoning", "text", "tool-weather", "tool-weather", "source-url", "text",
        "data-weather",
    ]  # fmt: skip
    assert live["parts"][2]["state"] == "output-available"
    assert live["parts"][3]["state"] == "output-error"
    # a screen that joins as a compacted join: each part's deltas merged, the same message
    c = Compactor(merge_open=True)
    ds = [Delivery(f.offset, f.kind, encode(f), f.ts, 0, frame_gen(f)) for f in frames]
    joined = [decode(d.data) for d in c.feed(ds) + c.flush()]
    assert len(joined) < len(frames)
    assert (await _sdk_message(_ui_body(sid, joined), tmp_path))["parts"] == stored
