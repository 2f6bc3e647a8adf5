"""`python -m devstack demo` end to end, as `make demo` runs it: one URL serves the page and the
whole HTTP contract; a turn streams through the front door; Ctrl-C (SIGINT) stops every
process the demo started."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.mockengine.reply_length import ReplyLength
from devstack.procs import Proc, free_port, log_line
from tests.support.sse import SSEClient
from tests.support.worker import expected_reply

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _queue_exists(url: str, name: str) -> bool:
    import aio_pika
    import aiormq

    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
    return True


@pytest.mark.timeout(240)
async def test_make_demo_serves_one_url_streams_a_turn_and_stops_everything(
    tmp_path: Path, amqp_or_why: str
) -> None:
    port = free_port()
    out_path = tmp_path / "demo.out"
    logs = tmp_path / "not" / "made" / "yet"  # --log-dir makes a folder that is missing
    # the run's own RabbitMQ, where one can be started: the jobs run too
    jobs = [] if amqp_or_why.startswith("no: ") else ["--amqp", amqp_or_why]
    proc = Proc.start(
        [sys.executable, "-m", "devstack", "demo", "--port", str(port), "--log-dir", str(logs),
         "--first-token-timeout-s", "90", "--engine-profile", "*=slots:8", *jobs],
        log=out_path, name="demo",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    redis_url = ""
    queue: re.Match[bytes] | None = None
    env_file = Path()
    try:
        await proc.ready(log_line(f"open {base}/"), timeout_s=120, every_s=0.2)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(base + "/") as r:
                assert r.status == 200
                assert "text/html" in r.headers["Content-Type"]
            async with http.post(base + "/v1/sessions") as r:
                assert r.status == 201, await r.text()
                session = await r.json()
            sid, token = session["session"], session["token"]
            auth = {"Authorization": f"Bearer {token}"}
            async with http.get(
                f"{base}/v1/sessions/{sid}/events", params={"token": token}
            ) as stream:
                assert stream.status == 200
                sse = SSEClient(stream)
                async with http.post(
                    f"{base}/v1/sessions/{sid}/turns",
                    json={"message": "hello demo", "max_tokens": 12},
                    headers=auth,
                ) as r:
                    assert r.status == 202, await r.text()
                events: list[tuple[str, str, dict[str, Any]]] = []
                async with asyncio.timeout(30):
                    while not events or events[-1][1] not in ("done", "error"):
                        ev = await sse.next_event()
                        assert ev is not None
                        events.append(ev)
                kinds = [kind for _, kind, _ in events]
                assert kinds[0] == "meta", kinds
                assert kinds[-1] == "done", kinds
                assert set(kinds[1:-1]) == {"token"}, kinds
                ids = [int(i) for i, _, _ in events]
                assert ids == list(range(ids[0], ids[0] + len(ids)))  # in order, no gap
                text = "".join(d["text"] for _, kind, d in events if kind == "token")
                prompt = [{"role": "user", "content": "hello demo"}]
                # every token, exactly once (the demo's engines: default reply lengths)
                assert text == expected_reply(prompt, 12, ReplyLength())
            # the rest of the contract at the same URL: readiness, and a relay's refusal
            # of a WebSocket passed on with its status
            async with http.get(base + "/readyz") as r:
                assert r.status == 200, await r.text()
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"{base}/v1/sessions/{sid}/ws?token=forged")
            assert refused.value.status == 403
            async with http.get(base + "/api/stack") as r:
                view = await r.json()
            # the live panel: the workers' /v1/router, read with the demo's admin key; no
            # session id in it (the turn above is placed by its ring point)
            assert view["engines"], view
            assert view["placements"], view
            assert all("session" not in p and p["point"] for p in view["placements"]), view
            assert sid not in json.dumps(view)
            # the banner says the routing flags and how to read the workers' metrics
            said = out_path.read_text()
            assert "routing: cost_aware, route queue 3 x the cap; first-token timeout 90 s" in said
            found = re.search(r"Bearer (\S+)' (http://\S+)/metrics", said)
            assert found is not None, said
            metrics_auth = {"Authorization": f"Bearer {found.group(1)}"}
            async with http.get(found.group(2) + "/metrics", headers=metrics_auth) as r:
                assert r.status == 200
                assert "tokenrelay_worker_turns_total" in await r.text()
            pids = [p["pid"] for p in view["processes"]]
            redis_url = view["redis"]
            # your own backend's settings: a file the terminal names, its owner's only
            sourced = re.search(r"^    set -a; \. (\S+); set \+a$", out_path.read_text(), re.M)
            assert sourced is not None, out_path.read_text()[-3000:]
            env_file = Path(sourced.group(1))
            assert env_file.stat().st_mode & 0o077 == 0
            settings = dict(ln.split("=", 1) for ln in env_file.read_text().splitlines())
            assert settings["TOKENRELAY_REDIS_URL"] == redis_url
            assert settings["TOKENRELAY_BASE"] == base
            assert settings["OPENAI_BASE_URL"] == base + "/v1"
            assert settings["OPENAI_MODEL"] == "mock"
            assert len(settings["TOKENRELAY_SECRET"]) >= 32
            kinds_running = sorted({p["kind"] for p in view["processes"] if p["alive"]})
            jobs_on = b"offline jobs: on" in out_path.read_bytes()  # a RabbitMQ answered
            assert jobs_on == bool(jobs), out_path.read_text()[-3000:]
            # a queue of this run's own, named on the terminal, gone when the demo stops
            queue = re.search(rb"queue (tokenrelay\.demo\.[0-9a-f]+\.jobs) of this run",
                              out_path.read_bytes())  # fmt: skip
            assert (queue is not None) == jobs_on, out_path.read_text()[-3000:]
            want = ["engine", *(["jobworker"] if jobs_on else []), "relay", "worker"]
            assert kinds_running == want, view["processes"]
            if jobs_on:  # a job through the front door: queued, run, its whole result
                async with http.post(
                    f"{base}/v1/jobs",
                    json={"prompt": "a report", "session": sid, "max_tokens": 20},
                    headers=auth,
                ) as r:
                    assert r.status == 202, await r.text()
                    job = (await r.json())["job"]
                last_status: dict[str, Any] = {}
                deadline = time.monotonic() + 60
                while True:
                    assert time.monotonic() < deadline, last_status
                    async with http.get(f"{base}/v1/jobs/{job}", headers=auth) as r:
                        status = await r.json()
                    if status["status"] == "done":
                        break
                    assert status["status"] in ("queued", "running"), status
                    last_status = status
                    await asyncio.sleep(0.2)
                prompt = [{"role": "user", "content": "a report"}]
                assert status["result"] == expected_reply(prompt, 20, ReplyLength())
            # the secret is random per run and reaches the children by environment only
            for p in view["processes"]:
                argv = Path(f"/proc/{p['pid']}/cmdline").read_bytes().split(b"\0")
                assert b"--secret" not in argv, argv
                if p["kind"] == "worker":  # the demo's routing and timeout flags reach it
                    i = argv.index(b"--first-token-timeout-s")
                    assert argv[i + 1] == b"90", argv
                    assert argv[argv.index(b"--engine-profile") + 1] == b"*=slots:8", argv
                environ = Path(f"/proc/{p['pid']}/environ").read_bytes().split(b"\0")
                has_secret = any(e.startswith(b"TOKENRELAY_SECRET=") for e in environ)
                assert has_secret == (p["kind"] != "engine"), p
            # the share link's watch token, minted through the front door, cannot write
            async with http.post(
                f"{base}/v1/sessions/{sid}/tokens", json={"scope": "watch"}, headers=auth
            ) as r:
                assert r.status == 201, await r.text()
                watch = (await r.json())["token"]
            async with http.post(
                f"{base}/v1/sessions/{sid}/turns",
                json={"message": "from a viewer"},
                headers={"Authorization": f"Bearer {watch}"},
            ) as r:
                assert r.status == 403
                assert (await r.json())["error"] == "token_wrong_scope"
            # process control: the token printed to the terminal, same origin only
            printed = re.search(rb"#control=([A-Za-z0-9_-]+)", out_path.read_bytes())
            assert printed is not None, out_path.read_text()[-3000:]
            control = printed.group(1).decode()
            assert control not in str(view)
            kill = base + "/api/kill/engine-1"
            async with http.post(
                kill, headers={"Origin": "http://evil.example", "X-Control-Token": control}
            ) as r:
                assert (r.status, (await r.json())["error"]) == (403, "cross_origin")
            async with http.post(kill, headers={"Origin": base}) as r:
                assert (r.status, (await r.json())["error"]) == (403, "bad_control_token")
            async with http.post(kill, headers={"Origin": base, "X-Control-Token": control}) as r:
                assert r.status == 200, await r.text()
        proc.send(signal.SIGINT)
        assert await proc.wait(60) == 0, out_path.read_text()[-3000:]
        assert b"stopped: every process this demo started has exited" in out_path.read_bytes()
        assert not env_file.exists()  # it holds the secret
        deadline = time.monotonic() + 5
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert [p for p in pids if not _gone(p)] == []
        assert (logs / "relay-1.log").is_file()  # kept where asked
        if queue is not None:
            assert not await _queue_exists(jobs[1], queue.group(1).decode())
        redis_port = int(redis_url.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # the first master, like every node, has stopped
            await asyncio.open_connection("127.0.0.1", redis_port)
    finally:
        if proc.alive:  # stop it by pid, whatever failed: Ctrl-C first, as a user would
            proc.send(signal.SIGINT)
            if await proc.wait(30) is None:
                await proc.stop(grace_s=5)
