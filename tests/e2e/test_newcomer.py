"""A newcomer's first hour, scripted: a fresh clone, ``make demo``, the page in Chromium,
every README example as written, Ctrl-C, and nothing left behind.

1. ``git clone`` of this repository (its committed HEAD) into a temporary folder.
2. ``make -n`` there: ``make demo`` installs the servers, the embedded Redis and what
   the README's examples import, never the test, bench or dev extras.
3. The clone's ``.venv``, made without downloading: a venv whose site-packages reach this
   venv's third-party packages through a ``.pth`` file (a folder of links that leaves
   out this checkout's own ``tokenrelay`` and pip's tooling) and the clone itself as an
   editable install (its path, a dist-info with the clone's entry points, the
   ``tokenrelay`` script), then the stamp ``make demo`` checks. A real install from the
   registry takes a quarter of a minute with a warm cache and needs the network, which a
   test does not use; ``make -n`` (step 2) checks what that install would be.
4. ``make demo DEMO_ARGS="--port P"`` in the clone, in a process group of its own, with
   ``TMPDIR`` a folder of the test's: the terminal must show an aligned process table
   with no port-0 address, the log folder (inside ``TMPDIR``), the page's URL, the
   control link and a ready-to-paste ``openai`` program, which must run as printed.
5. The page in headless Chromium: no 404 on a load, the panel says the engines are
   mocks, a turn streams, the address bar holds no token, a screen opened from the
   share link is watch-only and says why, one placement row per session with its whole
   id, and before a session the composer says to press New session.
6. Every example of the README exactly as written, the base URL ``127.0.0.1:8080`` moved
   to the demo's port (and the key the demo printed in the OpenAI one): curl ends by
   itself with nothing on stderr, the browser one in the page's console, the Python and
   OpenAI ones with the clone's venv, the Python producer ("Stream from your own
   backend") after the ``set -a; . backend.env; set +a`` line the demo printed, the AI
   SDK command line through bash (``npm ci`` from the lock file, so the clone's files
   stay as committed).
   Meanwhile two obvious mistakes: a second demo and a relay on the same port, each one
   line and a non-zero exit.
7. Ctrl-C (SIGINT to the process group, as a terminal sends it): the demo says every
   process stopped, no process runs from the clone or its ``TMPDIR``, the Redis ports
   are closed, ``TMPDIR`` is empty and ``git status`` in the clone is clean.

Where iptables cannot run, the fault suite's partition drill cannot either: that fails
here too, unless ``TOKENRELAY_SKIP_FAULTS=partition`` asks to skip it.

Every process is started here by pid (the demo's group by the pid of its leader) and,
whatever failed, stopped here the same way; only loopback addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.faults.partition import unsupported
from devstack.procs import Proc, free_port, log_line
from tests.e2e.test_aisdk import _npm_ready
from tests.e2e.test_browser import CHROMIUM, LAUNCH_ARGS
from tests.e2e.test_examples import DEMO_BASE, DEMO_KEY, example
from tests.support.cli import clean_env, run_cli

pytestmark = [
    pytest.mark.integration,
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
# this venv's entries a clone must not see: this checkout's own install, and pip's tools
NOT_SHARED = re.compile(
    r"^(tokenrelay|__editable__|pip|setuptools|_distutils_hack|pkg_resources|wheel)\b"
    r"|^__pycache__$|\.pth$"
)


async def _make_venv(clone: Path, work: Path) -> Path:
    """The clone's .venv, with this venv's third-party packages (links in a folder of
    the test's) and the clone as an editable install; the python it runs."""
    venv = clone / ".venv"
    shared = work / "site-packages"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not NOT_SHARED.search(entry.name):
            (shared / entry.name).symlink_to(entry)
    made = await run_cli([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout_s=120)
    assert made.code == 0, made.err
    python = venv / "bin" / "python"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / "lib" / version / "site-packages"
    (site / "shared.pth").write_text(f"{shared}\n")
    (site / "tokenrelay-clone.pth").write_text(f"{clone}\n")
    project = tomllib.loads((clone / "pyproject.toml").read_text())["project"]
    info = site / f"tokenrelay-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: tokenrelay\nVersion: {project['version']}\n"
    )
    groups = {"console_scripts": project["scripts"], **project["entry-points"]}
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for g, eps in groups.items()
        )
    )
    (info / "INSTALLER").write_text("tests/e2e/test_newcomer.py\n")
    module, func = project["scripts"]["tokenrelay"].split(":")
    script = venv / "bin" / "tokenrelay"
    script.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
    return python


