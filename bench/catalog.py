"""Every benchmark, listed once: its name, its module, what it answers, and its quick run.

Read by ``make bench`` (``python -m bench --quick-all artifacts``: each quick run below),
``python -m bench [<name>]`` (:mod:`bench.cli`), and
``tests/bench/test_catalog.py``. Another benchmark is one more :class:`Benchmark` here.

Each module named here provides ``add_arguments(parser)`` (its flags) and
``run_from_args(args) -> int`` (the run; the exit code), and runs as ``python -m
<module> [flags]`` with the same flags: the command lines the docs cite beside their
figures. A quick run is ``python -m <module> <quick> --json DIR/<name>.json`` (and
``--plot DIR/<name>.png`` where the benchmark draws one).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CATALOG", "AddArguments", "Benchmark", "RunFromArgs", "find"]

AddArguments = Callable[[argparse.ArgumentParser], None]
RunFromArgs = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Benchmark:
    name: str  # python -m bench <name>, artifacts/<name>.json
    module: str  # python -m <module>; holds add_arguments and run_from_args
    help: str  # one line: what it answers
    quick: tuple[str, ...] | None = ("--quick",)  # flags of its run in make bench; None: none
    plot: bool = False  # the quick run draws --plot DIR/<name>.png too
    aliases: tuple[str, ...] = ()  # other names it answers to on the command line

    def quick_argv(self, out: Path) -> list[str]:
        """The flags of the quick run, its JSON (and plot) in ``out``."""
        if self.quick is None:
            raise ValueError(f"{self.name} has no quick run")
        argv = [*self.quick, "--json", str(out / f"{self.name}.json")]
        if self.plot:
            argv += ["--plot", str(out / f"{self.name}.png")]
        return argv

    def entry(self) -> tuple[AddArguments, RunFromArgs]:
        """The module's ``add_arguments`` and ``run_from_args`` (imports the module)."""
        mod = importlib.import_module(self.module)
        add: AddArguments = mod.add_arguments
        run: RunFromArgs = mod.run_from_args
        return add, run


