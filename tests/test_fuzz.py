"""Property tests (hypothesis) of the parsers that read hostile input.

The contracts live in :mod:`bench.fuzz_props` (shared with ``python -m bench.fuzz``,
the million-case run); here hypothesis drives them with structured and arbitrary
inputs, a moderate number of examples for CI (``TOKENRELAY_FUZZ_EXAMPLES`` to change).
Each regression found by fuzzing has a named example test below.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.fuzz_props import (
    NOW,
    SECRET,
    VALID_SID,
    VALID_TOKEN,
    check_frame,
    check_offset,
    check_session,
    check_token,
    hash_tag,
)
from relay import auth, frame, keys, sse

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
