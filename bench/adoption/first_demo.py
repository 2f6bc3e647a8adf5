"""A newcomer's first ``make demo``: how long from the command to the page's URL, on a
fresh clone, and what it installs.

``python -m bench.adoption.first_demo [--pip-cache empty|warm] [--json PATH]`` clones
this checkout's committed HEAD into a temporary folder, runs ``make demo DEMO_ARGS="--port
0"`` there in a process group of its own (with a pip cache of its own, empty, unless
``--pip-cache warm``: the user's), and waits for the ``open http://...`` line. Then
Ctrl-C (SIGINT to the group, as a terminal sends it) and the folder is removed.

Figures: ``time_to_url_s`` (the command to the URL line), ``install_s`` (the command to
the install's stamp, ``.venv/.installed-demo``: creating the venv and ``pip install``),
``start_s`` (the rest: the Redis Cluster, engines, relays, workers), ``venv_mb`` (the
bytes of the clone's ``.venv``) and ``packages`` (distributions in it). The install
downloads from the package index: the figure depends on the network as much as on the
machine, and this benchmark needs it (it is not in ``make bench``).

Every process is started here and stopped by pid (the group's leader); loopback only
besides pip's downloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Bench, Common, Outcome, flag
from devstack.procs import Proc, ProcError, log_line

__all__ = ["add_arguments", "measure", "run_from_args"]

ROOT = Path(__file__).resolve().parents[2]
URL_LINE = re.compile(r"^open (http://\S+)", re.M)


@dataclass
class Flags(Common):
    pip_cache: str = flag("empty", "pip's cache: a new empty one, or the user's",
                          choices=("empty", "warm"))  # fmt: skip
    timeout: float = flag(900.0, "seconds to wait for the URL", above=0)


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


async def _stop_group(proc: Proc) -> None:
    """Ctrl-C to the group, then SIGTERM, then SIGKILL, each to the leader's group."""
    for sig, wait_s in ((signal.SIGINT, 60.0), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        if not proc.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if await proc.wait(wait_s) is not None:
            return


async def measure(pip_cache: str, timeout_s: float) -> dict[str, Any]:
    """One first ``make demo`` on a fresh clone; the figures of the module docstring."""
    with tempfile.TemporaryDirectory(prefix="first-demo-") as tmp:
        work = Path(tmp)
        clone, tmpdir = work / "tokenrelay", work / "tmp"
        tmpdir.mkdir()
        git = await asyncio.create_subprocess_exec("git", "clone", "-q", str(ROOT), str(clone))
        if await git.wait() != 0:
            raise RuntimeError("git clone of this checkout failed")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TMPDIR": str(tmpdir),
        }
        if pip_cache == "empty":
            env["PIP_CACHE_DIR"] = str(work / "pip-cache")
        # env -u: Proc puts this checkout on PYTHONPATH; a newcomer has none
        argv = ["env", "-u", "PYTHONPATH", "make", "demo", "DEMO_ARGS=--port 0"]
        out = work / "terminal.out"
        t0 = time.time()
        demo = Proc.start(argv, log=out, name="make demo", env=env, cwd=clone, new_session=True)
        try:
            await demo.ready(log_line("open http://"), timeout_s=timeout_s, every_s=0.2)
            url_s = time.time() - t0
            stamp = clone / ".venv" / ".installed-demo"
            install_s = stamp.stat().st_mtime - t0
            venv = clone / ".venv"
            site = next(venv.glob("lib/python*/site-packages"))
            packages = len(list(site.glob("*.dist-info")))
            m = URL_LINE.search(out.read_text())
            result = {
                "time_to_url_s": round(url_s, 1),
                "install_s": round(install_s, 1),
                "start_s": round(url_s - install_s, 1),
                "venv_mb": round(_size(venv) / 1e6, 1),
                "packages": packages,
                "pip_cache": pip_cache,
                "url": m.group(1) if m else "",
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            }
        except ProcError as exc:
            raise RuntimeError(f"make demo did not reach its URL: {exc}") from None
        finally:
            await _stop_group(demo)
            demo.kill()  # by pid, if it outlived its group's signals
        if "stopped: every process this demo started has exited" not in out.read_text():
            result["stopped_cleanly"] = False
        else:
            result["stopped_cleanly"] = True
        shutil.rmtree(work / "pip-cache", ignore_errors=True)
        return result


def _report(res: dict[str, Any]) -> str:
    return (
        f"first make demo on a fresh clone (pip cache {res['pip_cache']}): URL after "
        f"{res['time_to_url_s']} s (install {res['install_s']} s, start {res['start_s']} s), "
        f".venv {res['venv_mb']} MB, {res['packages']} packages; stopped cleanly: "
        f"{res['stopped_cleanly']}"
    )


def _measure(f: Flags) -> Outcome:
    if shutil.which("make") is None or shutil.which("git") is None:
        print("first_demo: needs make and git", file=sys.stderr)
        return Outcome({}, "", 2)
    res = asyncio.run(measure(f.pip_cache, f.timeout))
    return Outcome(res, _report(res), 0 if res["stopped_cleanly"] else 1)


BENCH = Bench(Flags, _measure, prog="python -m bench.adoption.first_demo", description=__doc__)
add_arguments, run_from_args = BENCH.add_arguments, BENCH.run_from_args

if __name__ == "__main__":
    raise SystemExit(BENCH.main(sys.argv[1:]))
