"""TLS to Redis, end to end, and what the processes say about Redis (hostile-suite style).

A TLS-only local cluster (``LocalCluster(tls=...)``: no plain port, TLS on the cluster
bus and for replication, client certificates required, a password) with certificates
from a throwaway CA made in the test (``tests.support.tls_certs``). The relay, the worker and a
mock engine run as subprocesses (``python -m tokenrelay ...``), stopped by pid; the Redis
URL with its password reaches them through the environment, the TLS files through the
``--redis-ca`` / ``--redis-cert`` / ``--redis-key`` flags.

Every test keeps a bystander session streaming through the same relay and worker, which
must receive every frame of both of its turns whatever the hostile case did.
Skipped, with the reason, when the server binary was built without TLS or there is no
``openssl`` command to make the certificates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from devstack.cluster.binary import find_server_binary
from devstack.cluster.form import ClusterError
from devstack.cluster.launcher import ClusterInfo, LocalCluster
from devstack.cluster.tls import ClusterTLS, tls_support
from devstack.mockengine.reply_length import ReplyLength
from devstack.procs import Proc, free_port, stop_all
from relay.protocol.keys import engine_key, live_channel
from relay.protocol.slotmap import slot_of
from tests.support.cli import devstack, run_cli, tokenrelay
from tests.support.relay import STEP, wait_ready
from tests.support.sse import SSEClient
from tests.support.tls_certs import make_ca, make_pki, openssl_missing
from tests.support.worker import expected_reply

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PASSWORD = "tls-pw-" + secrets.token_hex(12)
SECRET = secrets.token_hex(32)


@dataclass
class TLSCluster:
    local: LocalCluster
    info: ClusterInfo
    pki: ClusterTLS

    @property
    def url(self) -> str:
        return self.info.url.replace("rediss://", f"rediss://default:{PASSWORD}@", 1)

    def flags(self, ca: str | None = None) -> list[str]:
        return [
            "--redis-ca", ca or self.pki.ca,
            "--redis-cert", self.pki.client_cert,
            "--redis-key", self.pki.client_key,
        ]  # fmt: skip


@pytest.fixture(scope="module")
async def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TLSCluster]:
    why = openssl_missing()
    if why:
        pytest.skip(why)
    try:
        binary = find_server_binary()
    except ClusterError as exc:
        pytest.skip(f"no Redis server binary: {exc}")
    why = tls_support(binary)
    if why:
        pytest.skip(why)
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    local = LocalCluster(masters=3, replicas=1, tls=pki, password=PASSWORD)
    try:
        info = await local.start()
        yield TLSCluster(local, info, pki)
    finally:
        await local.stop()


@dataclass
class Child:
    proc: Proc
    base: str = ""

    @property
    def name(self) -> str:
        return self.proc.name

    def text(self) -> str:
        return self.proc.output()


@dataclass
class Procs:
    """Subprocesses of one test, each stopped by pid on the way out."""

    tmp: Path
    env: dict[str, str]
    running: list[Child] = field(default_factory=list)

    async def start(self, name: str, *args: str, port: int = 0) -> Child:
        argv = devstack(*args) if args[0] == "engine" else tokenrelay(*args)  # the mock engine
        proc = Proc.start(argv, log=self.tmp / f"{name}.log", env=self.env, name=name)
        p = Child(proc, f"http://127.0.0.1:{port}" if port else "")
        self.running.append(p)
        return p

    async def exits(self, name: str, *args: str) -> tuple[int, str]:
        """Run a process that must refuse to start: its exit code and output."""
        ran = await run_cli(tokenrelay(*args), env=self.env, timeout_s=STEP * 3, merge=True)
        return ran.code, ran.out

    async def stop(self) -> None:
        await stop_all([p.proc for p in reversed(self.running)], grace_s=15)


@contextlib.asynccontextmanager
async def procs(tmp: Path, env: dict[str, str]) -> AsyncIterator[Procs]:
    ps = Procs(tmp, {**os.environ, **env})
    try:
        yield ps
    finally:
        await ps.stop()


ENGINE_REPLIES = ReplyLength()  # engine processes answer at their default lengths


class Viewer:
    """One session: created on the worker, watched over SSE on the relay from offset 0."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        worker: str,
        relay: str,
        reply: ReplyLength = ENGINE_REPLIES,  # the engines' reply lengths
    ) -> None:
        self.http, self.worker, self.relay, self.reply = http, worker, relay, reply
        self.sid = self.token = ""
        self.resp: aiohttp.ClientResponse | None = None
        self.sse: SSEClient | None = None
        self.prompt: list[dict[str, str]] = []
        self.texts: list[str] = []
        self._max_tokens = 16

    async def open(self) -> Viewer:
        async with self.http.post(self.worker + "/v1/sessions") as r:
            assert r.status == 201, await r.text()
            body = await r.json()
        self.sid, self.token = body["session"], body["token"]
        self.resp = await self.http.get(
            f"{self.relay}/v1/sessions/{self.sid}/events",
            headers={"Authorization": f"Bearer {self.token}", "Last-Event-ID": "0"},
        )
        assert self.resp.status == 200, await self.resp.text()
        self.sse = SSEClient(self.resp)
        return self

    async def post(self, message: str, max_tokens: int = 16) -> None:
        async with self.http.post(
            f"{self.worker}/v1/sessions/{self.sid}/turns",
            json={"message": message, "max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {self.token}"},
        ) as r:
            assert r.status == 202, await r.text()
        self.prompt.append({"role": "user", "content": message})
        self._max_tokens = max_tokens

    async def until_done(self) -> None:
        """Read one turn to its terminal frame; its text must be the engine's reply."""
        assert self.sse is not None
        kinds: list[str] = []
        text = ""
        async with asyncio.timeout(STEP * 3):
            while not kinds or kinds[-1] not in ("done", "error"):
                ev = await self.sse.next_event()
                assert ev is not None, "the stream ended"
                kinds.append(ev[1])
                text += ev[2].get("text", "") if ev[1] == "token" else ""
        assert kinds[0] == "meta", kinds
        assert kinds[-1] == "done", kinds
        assert text == expected_reply(self.prompt, self._max_tokens, self.reply)
        self.prompt.append({"role": "assistant", "content": text})
        self.texts.append(text)

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()