# In the order make bench runs them (that of the list the Makefile used to spell out).
CATALOG: tuple[Benchmark, ...] = (
    Benchmark(
        "router_micro",
        "bench.routing.router_micro",
        "ns per route + release of the worker's router, beside the bare hash",
    ),
    Benchmark(
        "routing_sim",
        "bench.routing.sim",
        "every routing policy through a vLLM-like engine model: goodput, TTFT, ITL, hits",
        plot=True,
    ),
    Benchmark(
        "routing_precise",
        "bench.routing.precise",
        "precise routing on the engines' KV events vs the estimate: hits, goodput, TTFT, "
        "staleness, index memory, events/s, route cost",
        quick=("--quick", "--seeds", "1"),
    ),
    Benchmark(
        "pubsub_cluster",
        "bench.pubsub.cluster",
        "PUBLISH vs SPUBLISH cost on local Redis Clusters",
        plot=True,
        aliases=("pubsub",),
    ),
    Benchmark(
        "subscriber_compare",
        "bench.relay.subscriber_compare",
        "the relay's per-node shard reader against redis-py's ClusterPubSub",
    ),
    Benchmark(
        "publish_cost",
        "bench.pubsub.publish_cost",
        "Redis CPU per published frame: the publish script vs pipelined XADD + SPUBLISH",
    ),
    Benchmark(
        "wait_cost",
        "bench.pubsub.wait_cost",
        "a publish followed by WAIT 1 (a replica has it) against one alone; the OPEN's cost",
    ),
    Benchmark(
        "coalesce",
        "bench.pubsub.coalesce",
        "token coalescing: Redis operations per token against the delay it adds",
    ),
    Benchmark(
        "affinity",
        "bench.routing.affinity",
        "engines' prefix-cache hit rate: ring routing vs round robin",
    ),
    Benchmark(
        "realengine",
        "bench.routing.realengine",
        "routing on llama.cpp's llama-server: prefill the engines computed, reuse, TTFT",
        quick=None,  # needs the built engine (python -m devstack llama build) and minutes
    ),
    Benchmark(
        "llamarate",
        "bench.routing.llamarate",
        "llama-server's own prefill and decode tokens/s on this CPU, 1 and 2 threads",
        quick=None,  # needs the built engine (python -m devstack llama build)
    ),
    Benchmark(
        "loadtest",
        "bench.load.loadtest",
        "many screens per session while turns stream (SSE + WS)",
        quick=("--quick", "--no-progress"),
    ),
    Benchmark(
        "faults",
        "bench.faults.drills",
        "fault drills: loss, duplicates, order and recovery while a stack is broken",
    ),
    Benchmark(
        "nemesis",
        "bench.faults.nemesis",
        "overlapping faults from a seed under load, every screen checked against Redis",
        quick=("--quick", "--seed", "3"),
    ),
    Benchmark(
        "fuzz",
        "bench.fuzz.run",
        "hostile inputs to the frame, session-id, offset and token parsers",
    ),
    Benchmark(
        "slow_clients",
        "bench.hostile.slow_clients",
        "idle and trickling connections from one address against a relay while viewers stream",
    ),
    Benchmark(
        "slow_readers",
        "bench.hostile.slow_readers",
        "Durable Streams catch-up readers that never read, against a relay's memory",
    ),
    Benchmark(
        "durable_hostile",
        "bench.hostile.durable",
        "hostile: the Durable Streams attack batch against a relay; its longest /healthz stall",
    ),
    Benchmark(
        "mq_vs_pubsub",
        "bench.pubsub.mq_vs_pubsub",
        "token streaming: Redis sharded Pub/Sub vs RabbitMQ (queue per connection, topic)",
    ),
    Benchmark(
        "closed_loop",
        "bench.load.closed_loop",
        "engine token -> screen latency: the worker's closed loop vs the relay path",
    ),
    Benchmark(
        "responses",
        "bench.load.responses",
        "the Responses API's events/s and CPU/event beside chat completions and relay SSE; resumes",
    ),
    Benchmark(
        "relay_throughput",
        "bench.relay.throughput",
        "one relay process: frames/s vs a raw Redis reader, fan-out, latency, RSS per idle conn",
    ),
    Benchmark(
        "relay_anatomy",
        "bench.relay.anatomy",
        "a live frame's walk through the relay's modules; objects per idle connection",
    ),
    Benchmark(
        "relay_micro",
        "bench.relay.micro",
        "the relay's own code per frame, shard reader callback to transport.write, no sockets",
    ),
    Benchmark(
        "address_memory",
        "bench.storage.address_memory",
        "hostile: the most Redis memory one client address can make the cluster hold per hour",
    ),
    Benchmark(
        "relay_join",
        "bench.relay.join",
        "a late joiner of a 1,000-turn session: frames, bytes, time, compacted vs full (SSE, WS)",
    ),
    Benchmark(
        "peer_resumable",
        "bench.peers.resumable",
        "Vercel's resumable-stream on a node and the 3+3 cluster: CPU per delivered token "
        "(producer, Redis, resumer), latency, loss, resume storm, producer killed, bus bytes",
    ),
    Benchmark(
        "peer_socketio",
        "bench.peers.socketio",
        "the relay beside Socket.IO with the sharded Redis adapter: CPU/msg, latency, RSS/conn",
    ),
    Benchmark(
        "pathcost",
        "bench.peers.pathcost",
        "CPU per delivered token over the whole path (producer + Redis + server), tokenrelay "
        "beside Socket.IO, Centrifugo and resumable-stream, each participant's share, p99, "
        "loss; LLM-rate phases",
    ),
    Benchmark(
        "peer_durable",
        "bench.peers.durable",
        "Durable Streams on 1 and 2 relays beside the reference server (file, memory): "
        "appends/s, catch-up MB/s, CPU/msg and latency of 1,000 SSE and long-poll readers",
    ),
    # Not in make bench, as before: the previous routing simulator, kept for what it
    # showed (docs/ROUTING.md), and a profile of memory rather than a measurement.
    Benchmark(
        "first_demo",
        "bench.adoption.first_demo",
        "a fresh clone's first make demo: seconds to the URL (install, start), venv size "
        "(needs the package index)",
        quick=None,
    ),
    Benchmark(
        "loadshare_sim",
        "bench.routing.loadshare_sim",
        "several worker pods sharing each engine's cap: peak in-flight / cap, shares",
        quick=None,
    ),
    # Not in make bench: a sweep of pathcost's LLM-rate phases, minutes even when quick
    Benchmark(
        "pathscale",
        "bench.peers.pathscale",
        "whole-path CPU per token and p99 as live sessions and screens per session grow, "
        "tokenrelay beside Centrifugo and Socket.IO-with-streams",
        quick=None,
        plot=True,
    ),
    # Not in make bench: a pathcost run of its own, to check the capacity planner
    Benchmark(
        "capcheck",
        "bench.peers.capcheck",
        "tokenrelay capacity's predicted cores for a shape it was not fitted on, beside "
        "the measured cores (relay, Redis masters, publish path)",
        quick=None,
    ),
    Benchmark(
        "relay_memory",
        "bench.relay.memory",
        "where an idle SSE or WebSocket connection's memory goes inside a relay",
        quick=None,
    ),
    Benchmark(
        "stop",
        "bench.load.stop",
        "a Stop taken by one worker, the reply generated by another: ack -> terminal frame",
    ),
    Benchmark(
        "producer_cpu",
        "bench.producer.cpu",
        "producer CPU per token: the Python API, the Node package, the publisher under them",
    ),
    Benchmark(
        "wire_parts",
        "bench.producer.wire_parts",
        "SSE bytes per delivered token, text-only and with tool calls: did parts make text dearer",
    ),
    Benchmark(
        "producer_soak",
        "bench.producer.soak",
        "the Node producer into two relays with many SSE viewers: every frame vs the backlog",
    ),
)


def find(name: str) -> Benchmark:
    """The benchmark called ``name`` (or one of its aliases); KeyError if none is."""
    for b in CATALOG:
        if name == b.name or name in b.aliases:
            return b
    raise KeyError(name)
