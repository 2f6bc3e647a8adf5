"""What every system in the whole-path benchmark provides, and what one round of it
measures: the seam between the headline runner and each system's driver.

A system (tokenrelay, Socket.IO with its sharded adapter, Vercel's ``resumable-stream``)
is started once per run on the same Redis, then driven through rounds; each round is one
:class:`Phase` on fresh sessions and gives one :class:`RoundFigures`. The runner alternates
systems round by round and takes medians; it never looks inside a system.

Whole path means every process a token crosses between the producer's first byte and the
screen: the producer process(es), every Redis node (masters and replicas, from ``INFO
cpu``), and the server that holds the readers' connections (a relay, a Socket.IO server;
none for ``resumable-stream``, whose readers read from the producer). Each participant's
CPU seconds are measured over the same window, so shares add up to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["Phase", "PhaseKind", "RoundFigures", "System"]

PhaseKind = Literal["steady", "resume_storm", "llm", "llm_storm"]


@dataclass(frozen=True)
class Phase:
    """One phase: ``sessions`` streams, ``viewers`` readers on each, ``tokens_per_s`` tokens
    published per second across all sessions, for ``seconds``. ``resume_storm``: every
    reader drops at once mid-phase and reconnects, resuming from its last token. ``llm``
    and ``llm_storm``: the same at LLM rates, each session replying at ``session_rate``
    tokens/s with gaps between turns (:mod:`bench.peers.llmshape`, drawn per round from
    its seed; ``tokens_per_s`` is then the expected mean over all sessions)."""

    name: str
    sessions: int
    viewers: int
    tokens_per_s: float
    seconds: float
    kind: PhaseKind = "steady"
    session_rate: float = 0.0

    @property
    def storm(self) -> bool:
        return self.kind in ("resume_storm", "llm_storm")

    @property
    def llm(self) -> bool:
        return self.kind in ("llm", "llm_storm")


@dataclass
class RoundFigures:
    """One round of one phase on one system. ``cpu_s`` maps a participant (``producer``,
    ``redis``, ``server``) to its CPU seconds over the round's window."""

    system: str
    phase: str
    published: int  # tokens the producer(s) published
    delivered: int  # token deliveries the readers received (each reader counts)
    expected: int  # deliveries that should have arrived (published x readers)
    lost: int  # expected deliveries never received
    duplicated: int  # deliveries received more than once (by offset or sequence)
    cpu_s: dict[str, float] = field(default_factory=dict)
    p50_ms: float = 0.0  # producer's send time to the reader's arrival
    p99_ms: float = 0.0
    behind_s: float = 0.0  # last delivery after the producer stopped: > 1 s is not keeping up
    wall_s: float = 0.0
    notes: dict[str, float | int | str] = field(default_factory=dict)
    # Redis's busiest commands over the window (INFO commandstats, every node by role):
    # role, command, calls_per_token and us_per_token per delivered token
    commands: list[dict[str, Any]] = field(default_factory=list)

    def us_per_delivered(self) -> dict[str, float]:
        """Each participant's CPU per delivered token (µs), and ``whole``: their sum."""
        n = max(self.delivered, 1)
        out = {k: v * 1e6 / n for k, v in self.cpu_s.items()}
        out["whole"] = sum(self.cpu_s.values()) * 1e6 / n
        return out

    def kept_up(self) -> bool:
        return self.lost == 0 and self.behind_s <= 1.0


class System(Protocol):
    """A system under test. ``guarantee`` is printed beside its figures: what a reader
    gets when it resumes, after the end, and when the producer dies."""

    name: str
    guarantee: str

    async def start(self) -> None: ...

    async def round(self, phase: Phase, seed: int) -> RoundFigures: ...

    async def stop(self) -> None: ...
