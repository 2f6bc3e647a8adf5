"""``python -m devstack demo``: the whole stack behind one URL, stopped by Ctrl-C.

Starts a local Redis Cluster (3 masters + 3 replicas), 3 mock engines (or the engine
URLs given with ``--engine``), 2 relays, 2 workers, and, where a RabbitMQ broker answers
(``--amqp``, default the local one), a job worker for offline jobs (each a child process,
stopped by pid) and, in this process, the front door that serves the page and spreads requests
over relays and workers without stickiness.

The token secret comes from ``TOKENRELAY_SECRET`` when set (``make demo`` sets a random
one per run), else is generated here; either way the children get it in their
environment, never on a command line. A weak or example secret is refused (exit 2).

The front door's process control (the page's kill/restart buttons) needs a token made per
run and printed only here, on the terminal (see :mod:`devstack.demo.frontdoor`).

Settings (:class:`DemoSettings`): every flag also reads ``TOKENRELAY_DEMO_<NAME>`` (the
demo's own prefix: its children inherit its environment, and a relay or worker must not
take the demo's ``--port``); the secret is ``TOKENRELAY_SECRET`` and has no flag. A front
door port taken by another program is found before anything starts: one line names it and
a free one to pick instead, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar

import aiohttp
import msgspec
from aiohttp import web

from devstack.cluster.form import ClusterError
from devstack.demo.backend import ENV_FILE, backend_env, write_env_file
from devstack.demo.frontdoor import FrontDoor, make_frontdoor_app
from devstack.demo.stack import Stack, StackError, StackSpec
from relay.broker.rediscluster.connect import mask_url
from relay.protocol.auth import DEFAULT_KID, WeakSecret, check_secret
from relay.service import runtime, settings
from relay.service.httpguard import ConnLimits, GuardedSite, guard_app
from relay.service.settings import ConfigError, Host, opt
from worker.jobs.queue import QueueNames
from worker.routing.policy import DEFAULT_QUEUE, DEFAULT_ROUTING, ROUTING_POLICIES
from worker.routing.profile import parse_profile_arg

__all__ = [
    "DemoSettings",
    "PortBusy",
    "banner",
    "check_port",
    "openai_snippet",
    "register",
    "run_demo",
    "stack_view",
]

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"


class DemoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The demo's flags and environment (``TOKENRELAY_DEMO_<FIELD>``), declared once."""

    env_prefix: ClassVar[str] = "TOKENRELAY_DEMO_"

    host: Host = "127.0.0.1"
    port: Annotated[
        int, opt("port of the front door, the one URL to open (0: any free port)", ge=0, le=65535)
    ] = 8080
    relays: Annotated[int, opt("edge servers", ge=1)] = 2
    workers: Annotated[int, opt("workers", ge=1)] = 2
    engines: Annotated[int, opt("mock engines (ignored with --engine)", ge=1)] = 3
    engine_urls: Annotated[
        tuple[str, ...],
        opt("URL of a real OpenAI-compatible engine (repeatable)", flag="--engine", metavar="URL"),
    ] = ()
    model: Annotated[str, opt("model name sent to the engines")] = "mock"
    engine_cap: Annotated[
        int, opt("in-flight cap per engine: 1.5 x its concurrent sequences (the mocks run 8)", ge=1)
    ] = 12
    routing: Annotated[
        str, opt("the workers' routing policy (see docs/ROUTING.md)", choices=ROUTING_POLICIES)
    ] = DEFAULT_ROUTING
    route_queue: Annotated[
        float, opt("cost_aware: turns an engine may take past its cap, x the cap (0: none)",
                   ge=0, le=16)
    ] = DEFAULT_QUEUE  # fmt: skip
    first_token_timeout_s: Annotated[
        float, opt("the workers' wait for an engine's first token (CPU engines: minutes)", gt=0)
    ] = 60.0
    idle_timeout_s: Annotated[
        float, opt("the workers' longest silence of an engine between tokens", gt=0)
    ] = 30.0
    engine_profiles: Annotated[
        tuple[str, ...],
        opt("an engine's shape and speed for the workers (repeatable; ID * for all): "
            "slots:N,ctx:TOKENS,prefill:TOK/S,decode:TOK/S,first_token_timeout:S",
            flag="--engine-profile", metavar="ID=KEY:VALUE,..."),
    ] = ()  # fmt: skip
    # TOKENRELAY_DEMO_INSECURE_NO_AUTH: a TOKENRELAY_INSECURE_NO_AUTH left in a shell for a
    # relay does not turn a demo's auth off (the stack keeps it from the children too)
    insecure_no_auth: Annotated[bool, opt("no tokens anywhere in the stack")] = False
    secret: Annotated[
        str,
        opt("token secret of the stack (empty: a random one per run)", env="TOKENRELAY_SECRET",
            env_only=True),
    ] = ""  # fmt: skip
    amqp_url: Annotated[
        str,
        opt(f"RabbitMQ for offline jobs (empty: {DEFAULT_AMQP} when it answers)", flag="--amqp",
            metavar="URL"),
    ] = ""  # fmt: skip
    no_jobs: Annotated[bool, opt("no offline jobs (no RabbitMQ)")] = False
    no_gateway: Annotated[
        bool, opt("no OpenAI-compatible gateway (default: on, with a key made for the run)")
    ] = False
    log_dir: Annotated[
        str, opt("keep the processes' logs in this folder, made if missing (default: a "
                 "temporary one, removed when the demo stops)", metavar="DIR")
    ] = ""  # fmt: skip

    def worker_args(self) -> list[str]:
        """The workers' flags for routing, timeouts and engine profiles."""
        args = ["--routing", self.routing, "--route-queue", f"{self.route_queue:g}",
                "--first-token-timeout-s", f"{self.first_token_timeout_s:g}",
                "--idle-timeout-s", f"{self.idle_timeout_s:g}"]  # fmt: skip
        for profile in self.engine_profiles:
            args += ["--engine-profile", profile]
        return args

    def validate(self) -> DemoSettings:
        """The auth rule of every process, except that no secret means a random one; a
        ``--log-dir`` that does not exist yet is made, one that cannot be is one line;
        an engine profile that does not parse is one line too."""
        for profile in self.engine_profiles:
            try:  # refused here, in one line, not by every worker as it starts
                parse_profile_arg(profile)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.log_dir:
            folder = Path(self.log_dir)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--log-dir {self.log_dir}: cannot make it "
                                  f"({exc.strerror or exc})") from None  # fmt: skip
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"--log-dir {self.log_dir}: not writable by this user")
        if self.secret and not self.insecure_no_auth:
            try:  # named as the user set it: the demo's secret has no flag
                check_secret(self.secret, "TOKENRELAY_SECRET")
            except WeakSecret as exc:
                raise ConfigError(str(exc)) from None
        if self.secret or self.insecure_no_auth:
            settings.check_auth(self.secret, DEFAULT_KID, "", self.insecure_no_auth)
            return self
        return msgspec.structs.replace(self, secret=secrets.token_urlsafe(32))


