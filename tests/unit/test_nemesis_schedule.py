"""The nemesis's schedule (bench.faults.schedule): drawn from a seed, in bursts that
overlap, inside the run's window."""

from __future__ import annotations

import pytest

from bench.faults.schedule import HOLD_S, KINDS, Fault, overlapping, plan


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    a = plan(seed=7, duration_s=1800, bursts=25)
    assert a == plan(seed=7, duration_s=1800, bursts=25)
    assert a != plan(seed=8, duration_s=1800, bursts=25)


def test_bursts_of_two_to_four_faults_most_of_which_overlap() -> None:
    faults = plan(seed=3, duration_s=1800, bursts=25)
    assert 50 <= len(faults) <= 100
    assert overlapping(faults) >= len(faults) * 0.6
    assert {f.kind for f in faults} <= set(KINDS)
    assert len({f.kind for f in faults}) >= 8  # 25 bursts draw nearly every kind
    for f in faults:
        lo, hi = HOLD_S[f.kind]
        assert lo <= f.hold_s <= hi


def test_faults_start_after_the_warm_up_and_leave_the_quiet_end() -> None:
    faults = plan(seed=1, duration_s=180, bursts=4, warm_s=5, quiet_s=20)
    assert faults == sorted(faults, key=lambda f: (f.at_s, f.kind))
    assert all(f.at_s >= 5 and f.end_s <= 160 for f in faults)


def test_only_the_kinds_asked_for() -> None:
    faults = plan(seed=1, duration_s=300, bursts=5, kinds=["relay_kill", "storm"])
    assert {f.kind for f in faults} <= {"relay_kill", "storm"}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"kinds": ["meteor"]}, "unknown fault kinds: meteor"),
        ({"kinds": []}, "no fault kinds"),
        ({"duration_s": 20}, "no room"),
        ({"bursts": 0}, "no room"),
    ],
)
def test_a_schedule_that_cannot_be_is_refused(kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"seed": 1, "duration_s": 180, "bursts": 4, **kwargs}
    with pytest.raises(ValueError, match=words):
        plan(**args)  # type: ignore[arg-type]


def test_overlap_counts_only_faults_that_share_time() -> None:
    apart = [Fault(0, "relay_kill", 1.0, 0), Fault(10, "relay_kill", 1.0, 0)]
    assert overlapping(apart) == 0
    together = [Fault(0, "relay_kill", 5.0, 0), Fault(3, "failover", 0.0, 0)]
    assert overlapping(together) == 2  # a failover counts as an act of about 2 s
