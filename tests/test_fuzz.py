"""Property tests (hypothesis) of the parsers that read hostile input.

The contracts live in :mod:`bench.fuzz_props` (shared with ``python -m bench.fuzz``,
the million-case run); here hypothesis drives them with structured and arbitrary
inputs, a moderate number of examples for CI (``TOKENRELAY_FUZZ_EXAMPLES`` to change).
Each regression found by fuzzing has a named example test below.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from bench.fuzz_props import (
    check_frame,
)
from relay import frame, sse

EXAMPLES = int(os.environ.get("TOKENRELAY_FUZZ_EXAMPLES", "500"))
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_frame_decode_of_a_str_with_lone_surrogates_is_a_frame_error():
    """Regression (fuzz): msgspec raised UnicodeEncodeError for such a str."""
    with pytest.raises(frame.FrameError):
        frame.decode('{"v":1,"session":"\ud800","turn":0,"offset":1,"kind":"token"}')
    check_frame(b"\xf7s")


def _raw_frame(offset: int, turn: int) -> bytes:
    return (f'{{"v":1,"session":"s","turn":{turn},"offset":{offset},"kind":"token"}}').encode()


@pytest.mark.parametrize("field", ["offset", "turn"])
def test_frame_offsets_past_2_53_are_refused(field):
    """Regression (fuzz): an offset no client can resume from (``Last-Event-ID`` /
    ``from`` stop at 2**53-1, relay.sse.MAX_OFFSET) decoded as a valid frame."""
    assert frame.MAX_INT == sse.MAX_OFFSET
    for value in (2**53, 10**23):
        args = {"offset": 1, "turn": 1, field: value}
        with pytest.raises(frame.FrameError, match="outside"):
            frame.decode(_raw_frame(**args))
    args = {"offset": 1, "turn": 1, field: 2**53 - 1}
    assert getattr(frame.decode(_raw_frame(**args)), field) == 2**53 - 1
