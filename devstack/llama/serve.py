"""Run the built ``llama-server`` processes: what the real-engine tests and the routing
benchmark start, each stopped by pid (:mod:`devstack.procs`).

Order of use::

    built = find()  # or ensure(); None: not built here (devstack.llama.build)
    async with llama_servers(built, 2, log_dir, slots=2, ctx=4096) as engines:
        engines[0].url, engines[0].id, engines[0].proc     # http://127.0.0.1:PORT
    # every server stopped on the way out

Each server serves the SmolLM2 model under the name :data:`MODEL` with ``slots``
parallel slots (``-np``; the context ``ctx`` is shared among them, llama.cpp's rule),
``threads`` CPU threads, its ``/metrics`` and ``/slots`` on, its host-memory prompt
cache (``--cache-ram``) at the server's default or as given, and a small batch
(``-b``/``-ub`` :data:`BATCH`): llama.cpp looks at a request's cancellation between
batches, so a prompt the client gave up on stops within one batch of CPU work instead
of being computed to its end.

Tool calling: every server runs its chat template with Jinja (``--jinja``) and the
template :data:`TOOLS_TEMPLATE` (``--chat-template-file``). The model's own template has
no tools: llama.cpp then parses nothing out of the reply, so ``tools`` and a required
``tool_choice`` come back as plain text. Ours renders a conversation without tools
exactly as the model's own does (the same prompt, so the same replies and cached
prefixes), and with tools puts their schemas in the system message, an assistant's calls
as ``<tool_call>`` blocks and a tool's result as a ``<tool_response>``: llama.cpp's
template analysis finds that format, streams the calls as ``delta.tool_calls`` and, for
``tool_choice: "required"``, constrains the reply with a grammar: any text first, then
a call whose arguments match the tool's schema (the 135M model writes its text to
``max_tokens`` unless the conversation shows it one call first). The model does not
reason: its replies carry no ``reasoning_content``, except with :data:`THINK_TEMPLATE`,
which opens a ``<think>`` block at the start of every reply so that the reasoning path
can be tested on a real engine (llama.cpp streams the block as ``reasoning_content``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from devstack.llama.build import Built
from devstack.procs import HOST, Proc, free_port, http_ok, stop_all

__all__ = [
    "BATCH",
    "MODEL",
    "THINK_TEMPLATE",
    "TOOLS_TEMPLATE",
    "LlamaServer",
    "llama_servers",
    "server_argv",
]

MODEL = "smollm2"
BATCH = 128
TOOLS_TEMPLATE = Path(__file__).with_name("smollm2-tools.jinja")
THINK_TEMPLATE = Path(__file__).with_name("smollm2-think.jinja")  # reasoning, for tests


@dataclass(frozen=True, slots=True)
class LlamaServer:
    id: str
    url: str
    port: int
    proc: Proc


def server_argv(
    built: Built,
    port: int,
    *,
    slots: int = 2,
    ctx: int = 4096,
    threads: int = 1,
    template: Path | None = TOOLS_TEMPLATE,
    cache_ram_mib: int | None = None,
) -> list[str]:
    """The command line; ``template`` None: the model's own chat template;
    ``cache_ram_mib``: the server's host-memory prompt cache (``--cache-ram``; None: its
    default, 8 GiB; 0: none, each slot then holds the one conversation it served last)."""
    chat = ["--chat-template-file", str(template)] if template is not None else []
    argv = [
        str(built.server), "-m", str(built.model), "--host", HOST, "--port", str(port),
        "-np", str(slots), "-c", str(ctx), "-t", str(threads), "--alias", MODEL,
        "--metrics", "--slots", "-b", str(BATCH), "-ub", str(BATCH), "--no-webui",
        "--jinja", *chat,
    ]  # fmt: skip
    if cache_ram_mib is not None:
        argv += ["--cache-ram", str(cache_ram_mib)]
    return argv


@contextlib.asynccontextmanager
async def llama_servers(
    built: Built,
    n: int,
    log_dir: str | Path,
    *,
    slots: int = 2,
    ctx: int = 4096,
    threads: int = 1,
    template: Path | None = TOOLS_TEMPLATE,
    cache_ram_mib: int | None = None,
    ready_s: float = 120.0,
) -> AsyncIterator[list[LlamaServer]]:
    """``n`` servers on free loopback ports, ready (``/health`` 200, the model loaded)."""
    started: list[LlamaServer] = []
    try:
        for i in range(n):
            port = free_port()
            argv = server_argv(
                built,
                port,
                slots=slots,
                ctx=ctx,
                threads=threads,
                template=template,
                cache_ram_mib=cache_ram_mib,
            )
            name = f"llama-{i + 1}"
            proc = Proc.start(argv, log=Path(log_dir) / f"{name}.log", name=name)
            started.append(LlamaServer(name, f"http://{HOST}:{port}", port, proc))
        for s in started:
            await s.proc.ready(http_ok(s.url + "/health"), timeout_s=ready_s, every_s=0.2)
        yield started
    finally:
        await stop_all([s.proc for s in started], grace_s=10.0)
