"""A compacted join's merge (relay.edge.core.compact), pure: finished runs of one turn's
token frames merged, the run a replay ends on held and then passed as it is."""

from __future__ import annotations

from typing import Any

from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery, gap_delivery
from relay.protocol.frame import Frame, decode, encode, first_offset

SID = "compact"


def d(offset: int, kind: str, turn: int, text: str = "") -> Delivery:
    meta: dict[str, Any] = {"gen": "g1"}
    f = Frame(session=SID, turn=turn, offset=offset, kind=kind, text=text, epoch=1, ts=1,  # type: ignore[arg-type]
              meta=meta)  # fmt: skip
    return Delivery(offset, kind, encode(f), 1, 0, "g1")


def turn(start: int, turn_no: int, tokens: int, *, done: bool = True) -> list[Delivery]:
    """meta, ``tokens`` token frames, done (unless not ``done``), from offset ``start``."""
    out = [d(start, "meta", turn_no)]
    out += [d(start + 1 + i, "token", turn_no, f"{turn_no}.{i} ") for i in range(tokens)]
    if done:
        out.append(d(start + 1 + tokens, "done", turn_no))
    return out


def check_continuous(ds: list[Delivery]) -> None:
    last = 0
    for x in ds:
        f = decode(x.data)
        assert first_offset(f) == last + 1, (last, f)
        last = f.offset


def test_a_finished_turn_is_three_frames_and_the_same_text() -> None:
    frames = turn(1, 1, 10) + turn(13, 2, 4)
    c = Compactor()
    out = c.feed(frames) + c.flush()
    assert [x.kind for x in out] == ["meta", "token", "done"] * 2
    check_continuous(out)
    merged = decode(out[1].data)
    assert merged.text == "".join(f"1.{i} " for i in range(10))
    assert merged.meta == {"merged": 10, "from": 2, "gen": "g1"}
    assert (merged.offset, out[1].offset, out[1].gen) == (11, 11, "g1")
    assert c.merged == 9 + 3


def test_the_running_turn_is_held_across_pages_then_passed_as_it_is() -> None:
    frames = turn(1, 1, 6) + turn(9, 2, 5, done=False)
    c = Compactor()
    out: list[Delivery] = []
    for i in range(0, len(frames), 4):  # pages of 4: runs cut by page ends
        out += c.feed(frames[i : i + 4])
    assert [x.kind for x in out] == ["meta", "token", "done", "meta"]
    rest = c.flush()
    assert [x.offset for x in rest] == [10, 11, 12, 13, 14]  # frame by frame
    check_continuous(out + rest)


def test_merge_open_merges_the_running_turn_too() -> None:
    c = Compactor(merge_open=True)
    out = c.feed(turn(1, 1, 5, done=False)) + c.flush()
    assert [x.kind for x in out] == ["meta", "token"]
    assert decode(out[1].data).meta == {"merged": 5, "from": 2, "gen": "g1"}


def test_a_gap_or_a_hole_ends_a_run() -> None:
    frames = turn(1, 1, 3, done=False)
    frames.append(gap_delivery(SID, 5, 8, "g1"))  # offsets 5..7 gone: the gap is at 7
    frames += [d(8, "token", 1, "x"), d(9, "token", 1, "y"), d(11, "token", 1, "z")]
    frames.append(d(12, "done", 1))
    c = Compactor()
    out = c.feed(frames) + c.flush()
    assert [(x.kind, x.offset) for x in out] == [
        ("meta", 1), ("token", 4), ("gap", 7), ("token", 9), ("token", 11), ("done", 12)
    ]  # fmt: skip
    assert decode(out[3].data).meta == {"merged": 2, "from": 8, "gen": "g1"}


def test_one_token_frame_stays_as_it_was() -> None:
    frames = turn(1, 1, 1)
    c = Compactor()
    assert c.feed(frames) == frames
    assert c.merged == 0
