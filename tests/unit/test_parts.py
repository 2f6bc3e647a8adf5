"""A reply's parts (relay.protocol.parts), pure: the vocabulary's refusals, the digest the
``done`` frame carries, one part's deltas merging on their own (frame merge, compacted
join, conflation), the client's continuity and transcript rebuilding every part and
refusing what would corrupt it."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from relay.client.core import Continuity
from relay.client.transcript import Transcript
from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery
from relay.edge.core.watch import conflate
from relay.protocol.frame import Frame, decode, encode, first_offset, merge_tokens
from relay.protocol.parts import (
    Part,
    PartError,
    PartRef,
    Parts,
    frame_part,
    part_meta,
    parts_digest,
    parts_integrity,
)

SID = "parts"


def frame(offset: int, kind: str, text: str = "", meta: dict[str, Any] | None = None,
          turn: int = 1) -> Frame:  # fmt: skip
    return Frame(session=SID, turn=turn, offset=offset, kind=kind, text=text, epoch=1, ts=1,  # type: ignore[arg-type]
                 meta={**(meta or {}), "gen": "g1"})  # fmt: skip


def pf(offset: int, ref: PartRef, text: str = "", turn: int = 1) -> Frame:
    return frame(offset, "part", text, part_meta(ref), turn)


def delivery(f: Frame) -> Delivery:
    return Delivery(f.offset, f.kind, encode(f), 1, 0, "g1")


def reply(args: str = '{"city": "Oslo"}') -> tuple[list[Frame], list[Part]]:
    """A turn: meta, reasoning (2 deltas), text, a tool call (3 deltas) interleaved with
    text, its result, a data part, done with the integrity a producer writes."""
    call = PartRef("tool-call", "call_1", "start", "weather")
    steps: list[tuple[str, str, PartRef | None]] = [
        ("meta", "", None),
        ("part", "", PartRef("reasoning", "r1", "start")),
        ("part", "Let me ", PartRef("reasoning", "r1", "delta")),
        ("part", "think", PartRef("reasoning", "r1", "delta")),
        ("part", "", PartRef("reasoning", "r1", "end")),
        ("token", "Checking", None),
        ("part", "", call),
        ("part", args[:5], PartRef("tool-call", "call_1", "delta")),
        ("part", args[5:9], PartRef("tool-call", "call_1", "delta")),
        ("part", args[9:], PartRef("tool-call", "call_1", "delta")),
        ("part", "", PartRef("tool-call", "call_1", "end")),
        ("part", '{"temp":4}', PartRef("tool-result", "call_1", None, "weather")),
        ("token", " the", None),
        ("token", " weather", None),
        ("part", '{"n":1}', PartRef("data-weather", "d1")),
    ]
    frames: list[Frame] = []
    parts = Parts()
    text = ""
    for i, (kind, t, ref) in enumerate(steps, start=1):
        if ref is not None:
            parts.apply(ref, t, i)
            frames.append(pf(i, ref, t))
        else:
            text += t
            frames.append(frame(i, kind, t, {"message": "hi"} if kind == "meta" else None))
    done = {"chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
            **parts_integrity(parts.records), "finish_reason": "tool_calls"}  # fmt: skip
    frames.append(frame(len(steps) + 1, "done", "", done))
    return frames, parts.records


# ---- the vocabulary's refusals ------------------------------------------------------


@pytest.mark.parametrize(
    ("refs", "why"),
    [
        ([PartRef("video", "v1")], "unknown part type"),
        ([PartRef("data-", "v1")], "unknown part type"),
        ([PartRef("tool-call", "c1", "delta")], "never started"),
        ([PartRef("tool-call", "c1", "end")], "never started"),
        (
            [PartRef("tool-call", "c1", "start", "f"), PartRef("tool-call", "c1", "start", "f")],
            "already started",
        ),
        (
            [
                PartRef("tool-call", "c1", "start", "f"),
                PartRef("tool-call", "c1", "delta"),
                PartRef("tool-call", "c1", "end"),
                PartRef("tool-call", "c1", "delta"),
            ],
            "already ended",
        ),
        ([PartRef("tool-result", "c9", None, "f")], "has not finished"),
        ([PartRef("source", "s1"), PartRef("source", "s1")], "already written"),
    ],
)
def test_a_part_that_does_not_fit_is_refused_and_changes_nothing(
    refs: list[PartRef], why: str
) -> None:
    parts = Parts()
    texts = {"start": "", "end": "", "delta": "{}", None: "{}"}
    for ref in refs[:-1]:
        parts.apply(frame_part(part_meta(ref)), texts[ref.phase])
    before = [(p.part, p.id, p.text, p.done) for p in parts.records]
    last = refs[-1]
    with pytest.raises(PartError, match=why):
        parts.apply(frame_part(part_meta(last)), texts[last.phase])
    assert [(p.part, p.id, p.text, p.done) for p in parts.records] == before


def test_a_tool_call_whose_arguments_are_not_json_when_complete_is_refused() -> None:
    parts = Parts()
    parts.apply(PartRef("tool-call", "c1", "start", "f"), "")
    parts.apply(PartRef("tool-call", "c1", "delta"), '{"a": ')  # not JSON yet: fine
    with pytest.raises(PartError, match="not valid JSON"):
        parts.apply(PartRef("tool-call", "c1", "end"), "")
    assert parts.open()[0].text == '{"a": '  # still open, nothing corrupted
    parts.apply(PartRef("tool-call", "c1", "delta"), "1}")
    assert parts.apply(PartRef("tool-call", "c1", "end"), "").value() == {"a": 1}


def test_nothing_after_the_turn_ended() -> None:
    parts = Parts()
    parts.close()
    with pytest.raises(PartError, match="after the turn ended"):
        parts.apply(PartRef("source", "s1"), '{"url": "https://x"}')


@pytest.mark.parametrize(
    "meta",
    [
        None,
        {"part": "reasoning", "id": "r1"},
        {"part": "source", "id": "s", "phase": "delta"},
        {"part": "tool-call", "id": "c 1", "phase": "start", "name": "f"},
        {"part": "tool-call", "id": "c1", "phase": "start"},
        {"part": 3, "id": "x"},
    ],
)
def test_a_part_frame_whose_meta_is_wrong_is_refused(meta: dict[str, Any] | None) -> None:
    with pytest.raises(PartError):
        frame_part(meta)


def test_the_digest_is_the_documented_one_and_empty_adds_nothing() -> None:
    records = [Part("reasoning", "r1", "", "hé", True, summary=True),
               Part("tool-call", "c1", "f", '{"a":1}', True)]  # fmt: skip
    want = hashlib.sha256(
        "reasoning\x1fr1\x1fsummary\x1f3\x1fhé".encode() + b'tool-call\x1fc1\x1ff\x1f7\x1f{"a":1}'
    ).hexdigest()
    assert parts_digest(records) == want
    # the vector clients/js/test/parts.test.js checks the browser client against
    assert want == "bd42b564c61eee077aa47bb3bf4f131ca95cf2a85f60c8fb01f90d3a5c92efb1"
    assert parts_integrity(records) == {"parts": 2, "parts_sha256": want}
    assert parts_integrity([]) == {}


# ---- one part's deltas merge on their own -----------------------------------------


def test_one_parts_deltas_merge_and_keep_the_part() -> None:
    d = PartRef("tool-call", "c1", "delta")
    m = merge_tokens([pf(3, d, '{"a"'), pf(4, d, ":1"), pf(5, d, "}")])
    assert (m.kind, m.text, m.offset, first_offset(m)) == ("part", '{"a":1}', 5, 3)
    assert m.meta == {"part": "tool-call", "id": "c1", "phase": "delta", "merged": 3,
                      "from": 3, "gen": "g1"}  # fmt: skip
    with pytest.raises(ValueError, match="merge"):
        merge_tokens([pf(3, d, "a"), pf(4, PartRef("tool-call", "c2", "delta"), "b")])
    with pytest.raises(ValueError, match="merge"):
        merge_tokens([frame(3, "token", "a"), pf(4, d, "b")])


def test_a_compacted_join_merges_each_part_on_its_own() -> None:
    frames, records = reply()
    c = Compactor()
    out = c.feed([delivery(f) for f in frames]) + c.flush()
    got = [decode(x.data) for x in out]
    last = 0
    for f in got:
        assert first_offset(f) == last + 1
        last = f.offset
    phases = [(f.kind, (f.meta or {}).get("part"), (f.meta or {}).get("phase")) for f in got]
    assert phases == [
        ("meta", None, None),
        ("part", "reasoning", "start"), ("part", "reasoning", "delta"),
        ("part", "reasoning", "end"),
        ("token", None, None),
        ("part", "tool-call", "start"), ("part", "tool-call", "delta"),
        ("part", "tool-call", "end"), ("part", "tool-result", None),
        ("token", None, None), ("part", "data-weather", None), ("done", None, None),
    ]  # fmt: skip
    t = Transcript(SID)
    cont = Continuity(0)
    for f in got:
        ok, problems = cont.accept(f)
        assert ok, f
        assert not problems
        t.apply(f)
    assert [(p.part, p.id, p.text) for p in t.entries[-1].parts] == [
        (p.part, p.id, p.text) for p in records
    ]
    assert t.entries[-1].text == "Checking the weather"


def test_conflation_merges_each_part_on_its_own() -> None:
    frames, _ = reply()
    out, merged = conflate([delivery(f) for f in frames])
    assert merged == 3  # the reasoning's deltas, the call's deltas, the text after the result
    assert "".join(decode(x.data).text for x in out) == "".join(f.text for f in frames)


# ---- the client rebuilds every part and refuses what does not fit -----------------


def test_the_client_checks_the_parts_integrity_in_done() -> None:
    frames, _ = reply()
    cont = Continuity(0)
    for f in frames:
        assert cont.accept(f) == (True, [])
    frames, _ = reply()
    wrong = [*frames[:-1], frame(frames[-1].offset, "done", "",
                                 {**(frames[-1].meta or {}), "parts": 2})]  # fmt: skip
    cont = Continuity(0)
    problems = [p for f in wrong for p in cont.accept(f)[1]]
    assert [p.reason for p in problems] == ["integrity"]
    assert "parts 4 != 2" in problems[0].detail
    tampered = [f if f.offset != 8 else pf(8, PartRef("tool-call", "call_1", "delta"), '{"cXty')
                for f in frames]  # fmt: skip
    cont = Continuity(0)
    problems = [p for f in tampered for p in cont.accept(f)[1]]
    assert [(p.reason, p.detail) for p in problems] == [("integrity", "parts_sha256 differs")]


def test_bad_part_frames_are_refused_not_delivered_and_the_transcript_stays_whole() -> None:
    frames, records = reply()
    done = frames[-1]
    n = done.offset
    stream = [
        *frames[:-1],
        pf(n, PartRef("tool-call", "ghost", "delta"), "{}"),  # a call never started
        frame(n + 1, "part", "{}", {"part": "video", "id": "v"}),  # an unknown type
        frame(n + 2, "done", "", done.meta),
        pf(n + 3, PartRef("source", "late"), '{"url":"https://x"}'),  # after done
    ]
    cont = Continuity(0)
    t = Transcript(SID)
    seen: list[tuple[int, str]] = []
    for f in stream:
        ok, problems = cont.accept(f)
        seen += [(p.from_offset or 0, p.reason) for p in problems]
        if ok:
            t.apply(f)
    assert seen == [(n, "part"), (n + 1, "part"), (n + 3, "part")]  # done's integrity holds
    assert cont.last == n + 3
    entry = t.entries[-1]
    assert entry.finish == "tool_calls"
    assert [(p.part, p.id, p.text) for p in entry.parts] == [
        (p.part, p.id, p.text) for p in records
    ]
    t.apply(stream[-1])  # a transcript refuses a part after its reply ended on its own too
    assert len(entry.parts) == len(records)
    assert t.refused
    assert "after the reply ended" in t.refused[-1]


def test_a_tool_call_with_arguments_that_are_not_json_is_refused_at_its_end() -> None:
    frames, _ = reply()
    broken = [f if f.offset != 9 else pf(9, PartRef("tool-call", "call_1", "delta"), "Osl ")
              for f in frames]  # fmt: skip
    cont = Continuity(0)
    t = Transcript(SID)
    reasons = []
    for f in broken:
        ok, problems = cont.accept(f)
        reasons += [(p.reason, p.detail) for p in problems]
        if ok:
            t.apply(f)
    assert reasons[0][0] == "part"
    assert "not valid JSON" in reasons[0][1]
    assert [r for r, _ in reasons] == ["part", "part", "integrity"]  # its result: no call
    call = t.entries[-1].parts[1]
    assert (call.part, call.done) == ("tool-call", False)  # never shown as a finished call


# ---- the stored reply: GET .../messages (turns and ui) and a transcript loaded from it


def test_a_stored_reply_keeps_text_and_parts_in_order_through_the_messages_page() -> None:
    from worker.chat.store import ConversationView
    from worker.controls import conversation_page, ui_messages

    frames, records = reply()
    live = Transcript(SID)
    for f in frames:
        live.apply(f)
    stored = live.history()[-1]
    assert [d["type"] for d in stored["parts"]] == [
        "reasoning", "text", "tool-call", "tool-result", "text", "data-weather",
    ]  # fmt: skip
    entry = {**stored, "id": f"{SID}-1", "finish": "tool_calls", "from": 1, "to": 16}
    view = ConversationView([entry], None, 1, 16, None, "g1")
    page = conversation_page(SID, view, None, 50, None)
    assert page["messages"][0]["parts"] == stored["parts"]
    loaded = Transcript(SID)
    loaded.load({"messages": [{**page["messages"][0], "turn": 1}]})
    assert [(p.part, p.id, p.text, p.done) for p in loaded.entries[0].parts] == [
        (p.part, p.id, p.text, p.done) for p in records
    ]
    assert loaded.history() == [{k: stored[k] for k in ("role", "content", "turn", "parts")}]
    ui = ui_messages(page["messages"])[0]["parts"]
    assert ui == [
        {"type": "reasoning", "id": "r1", "text": "Let me think", "state": "done"},
        {"type": "text", "text": "Checking", "state": "done"},
        {"type": "tool-weather", "toolCallId": "call_1", "state": "output-available",
         "input": {"city": "Oslo"}, "output": {"temp": 4}},
        {"type": "text", "text": " the weather", "state": "done"},
        {"type": "data-weather", "id": "d1", "data": {"n": 1}},
    ]  # fmt: skip
    text_only = {"role": "assistant", "content": "hi", "turn": 2, "id": "x", "finish": "stop"}
    page = conversation_page(SID, ConversationView([text_only], None, 2, 3, None, "g1"), None,
                             50, None)  # fmt: skip
    assert "parts" not in page["messages"][0]  # a text-only page is what it was
    assert ui_messages(page["messages"])[0]["parts"] == [{"type": "text", "text": "hi"}]
