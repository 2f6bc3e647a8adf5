"""What "Stream from your own backend" (README.md) needs from a running demo: its Redis
URL, its token secret and its OpenAI-compatible gateway, as environment variables in a
file the demo writes (mode 0600: it holds the secret) and names on the terminal, so the
README's producer programs run against the demo unchanged after
``set -a; . FILE; set +a``.

The variables are the ones a real deployment sets: ``TOKENRELAY_REDIS_URL`` and
``TOKENRELAY_SECRET`` (what relays read too), ``TOKENRELAY_BASE`` (the front door, where
clients/producer/examples/ find a relay), and the ``openai`` SDKs' own
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (both the Python SDK and the AI SDK's OpenAI
provider read them), with ``OPENAI_MODEL``, the model the gateway serves.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

__all__ = ["ENV_FILE", "backend_env", "env_file_text", "write_env_file"]

ENV_FILE = "backend.env"  # in the demo's log folder, removed when the demo stops


def backend_env(
    redis_url: str, secret: str, base: str, gateway_key: str, model: str
) -> dict[str, str]:
    """The variables, by name: the OpenAI ones only with a gateway (``gateway_key``),
    the secret only with auth on (``secret``)."""
    env = {"TOKENRELAY_REDIS_URL": redis_url, "TOKENRELAY_BASE": base.rstrip("/")}
    if secret:
        env["TOKENRELAY_SECRET"] = secret
    if gateway_key:
        env["OPENAI_BASE_URL"] = base.rstrip("/") + "/v1"
        env["OPENAI_API_KEY"] = gateway_key
        env["OPENAI_MODEL"] = model
    return env


def env_file_text(env: dict[str, str]) -> str:
    """``NAME=value`` lines a POSIX shell reads with ``.`` (each value quoted for it)."""
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in env.items())


def write_env_file(folder: str | Path, env: dict[str, str]) -> Path:
    """Write the file into ``folder``, readable by its owner only; its path."""
    path = Path(folder) / ENV_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(env_file_text(env))
    return path
