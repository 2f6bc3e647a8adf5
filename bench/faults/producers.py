"""The nemesis's producers of your own: one Python process (``bench.faults.producer_child``,
the producer API) and one Node process (``bench/producer/soak_producer.mjs``, the
``@tokenrelay/producer`` package) writing turns into sessions of their own while the
faults run, watched by screens like the worker's sessions, killed and started again by
the nemesis's ``producer_kill``. Node is left out, with the reason, where it or the
package's dependencies are missing.

Order of use::

    producers = Producers(stack, run, workdir, sessions=2, seed=1, until=deadline)
    producers.add_sessions()   # sessions and their screens join the run (before they start)
    producers.start()          # the processes
    ... producers.kill(name) / producers.restart(name) ...
    report = await producers.finish()
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.faults.run import Run
from bench.load.viewer import Viewer
from bench.producer.cpu import node_missing
from bench.producer.soak import NODE_PRODUCER
from devstack.demo.stack import Stack
from devstack.procs import Proc
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id

__all__ = ["Producers"]


class Producers:
    """The producer processes of one nemesis run, by name (``producer-py``, ``producer-node``)."""

    def __init__(
        self, stack: Stack, run: Run, workdir: Path, *, sessions: int, seed: int, until: float
    ) -> None:
        self.stack = stack
        self.run = run
        self.workdir = workdir
        self.per_library = sessions
        self.seed = seed
        self.until = until  # time.monotonic() at which the producers stop starting turns
        self.node_missing = node_missing()
        self.sids: dict[str, list[str]] = {}
        self.procs: dict[str, Proc] = {}
        self.outputs: dict[str, list[dict[str, Any]]] = {}
        self.starts: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self.procs)

    def add_sessions(self) -> None:
        """Each library's sessions, and two screens per session (SSE and WebSocket), join
        the run: checked against Redis at the end like the worker's."""
        libraries = ["producer-py"] + ([] if self.node_missing else ["producer-node"])
        for name in libraries:
            self.sids[name] = [new_session_id() for _ in range(self.per_library)]
            for sid in self.sids[name]:
                token = issue_token(self.stack.spec.secret, sid, 7200, time.time())
                self.run.sessions.append((sid, token))
                for transport in ("sse", "ws"):
                    v = Viewer(self.run.http, self.run.relays, sid, token, transport=transport)
                    v.on_frame = self.run._on_frame
                    self.run.viewers.append(v)

    def _argv(self, name: str) -> list[str]:
        spec = {
            "url": self.stack.redis_url,
            "sessions": self.sids[name],
            "duration_s": max(0.0, self.until - time.monotonic()),
            "rate": 30,
            "reply_min": 20,
            "reply_max": 200,
            "seed": self.seed * 1000 + self.starts.get(name, 0),
            "producer_id": f"{name}-{self.starts.get(name, 0)}",
        }
        path = self.workdir / f"{name}-{self.starts.get(name, 0)}.json"
        path.write_text(json.dumps(spec))
        if name == "producer-node":
            return [shutil.which("node") or "node", str(NODE_PRODUCER), str(path)]
        return [sys.executable, "-m", "bench.faults.producer_child", str(path)]

    def _spawn(self, name: str) -> None:
        log = self.workdir / f"{name}-{self.starts.get(name, 0)}.log"
        self.procs[name] = Proc.start(self._argv(name), log=log, name=name)
        self.starts[name] = self.starts.get(name, 0) + 1

    def start(self) -> None:
        for name in self.sids:
            self._spawn(name)

    def kill(self, name: str) -> int:
        """SIGKILL ``name``; its pid."""
        proc = self.procs[name]
        proc.kill()
        return proc.pid

    def restart(self, name: str) -> int | None:
        """Start ``name`` again for the rest of the run; None when the run is (nearly) over."""
        self._collect(name)
        if self.until - time.monotonic() < 3:
            return None
        self._spawn(name)
        return self.procs[name].pid

    def _collect(self, name: str) -> None:
        """Keep what an exited process said (its last line of JSON, if it got that far)."""
        proc = self.procs[name]
        lines = [ln for ln in proc.output().splitlines() if ln.startswith("{")]
        said = json.loads(lines[-1]) if lines else {"exit": proc.returncode}
        self.outputs.setdefault(name, []).append(said)

    async def finish(self) -> dict[str, Any]:
        """Wait for each process to end its last turn (30 s past the run at most, then
        stop it by pid); what each said."""
        for name, proc in self.procs.items():
            await proc.wait(max(0.0, self.until - time.monotonic()) + 30)
            if proc.alive:
                await proc.stop(grace_s=5)
            self._collect(name)
        return {
            "libraries": sorted(self.sids),
            "node_left_out": self.node_missing,
            "sessions": sum(len(s) for s in self.sids.values()),
            "turns": {n: sum(o.get("turns", 0) for o in out) for n, out in self.outputs.items()},
            "errors": {
                n: sum(o.get("error_count", 0) for o in out) for n, out in self.outputs.items()
            },
            "starts": dict(self.starts),
        }