def _printed_snippet(out: str) -> str:
    """The openai program the demo printed (its indented lines after the heading)."""
    after = out.split("then in python:\n", 1)[1]
    lines = []
    for line in after.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line[4:])
    return "\n".join(lines) + "\n"


def out_text(here: Path) -> str:
    """What the demo's terminal showed so far."""
    return (here / "terminal.out").read_text()


def _running_from(*folders: Path) -> list[str]:
    """Processes whose command line names one of ``folders`` (nothing is killed here)."""
    found = []
    marks = [str(f).encode() for f in folders]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmdline for m in marks):
            argv = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {argv}")
    return found


async def _page(base: str, readme: Path) -> dict[str, Any]:
    """The page as a newcomer uses it; the README's browser example in its console."""
    from playwright.async_api import async_playwright

    seen: dict[str, Any] = {}
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            one = await browser.new_page()
            missing: list[str] = []
            errors: list[str] = []
            one.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
            one.on("pageerror", lambda e: errors.append(str(e)))
            await one.goto(base + "/")
            seen["idle_send_disabled"] = await one.is_disabled("#send")
            seen["idle_why"] = await one.get_attribute("#message", "placeholder")
            await one.wait_for_function(
                "document.getElementById('engine-kind').textContent.length > 0"
            )
            seen["engine_note"] = await one.text_content("#engine-kind")
            await one.click("#new-session")
            await one.wait_for_function("document.getElementById('state').textContent === 'live'")
            seen["address"] = one.url
            for text in ("hello from a newcomer", "and a second turn"):
                await one.fill("#message", text)
                await one.click("#send")
                await one.wait_for_function(
                    f"document.querySelectorAll('.assistant:not(.streaming)').length >= "
                    f"{1 if text.startswith('hello') else 2}",
                    timeout=60_000,
                )
            seen["replies"] = await one.eval_on_selector_all(
                ".assistant", "els => els.map(e => e.textContent)"
            )
            await one.wait_for_function(  # ring points: the panel names no session
                "[...document.querySelectorAll('#placements code')]"
                ".some(c => /^[0-9a-f]{8}$/.test(c.textContent))",
                timeout=10_000,
            )
            seen["placements"] = await one.eval_on_selector_all(
                "#placements code", "els => els.map(e => e.textContent)"
            )
            await one.wait_for_function("document.getElementById('share').href.includes('token=')")
            share = await one.get_attribute("#share", "href") or ""
            shared = await browser.new_page()
            await shared.goto(share if share.startswith("http") else base + share)
            await shared.wait_for_function(
                "document.getElementById('state').textContent === 'live'"
            )
            seen["shared_disabled"] = await shared.is_disabled("#message")
            seen["shared_why"] = await shared.get_attribute("#message", "placeholder")
            seen["shared_address"] = shared.url
            # the README's browser example, pasted into the console of the demo page
            logs: list[str] = []
            console = await browser.new_page()
            console.on("console", lambda msg: logs.append(msg.text))
            await console.goto(base + "/")
            code = example("browser", readme)
            await asyncio.wait_for(console.evaluate(f"async () => {{ {code} }}"), 60)
            seen["browser_example"] = logs
            seen["missing"], seen["errors"] = missing, errors
        finally:
            await browser.close()
    return seen