class PortBusy(Exception):
    """The front door's port is taken; the message says which and what to do."""


def _bind_probe(host: str, port: int) -> None:
    """Bind (host, port) as the front door will (SO_REUSEADDR, as asyncio does), then let
    go; OSError if another program holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))


def check_port(host: str, port: int) -> None:
    """:class:`PortBusy` when ``port`` on ``host`` is taken, naming a free port nearby."""
    if port == 0:
        return
    try:
        _bind_probe(host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise PortBusy(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        raise PortBusy(
            f"port {port} on {host} is in use by another program: stop it, or pick another "
            f'port, e.g. --port {_next_free(host, port)} (make demo DEMO_ARGS="--port N"; '
            "--port 0: any free port)"
        ) from None


def _next_free(host: str, port: int) -> int:
    for candidate in range(port + 1, min(port + 100, 65536)):
        try:
            _bind_probe(host, candidate)
        except OSError:
            continue
        return candidate
    return 0


async def stack_view(stack: Stack, http: aiohttp.ClientSession) -> dict[str, Any]:
    """Processes, engines' in-flight against their caps (summed over workers), and the
    most recent placements on the ring: each worker's ``/v1/router``, read here with the
    stack's admin key (the page never sees the key)."""
    key = stack.spec.admin_key
    admin = {"Authorization": f"Bearer {key}"} if key else {}
    processes = [
        {"name": p.name, "kind": p.kind, "pid": p.pid, "alive": p.alive, "url": p.url}
        for p in stack.procs.values()
    ]
    engines: dict[str, dict[str, Any]] = {}
    placements: list[dict[str, Any]] = []
    for proc in stack.of_kind("worker"):
        if not proc.alive:
            continue
        try:
            async with http.get(
                proc.url + "/v1/router", headers=admin, timeout=aiohttp.ClientTimeout(total=1)
            ) as resp:
                snap = await resp.json()
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
        for e in snap.get("engines", []):
            agg = engines.setdefault(
                e["id"], {"id": e["id"], "in_flight": 0, "cap": e.get("cap", 0), "healthy": True}
            )
            agg["in_flight"] += e.get("in_flight", 0)
            agg["healthy"] = agg["healthy"] and e.get("healthy", True)
        placements.extend(snap.get("placements", []))
    placements.sort(key=lambda p: p.get("ts", 0), reverse=True)
    return {
        "processes": processes,
        "engines": sorted(engines.values(), key=lambda e: e["id"]),
        "placements": placements[:20],
        "redis": stack.redis_url,
        "mock_engines": not stack.spec.engine_urls,  # the page says their text is made up
    }


