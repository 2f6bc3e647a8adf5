"""Append-aware conflation (pure): merged token frames keep text, order and offsets."""

from __future__ import annotations

import pytest

from relay.edge.core.resume import Delivery
from relay.edge.core.watch import conflate
from relay.protocol.frame import Frame, decode, encode, first_offset, merge_tokens


def tok(offset: int, text: str, turn: int = 1) -> Frame:
    return Frame(session="s", turn=turn, offset=offset, kind="token", text=text)


def test_merge_keeps_the_text_and_the_last_offset():
    m = merge_tokens([tok(3, "a"), tok(4, "b"), tok(5, "c")])
    assert (m.text, m.offset, m.meta) == ("abc", 5, {"merged": 3, "from": 3})
    assert first_offset(m) == 3


def test_merged_frames_merge_again_cumulatively():
    once = merge_tokens([tok(3, "a"), tok(4, "b")])
    twice = merge_tokens([once, merge_tokens([tok(5, "c"), tok(6, "d")]), tok(7, "e")])
    assert (twice.text, twice.offset, twice.meta) == ("abcde", 7, {"merged": 5, "from": 3})


@pytest.mark.parametrize(
    "frames",
    [
        [tok(3, "a"), tok(5, "b")],  # a hole
        [tok(3, "a"), tok(4, "b", turn=2)],  # two turns
        [tok(3, "a"), Frame(session="s", turn=1, offset=4, kind="done")],
    ],
)
def test_only_consecutive_tokens_of_one_turn_merge(frames):
    with pytest.raises(ValueError, match="merge"):
        merge_tokens(frames)


def test_conflate_folds_earlier_merges_into_one_frame_per_run():
    first = merge_tokens([tok(1, "a"), tok(2, "b")])
    pending = [Delivery(f.offset, f.kind, encode(f)) for f in (first, tok(3, "c"), tok(4, "d"))]
    done = Frame(session="s", turn=1, offset=5, kind="done")
    out, runs = conflate([*pending, Delivery(5, "done", encode(done))])
    assert runs == 1
    assert [d.offset for d in out] == [4, 5]
    merged = decode(out[0].data)
    assert (merged.text, merged.meta) == ("abcd", {"merged": 4, "from": 1})
