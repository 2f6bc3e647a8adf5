"""The Kubernetes manifests' containers, run here as the kubelet would run them.

Each container of deploy/k8s (mock engine, worker, relay) starts as a local process with
the manifest's args and environment (``$(VAR)`` expanded from its env and the shared
config), except what only a cluster gives: the Redis URL is the test cluster's, pods
bind 127.0.0.1 on a free port instead of 0.0.0.0:8000 (the engine announces that port).
Then: the probes' paths answer 200, the worker finds the engine through its announcement
(no --engine given), a turn posted to the worker streams through the relay, and on
SIGTERM (what the kubelet sends after preStop) each process ends within its
terminationGracePeriodSeconds minus the preStop sleep, the relay first telling its
streams to reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import Proc, free_port
from tests.deploy.test_k8s import OBJECTS, _container, _expand, _find, _pod_env, _prestop_s

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _argv(container: dict[str, Any], env: dict[str, str], port: int) -> list[str]:
    args = _expand(container.get("args", []), env)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = value
    if "--announce-url" in args:  # the pod's port 8000 is this process's free port
        i = args.index("--announce-url") + 1
        args[i] = args[i].replace(":8000", f":{port}")
    command = container.get("command", ["python", "-m", "tokenrelay"])  # else the image's
    assert command[0] == "python", command
    return [sys.executable, *command[1:], *args]


class Pod:
    """One container as a process; stopped by its pid."""

    def __init__(self, name: str, kind: str, workload: str, cluster: ClusterInfo, tmp: Path):
        self.name = name
        self.spec = _find(OBJECTS, kind, workload)
        self.container = _container(self.spec)
        self.port = free_port()
        env = _pod_env(self.container)
        env.update(
            TOKENRELAY_REDIS_URL=cluster.url,
            TOKENRELAY_HOST="127.0.0.1",
            TOKENRELAY_PORT=str(self.port),
        )
        if "POD_IP" in env:
            env["POD_IP"] = "127.0.0.1"
        env["POD_NAME"] = f"k8s-{name}-{os.getpid()}"  # unique in the shared cluster
        if "TOKENRELAY_RELAY_ID" in env:
            env["TOKENRELAY_RELAY_ID"] = env["POD_NAME"]
        self.env = env
        self.log = tmp / f"{name}.log"
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = _argv(self.container, self.env, self.port)
        self.proc = Proc.start(
            argv, log=self.log, append=True, name=self.name,
            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    def probe(self, kind: str) -> str:
        return str(self.container[kind]["httpGet"]["path"])

    async def wait_ok(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            assert self.proc.alive, self.log.read_text()[-3000:]
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with http.get(self.url + path) as r:
                    if r.status == 200:
                        return
            assert time.monotonic() < deadline, f"{self.name}{path}: " + self.log.read_text()
            await asyncio.sleep(0.1)

    def grace_s(self) -> float:
        spec = self.spec["spec"]["template"]["spec"]
        prestop = _prestop_s(self.container) if "lifecycle" in self.container else 0.0
        return float(spec["terminationGracePeriodSeconds"]) - prestop

    async def terminate(self) -> float:
        """SIGTERM; seconds until the process exited (killed past its grace period)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send(signal.SIGTERM)
        await self.proc.wait(self.grace_s())
        elapsed = time.monotonic() - t0
        self.kill()
        return elapsed

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # by pid; reaps it


@pytest.mark.timeout(240)
async def test_the_pods_start_serve_a_turn_and_drain_within_their_grace(
    cluster: ClusterInfo, tmp_path: Path
) -> None:
    engine = Pod("engine", "StatefulSet", "mock-engine", cluster, tmp_path)
    worker = Pod("worker", "Deployment", "tokenrelay-worker", cluster, tmp_path)
    relay = Pod("relay", "Deployment", "tokenrelay-relay", cluster, tmp_path)
    pods = (engine, worker, relay)
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        for pod in pods:
            pod.start()
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await engine.wait_ok(http, engine.probe("readinessProbe"))
            for pod in (worker, relay):  # the worker is ready once it found the engine
                await pod.wait_ok(http, pod.probe("livenessProbe"))
                await pod.wait_ok(http, pod.probe("readinessProbe"))
            async with http.post(worker.url + "/v1/sessions") as r:
                assert r.status == 201
                session = await r.json()
            sid, auth = session["session"], {"Authorization": f"Bearer {session['token']}"}
            stream = await http.get(
                f"{relay.url}/v1/sessions/{sid}/events",
                headers={**auth, "Last-Event-ID": "0"},
                timeout=aiohttp.ClientTimeout(total=60),
            )
            assert stream.status == 200
            async with http.post(
                f"{worker.url}/v1/sessions/{sid}/turns", json={"message": "hi"}, headers=auth
            ) as r:
                assert r.status == 202, await r.text()
            seen = b""
            while b"event: done" not in seen and b"event: error" not in seen:
                seen += await asyncio.wait_for(stream.content.readany(), 30)
            assert b"event: done" in seen, seen.decode(errors="replace")[-2000:]
            assert b"event: token" in seen

            relay_s = await relay.terminate()  # the stream is open: the relay drains it
            rest = await asyncio.wait_for(stream.content.read(), 10)
            assert b": close relay_shutdown" in rest
            stream.release()
        worker_s = await worker.terminate()
        await engine.terminate()
        assert relay_s < relay.grace_s(), relay.log.read_text()[-3000:]
        assert worker_s < worker.grace_s(), worker.log.read_text()[-3000:]
    finally:
        for pod in pods:
            pod.kill()