async def _broker_answers(url: str) -> bool:
    """True when an AMQP broker accepts a connection at ``url`` (3 s at most). The AMQP
    library's own ERROR line for a refused connection is kept off the terminal: the
    demo says in one line what it does without a broker."""
    import aio_pika

    amqp_log = logging.getLogger("aiormq.connection")
    level = amqp_log.level
    amqp_log.setLevel(logging.CRITICAL)
    try:
        conn = await asyncio.wait_for(aio_pika.connect(url), 3.0)
    except Exception:  # unreachable, refused, bad credentials: no jobs in this demo
        return False
    finally:
        amqp_log.setLevel(level)
    await conn.close()
    return True


async def _remove_queue(url: str, queue: str) -> bool:
    """Delete this run's job queue, its dead-letter queue and exchange from the broker
    (the demo made them; a broker it shares with others keeps nothing of the run)."""
    import aio_pika

    names = QueueNames(queue=queue)
    try:
        conn = await asyncio.wait_for(aio_pika.connect(url), 3.0)
    except Exception:
        return False
    try:
        async with conn:
            channel = await conn.channel()
            for name in (names.queue, names.dead):
                await channel.queue_delete(name, if_unused=False, if_empty=False)
            await channel.exchange_delete(names.dlx)
    except Exception:  # gone already, or the broker went away: nothing left to do
        return False
    return True


