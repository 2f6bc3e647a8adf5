"""docs/PROTOCOL.md's token examples in other languages, run as the reader would run
them (the Python one runs in-process: tests/unit/test_auth.py)."""

from __future__ import annotations

import shutil
import time

import pytest

from relay.protocol.auth import verify_token
from tests.support.cli import run_cli
from tests.unit.test_auth import SECRET, _doc_example


@pytest.mark.skipif(shutil.which("node") is None, reason="no node on PATH")
async def test_the_documented_node_example_mints_tokens_the_relay_accepts() -> None:
    out = await run_cli(
        ["node", "-e", _doc_example("mint-node"), "abc"],
        env={"TOKENRELAY_SECRET": SECRET, "TOKENRELAY_KID": "k1", "PATH": "/usr/bin:/bin"},
        timeout_s=30,
    )
    assert out.code == 0, out.err
    claims = verify_token(SECRET, out.out.strip(), "abc", time.time())
    assert (claims.session, claims.scope) == ("abc", "watch")
