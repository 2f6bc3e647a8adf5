"""A compacted join: a replay's token frames (and each part's delta frames), each finished
run of one turn merged into one.

Pure (relay.protocol.frame and the deliveries of :mod:`relay.edge.core.resume`): no
asyncio, no clock. A watch that asked for it (``?compact=1``) passes the frames its
replay emits, page by page, through one :class:`Compactor` until the replay has caught
up; the live frames after that are never touched.

The rule: a run of consecutive token frames of one turn (offsets ``n, n+1, ...``) that
something else follows (the turn's ``done`` or ``error``, a part frame, a ``gap``, a
``reset``, the next turn's ``meta``) is closed: it becomes one merged token frame
(:func:`relay.protocol.frame.merge_tokens`: its text the run's texts joined, its offset
the run's last, ``meta.merged`` and ``meta.from``), so that a finished turn arrives as at
most three frames: ``meta``, one token frame, its terminal frame. Each part merges on its
own the same way: a run of consecutive ``delta`` frames of one part (one reasoning, one
tool call's arguments: :func:`relay.protocol.frame.merge_key`) becomes one delta frame,
so a finished tool call arrives as ``start``, one ``delta``, ``end`` even when text and
other calls streamed around it (their runs merge apart). The run the replay ends
on is still open (its turn may be running): it is held across pages, and when the
replay catches up it goes out as it is, frame by frame (``merge_open``: merged too, for
a stream that is only the running turn, the AI SDK's).

Order of calls::

    c = Compactor()                 # or Compactor(merge_open=True)
    out = c.feed(page_frames)       # each replay step's frames, in order
    out = c.flush()                 # the replay caught up: the open run
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from relay.edge.core.resume import Delivery
from relay.protocol.frame import Frame, decode, encode, first_offset, merge_key, merge_tokens

__all__ = ["Compactor"]


class Compactor:
    """See the module docstring. ``merged``: the frames the merges saved (a run of n
    frames merged saves n - 1)."""

    __slots__ = ("_run", "merge_open", "merged")

    def __init__(self, *, merge_open: bool = False) -> None:
        self.merge_open = merge_open
        self.merged = 0
        self._run: list[tuple[Frame, Delivery]] = []  # the open run: decoded, as delivered

    def feed(
        self, ds: Sequence[Delivery], decoded: Iterable[tuple[Delivery, Frame]] = ()
    ) -> list[Delivery]:
        """``ds`` (a replay step's frames, in order) with every run they close merged;
        the run they end on is held. ``decoded``: deliveries whose frame the caller has
        decoded already (the page read), so that they are not decoded again."""
        out: list[Delivery] = []
        run = self._run
        known = {id(d): f for d, f in decoded}
        for d in ds:
            f = None
            if d.kind == "token" or d.kind == "part":
                f = known.get(id(d)) or decode(d.data)
            key = merge_key(f) if f is not None else None
            if f is None or key is None:
                self._close(out)
                out.append(d)
                continue
            if run and (f.turn != run[-1][0].turn or first_offset(f) != run[-1][0].offset + 1
                        or merge_key(run[-1][0]) != key):  # fmt: skip
                self._close(out)
            run.append((f, d))
        return out

    def flush(self) -> list[Delivery]:
        """The run held (the replay caught up): as it is, or merged with ``merge_open``."""
        out: list[Delivery] = []
        if self.merge_open:
            self._close(out)
        else:
            out.extend(d for _, d in self._run)
            self._run.clear()
        return out

    def _close(self, out: list[Delivery]) -> None:
        run = self._run
        if len(run) == 1:
            out.append(run[0][1])
        elif run:
            m = merge_tokens([f for f, _ in run])
            last = run[-1][1]
            out.append(Delivery(m.offset, last.kind, encode(m), last.ts, last.received_mono_ms,
                                last.gen))  # fmt: skip
            self.merged += len(run) - 1
        run.clear()