async def run_demo(opts: DemoSettings) -> int:
    """Start the stack and the front door, serve until SIGINT/SIGTERM, stop everything."""
    amqp = None
    # a queue of this run's own: two demos on one host (or an app's queue on the same
    # broker) never share jobs
    queue = f"tokenrelay.demo.{secrets.token_hex(4)}.jobs"
    if not opts.no_jobs:
        wanted = opts.amqp_url or DEFAULT_AMQP
        if await _broker_answers(wanted):
            amqp = wanted
            print(f"offline jobs: on (RabbitMQ at {mask_url(wanted)}, queue {queue} of this "
                  "run, removed when the demo stops)", flush=True)  # fmt: skip
        elif opts.amqp_url:
            print(f"error: no RabbitMQ answers at {mask_url(wanted)} (--amqp)", file=sys.stderr)
            return 1
        else:
            print(f"offline jobs: off (no RabbitMQ at {mask_url(wanted)}; --amqp URL)", flush=True)
    # The OpenAI gateway's key: made for this run, printed on this terminal only, given
    # to the workers in their environment
    gateway_key = "" if opts.no_gateway else f"demo-{secrets.token_urlsafe(24)}"
    spec = StackSpec(
        gateway_keys=[gateway_key] if gateway_key else [],
        log_dir=opts.log_dir or None,
        amqp_url=amqp,
        jobs_queue=queue,
        relays=opts.relays,
        workers=opts.workers,
        engines=opts.engines,
        engine_urls=list(opts.engine_urls),
        model=opts.model,
        insecure_no_auth=opts.insecure_no_auth,
        secret=opts.secret,
        admin_key=secrets.token_urlsafe(32),  # per run; the front door reads /v1/router
        engine_cap=opts.engine_cap,
        worker_args=opts.worker_args(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("starting: Redis Cluster, engines, relays, workers ...", flush=True)
    async with Stack(spec) as stack, aiohttp.ClientSession() as http:

        async def control(action: str, name: str) -> Any:
            if name not in stack.procs:
                raise KeyError(f"no process named {name}")
            if action == "kill":
                return {"pid": stack.kill(name)}
            if action == "restart":
                await stack.restart(name)
                return {"pid": stack.procs[name].pid}
            raise ValueError(f"unknown action {action}")

        door = FrontDoor(
            lambda: [p.url for p in stack.of_kind("relay") if p.alive],
            lambda: [p.url for p in stack.of_kind("worker") if p.alive],
            stack_view=lambda: stack_view(stack, http),
            control=control,
        )
        app = make_frontdoor_app(door)
        # the relays' and workers' defaults; no cap per address: every browser is local
        guard = guard_app(app, ConnLimits())
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        site = GuardedSite(runner, opts.host, opts.port, guard=guard, backlog=4096)
        try:
            await site.start()
        except OSError:  # taken since check_port looked: same one line, everything stopped
            await runner.cleanup()
            raise
        try:
            page = f"http://{opts.host}:{site.port}/"
            env = backend_env(stack.redis_url, opts.secret, page, gateway_key, opts.model)
            env_file = write_env_file(stack.log_dir, env)
            print(banner(stack, page, door.control_token, gateway_key, opts, env_file), flush=True)
            await stop.wait()
        finally:
            print("stopping ...", flush=True)
            await runner.cleanup()
            if stack.log_dir:  # it holds the secret: gone even where the logs stay
                (Path(stack.log_dir) / ENV_FILE).unlink(missing_ok=True)
    # every process has exited here (Stack's exit): their logs go too, unless asked to stay
    stack.remove_logs()
    if amqp is not None:
        await _remove_queue(amqp, queue)
    kept = f" (logs kept in {stack.log_dir})" if opts.log_dir else ""
    print(f"stopped: every process this demo started has exited{kept}.", flush=True)
    return 0


def banner(stack: Stack, page: str, control_token: str, gateway_key: str,
           opts: DemoSettings, env_file: Path | None = None) -> str:  # fmt: skip
    """What the terminal shows once the stack runs: the processes, where their logs are,
    the page's address, the control link, the OpenAI snippet (this run's key) and the
    Redis URL with the file that gives a backend of one's own the run's settings."""
    rows = [(p.name, f"pid {p.pid}", p.url if p.port else "(no HTTP: reads the job queue)")
            for p in stack.procs.values()]  # fmt: skip
    rows.append(("redis", "", stack.redis_url))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"  {name:<{width}}  {pid:<10} {where}".rstrip() for name, pid, where in rows]
    logs = "kept" if opts.log_dir else "removed when the demo stops; --log-dir DIR keeps them"
    lines.append(f"  {'logs':<{width}}  {'':<10} {stack.log_dir}  ({logs})")
    engines = "real engines" if opts.engine_urls else "mock engines: replies are made-up text"
    lines += [
        "",
        f"open {page}  (Ctrl-C stops everything; {engines})",
        # The kill/restart buttons need this run's control token; it is printed here
        # only (the page keeps it from the #fragment, which no request carries).
        f"kill/restart buttons: open {page}#control={control_token}",
    ]
    routing = f"routing: {opts.routing}"
    if opts.routing in ("cost_aware", "precise"):
        routing += f", route queue {opts.route_queue:g} x the cap"
    lines += [
        "",
        f"{routing}; first-token timeout {opts.first_token_timeout_s:g} s"
        + "".join(f"; --engine-profile {p}" for p in opts.engine_profiles),
    ]
    if stack.spec.admin_key:
        # the workers' and relays' /metrics and /v1/router are closed by this run's key
        url = next((p.url for p in stack.of_kind("worker")), "")
        lines += [
            "workers' and relays' metrics (this run's admin key):",
            f"    curl -H 'Authorization: Bearer {stack.spec.admin_key}' {url}/metrics",
        ]
    if gateway_key:
        snippet = openai_snippet(page, gateway_key, opts.model)
        head = "OpenAI gateway (a key made for this run): pip install openai, then in python:"
        lines += ["", head, *("    " + line for line in snippet)]
    else:
        lines += ["", "OpenAI gateway: off (--no-gateway)"]
    if env_file is not None:
        lines += [
            "",
            f"Redis Cluster: {stack.redis_url}",
            'your own backend (README.md, "Stream from your own backend"): this run\'s Redis',
            "URL, token secret and gateway key as environment variables, for your shell:",
            f"    set -a; . {env_file}; set +a",
        ]
    return "\n".join(lines) + "\n"


def openai_snippet(page: str, key: str, model: str) -> list[str]:
    """The lines of a Python program that streams one reply through the gateway with the
    official ``openai`` package, ready to paste."""
    return [
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{page}v1", api_key="{key}")',
        "stream = client.chat.completions.create(",
        f'    model="{model}", messages=[{{"role": "user", "content": "hello"}}], stream=True',
        ")",
        "for chunk in stream:",
        "    if chunk.choices:",
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
        "print()",
    ]


def _main(args: argparse.Namespace) -> int:
    try:
        opts = settings.load(DemoSettings, args)
        check_port(opts.host, opts.port)
    except (ConfigError, PortBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return runtime.run(run_demo(opts))
    except (StackError, ClusterError) as exc:  # a child did not start: its log says why
        # one line: which child, and the last line of its log (the log itself is removed)
        first, *rest = str(exc).splitlines() or [""]
        first = first.split("; last lines of ")[0].rstrip(":")
        said = [line.strip() for line in rest if line.strip()]
        why = f": {said[-1]}" if said else ""
        print(f"error: the demo could not start: {first}{why}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"error: port {opts.port} on {opts.host} was taken by another program while "
              "the demo started: pick another with --port N", file=sys.stderr)  # fmt: skip
        return 2


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the whole stack behind one URL (Ctrl-C stops it)",
        description="A local Redis Cluster, mock engines, relays, workers and a front door "
        "on one URL. The token secret is TOKENRELAY_SECRET (a random one per run when "
        "unset). " + settings.ENV_NOTE,
    )
    settings.add_arguments(p, DemoSettings)
    p.set_defaults(func=_main)