async def _stack(ps: Procs, c: TLSCluster) -> tuple[Child, Child]:
    """A mock engine, a worker and a relay on the TLS cluster; (worker, relay), ready."""
    e_port, w_port, r_port = free_port(), free_port(), free_port()
    await ps.start(  # announces itself over TLS too (its heartbeat is checked below)
        "engine", "engine", "--port", str(e_port), "--id", "tls-engine",
        "--redis", c.url, *c.flags(),
    )  # fmt: skip
    worker = await ps.start(
        "worker", "worker", "--port", str(w_port), "--worker-id", "tls-worker",
        "--engine", f"http://127.0.0.1:{e_port}", *c.flags(), port=w_port,
    )  # fmt: skip
    relay = await ps.start(
        "relay", "relay", "--port", str(r_port), "--relay-id", "tls-edge",
        "--log-level", "INFO", *c.flags(), port=r_port,
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for p in (worker, relay):
            try:
                await wait_ready(http, p.base, 30)
            except TimeoutError:
                raise AssertionError(f"{p.name} not ready: {p.text()[-2000:]}") from None
    return worker, relay


async def _subscriber_nodes(c: TLSCluster, relay_id: str) -> set[int]:
    """Ports of the masters on which the relay's shard subscriber holds a connection."""
    ports = set()
    for node in c.info.masters:
        client = aioredis.Redis(host=node.host, port=node.port, **c.local.client_kwargs())
        try:
            clients = await client.client_list()
        finally:
            await client.aclose()
        if any(cl.get("name") == f"tokenrelay-sub:{relay_id}" for cl in clients):
            ports.add(node.port)
    return ports


async def _heartbeat(c: TLSCluster, engine_id: str) -> bool:
    """The mock engine's heartbeat hash, written over TLS, is in the cluster."""
    client = aioredis.RedisCluster(
        host=c.info.masters[0].host, port=c.info.masters[0].port, **c.local.client_kwargs()
    )
    try:
        return bool(await client.exists(engine_key(engine_id)))
    finally:
        await client.aclose()


async def _master_of(c: TLSCluster, sid: str) -> int:
    masters = await c.local.masters_now()
    slot = slot_of(live_channel(sid))
    return next(port for port, slots in masters.items() if slot in slots)


@pytest.mark.timeout(240)
async def test_a_turn_streams_over_tls_and_what_cannot_do_tls_refuses_to_start(
    tls_cluster: TLSCluster, tmp_path: Path
) -> None:
    c = tls_cluster
    env = {"TOKENRELAY_REDIS_URL": c.url, "TOKENRELAY_SECRET": SECRET}
    other_ca = make_ca(tmp_path / "other", "other-ca")[0]
    async with (
        procs(tmp_path, env) as ps,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        worker, relay = await _stack(ps, c)
        bystander = await Viewer(http, worker.base, relay.base).open()
        viewer = await Viewer(http, worker.base, relay.base).open()
        try:
            await bystander.post("I am the bystander")
            await viewer.post("hello over TLS", max_tokens=24)
            await viewer.until_done()
            await bystander.until_done()
            # the relay's shard subscriber reads each session's channel on its master,
            # over TLS: the nodes have no plain port at all
            assert await _heartbeat(c, "tls-engine")
            subscribed = await _subscriber_nodes(c, "tls-edge")
            assert await _master_of(c, viewer.sid) in subscribed
            assert await _master_of(c, bystander.sid) in subscribed

            # what cannot do TLS (or cannot do it as asked) refuses at start, one line
            # (a relay without --fail-fast would keep retrying instead)
            await bystander.post("and my second turn")
            cases: list[tuple[str, list[str], int, str]] = [
                ("relay-untrusted-ca", ["relay", "--port", "0", "--fail-fast",
                 *c.flags(str(other_ca))], 1, "certificate verify failed"),
                ("relay-plain-url", ["relay", "--port", "0", "--fail-fast", "--redis",
                 c.info.url.replace("rediss://", f"redis://default:{PASSWORD}@")], 1,
                 "cannot connect to Redis"),
                ("relay-ca-on-plain-url", ["relay", "--port", "0", "--redis",
                 "redis://127.0.0.1:7000", "--redis-ca", c.pki.ca], 2, "need a rediss:// URL"),
                ("relay-cert-without-key", ["relay", "--port", "0", "--redis-ca", c.pki.ca,
                 "--redis-cert", c.pki.client_cert], 2, "--redis-cert and --redis-key go together"),
                ("relay-missing-ca", ["relay", "--port", "0", "--redis-ca",
                 str(tmp_path / "nope.pem")], 2, "no such readable file"),
                ("worker-untrusted-ca", ["worker", "--port", "0", "--engine",
                 "http://127.0.0.1:9", *c.flags(str(other_ca))], 1, "certificate verify failed"),
                ("worker-ca-on-plain-url", ["worker", "--port", "0", "--engine",
                 "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:7000", "--redis-ca",
                 c.pki.ca], 2, "need a rediss:// URL"),
            ]  # fmt: skip
            for name, argv, code, words in cases:
                got, out = await ps.exits(name, *argv)
                lines = [ln for ln in out.splitlines() if ln.strip()]
                assert got == code, (name, out[-2000:])
                assert lines[-1].startswith("error: "), (name, out[-2000:])
                assert words in lines[-1], (name, lines[-1])
                assert "Traceback" not in out, (name, out[-2000:])
                assert PASSWORD not in out, name
            await bystander.until_done()
            assert len(bystander.texts) == 2
        finally:
            viewer.close()
            bystander.close()
    # the password never reached a log; the relay logs the URL masked
    logs = {p.name: p.text() for p in ps.running}
    assert f"rediss://default:***@{c.info.masters[0].host}" in logs["relay"]
    for name, text in logs.items():
        assert PASSWORD not in text, name
        assert "Traceback" not in text, (name, text[-2000:])