async def test_a_newcomer_clones_runs_the_demo_tries_every_example_and_stops_it(
    tmp_path: Path,
) -> None:
    if not CHROMIUM:
        pytest.skip("no Chromium: apt-get install chromium (make test does it as root)")
    pytest.importorskip("playwright.async_api", reason="pip install playwright")
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("needs make and git")
    # the fault suite's partition drill needs iptables, installed by make test: a fault
    # class that cannot run fails unless asked to skip it
    if "partition" not in os.environ.get("TOKENRELAY_SKIP_FAULTS", "").split(","):
        assert unsupported() is None, f"the partition drill cannot run here: {unsupported()}"
    npm_why = await _npm_ready()  # fills npm's cache for the clone's npm ci
    work = tmp_path / "newcomer"
    work.mkdir()
    clone, tmpdir = work / "tokenrelay", work / "tmp"
    tmpdir.mkdir()
    try:
        cloned = await run_cli(["git", "clone", "-q", str(ROOT), str(clone)], timeout_s=120)
        assert cloned.code == 0, cloned.err
        # 2. what `make demo` would install: the servers, the embedded Redis, the examples'
        dry = await run_cli(["make", "-n", "demo"], cwd=clone, timeout_s=30)
        installs = [ln for ln in dry.out.splitlines() if "pip install" in ln and " -e " in ln]
        assert installs == [
            f"{'.venv/bin/python'} -m pip install -q -e '.[server,embedded,jobs,precise,examples]'"
        ], dry.out
        python = await _make_venv(clone, work)
        (clone / ".venv" / ".installed-demo").touch()  # newer than pyproject.toml
        await _run_the_demo(clone, tmpdir, python, npm_why)
        # 7. nothing left behind
        assert _running_from(clone, tmpdir) == []
        assert sorted(p.name for p in tmpdir.iterdir()) == []
        status = await run_cli(["git", "status", "--porcelain"], cwd=clone, timeout_s=30)
        assert status.out == "", status.out  # no file of the clone changed or added
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _run_the_demo(clone: Path, tmpdir: Path, python: Path, npm_why: str | None) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out_path = tmpdir.parent / "terminal.out"
    env = clean_env(TMPDIR=str(tmpdir), PATH=os.environ.get("PATH", "/usr/bin:/bin"))
    env.pop("PYTHONPATH", None)
    demo = Proc.start(
        ["make", "demo", f"DEMO_ARGS=--port {port}"], log=out_path, name="make demo",
        env=env, cwd=clone, new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    redis_ports: list[int] = []
    try:
        await demo.ready(log_line(f"open {base}/"), timeout_s=180, every_s=0.2)
        await asyncio.sleep(0.5)  # the rest of the banner
        out = out_path.read_text()
        _check_terminal(out, tmpdir)
        async with aiohttp.ClientSession() as http, http.get(base + "/api/stack") as r:
            view = await r.json()
        pids = [p["pid"] for p in view["processes"]]
        redis_ports = [int(view["redis"].rsplit(":", 1)[1])]
        assert view["mock_engines"] is True
        # 4. the printed openai program, pasted into python
        snippet = tmpdir.parent / "snippet.py"
        snippet.write_text(_printed_snippet(out))
        ran = await run_cli([str(python), str(snippet)], timeout_s=60, env=env)
        assert ran.code == 0, ran.err
        assert len(ran.out.strip()) > 20, ran.out
        # 5. the page, and the browser example in its console
        seen = await _page(base, clone / "README.md")
        assert seen["missing"] == [], seen["missing"]
        assert seen["errors"] == [], seen["errors"]
        assert "Mock engines" in seen["engine_note"]
        assert seen["idle_send_disabled"] is True  # before a session, and it says so
        assert "New session first" in (seen["idle_why"] or ""), seen["idle_why"]
        assert "token=" not in seen["address"]
        assert "token=" not in seen["shared_address"]
        assert all(len(r) > 20 for r in seen["replies"]), seen["replies"]
        assert len(seen["replies"]) == 2
        points = seen["placements"]
        assert len(points) == len(set(points)), points  # one row per ring point
        assert seen["address"].split("session=")[1] not in " ".join(points)  # no session id
        assert seen["shared_disabled"] is True
        assert "only watches" in (seen["shared_why"] or ""), seen["shared_why"]
        assert "live" in " ".join(seen["browser_example"]), seen["browser_example"]
        assert len(seen["browser_example"][-1].strip()) > 20, seen["browser_example"]
        # 6. the README's examples, as written
        key = re.search(r'api_key="(demo-[^"]+)"', out)
        assert key is not None, out
        await _readme_examples(clone, tmpdir, python, base, key.group(1), env, npm_why)
        # obvious mistakes meanwhile: a second demo, a relay on the port in use
        for argv in (
            [str(python), "-m", "devstack", "demo", "--port", str(port)],
            [str(clone / ".venv" / "bin" / "tokenrelay"), "relay", "--port", str(port)],
        ):
            ran = await run_cli(
                argv, timeout_s=60, cwd=clone,
                env={**env, "TOKENRELAY_SECRET": "newcomer-secret-5f1c9a7e3b2d8046ae1f"},
            )  # fmt: skip
            assert ran.code != 0, (argv, ran.err)
            assert ran.err.count("\n") == 1, (argv, ran.err)
            assert f"port {port} on 127.0.0.1 is in use" in ran.err, (argv, ran.err)
        # 7. Ctrl-C, as a terminal sends it: to the foreground process group
        os.killpg(demo.pid, signal.SIGINT)
        assert await demo.wait(60) is not None, demo.tail()
        final = out_path.read_text()
        assert "stopped: every process this demo started has exited" in final, final[-3000:]
        assert "Traceback" not in final, final[-3000:]
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid
        for p in redis_ports:
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", p)
    finally:
        if demo.alive:  # whatever failed: Ctrl-C, then the group's leader by pid
            with _suppress_gone():
                os.killpg(demo.pid, signal.SIGINT)
            if await demo.wait(30) is None:
                with _suppress_gone():
                    os.killpg(demo.pid, signal.SIGTERM)
                if await demo.wait(15) is None:
                    with _suppress_gone():
                        os.killpg(demo.pid, signal.SIGKILL)
                    demo.kill()


def _suppress_gone() -> contextlib.suppress:
    return contextlib.suppress(ProcessLookupError, PermissionError)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def _check_terminal(out: str, tmpdir: Path) -> None:
    """The process table lines up, names no port-0 address, and says where the logs are."""
    table = out.split("starting:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    rows = [ln for ln in table if " pid " in ln]
    assert len(rows) >= 7, out  # 3 engines, 2 relays, 2 workers (and a job worker)
    assert len({ln.index(" pid ") for ln in rows}) == 1, "\n".join(table)
    assert not re.search(r":0(\s|$)", out, re.M), out  # no address on port 0
    logs = [ln for ln in table if ln.strip().startswith("logs ")]
    assert len(logs) == 1, table
    folder = Path(logs[0].split()[1])
    assert folder.is_dir(), logs
    assert folder.parent == tmpdir, logs
    assert "#control=" in out
    assert "mock engines" in out


async def _readme_examples(
    clone: Path, tmpdir: Path, python: Path, base: str, key: str, env: dict[str, str],
    npm_why: str | None,
) -> None:  # fmt: skip
    here = tmpdir.parent
    readme = clone / "README.md"
    # curl: the closed loop, ends by itself, no progress meter
    curl = here / "curl.sh"
    curl.write_text("set -eu\n" + example("curl", readme).replace(DEMO_BASE, base))
    ran = await run_cli(["bash", str(curl)], cwd=here, timeout_s=60, env=env)
    assert ran.code == 0, ran.err
    assert ran.err == "", ran.err
    assert ran.out.rstrip().splitlines()[-2] == "event: done", ran.out[-1500:]
    # Python and OpenAI: the clone's venv, as a newcomer runs them
    for name, text in (
        ("python", example("python", readme).replace(DEMO_BASE, base)),
        ("openai", example("openai", readme).replace(DEMO_BASE, base).replace(DEMO_KEY, key)),
    ):
        script = here / f"example_{name}.py"  # not openai.py: it would shadow the package
        script.write_text(text)
        ran = await run_cli([str(python), str(script)], cwd=here, timeout_s=60, env=env)
        assert ran.code == 0, (name, ran.err)
        assert len(ran.out.strip()) > 20, (name, ran.out)
    # your own backend: the Python block as written, after the line the demo printed
    sourced = re.search(r"^    (set -a; \. (\S+); set \+a)$", out_text(here), re.M)
    assert sourced is not None, "the demo printed no backend.env line"
    assert Path(sourced.group(2)).stat().st_mode & 0o077 == 0  # it holds the secret
    backend = here / "backend.py"
    backend.write_text(example("producer-py", readme))
    ran = await run_cli(
        ["bash", "-c", f'{sourced.group(1)}; exec "{python}" backend.py'], cwd=here,
        timeout_s=60, env=env,
    )  # fmt: skip
    assert ran.code == 0, ran.err
    first, *_, reply = ran.out.strip().splitlines()
    assert len(first.split(" ")) == 2, ran.out  # the session and its watch token
    assert len(reply) > 20, ran.out
    # the AI SDK: the README's command line, in the clone
    if npm_why is not None:
        pytest.fail(f"the README's AI SDK example cannot run here: {npm_why}")
    command = example("aisdk-run", readme).strip()
    ran = await run_cli(
        ["bash", "-c", command], cwd=clone, timeout_s=300, merge=True,
        env={**env, "TOKENRELAY_BASE": base, "npm_config_prefer_offline": "true"},
    )  # fmt: skip
    assert ran.code == 0, ran.out[-3000:]
    assert len(ran.out.strip().splitlines()[-1]) > 20, ran.out[-3000:]
