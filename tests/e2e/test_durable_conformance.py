"""The official Durable Streams server conformance suite
(``@durable-streams/server-conformance-tests``, pinned in ``clients/durable/``, ``npm
ci`` from its committed lock) against two ``tokenrelay relay`` processes on the suite's
cluster.

The suite takes one base URL; it is given a round-robin proxy on loopback
(:mod:`tests.support.rrproxy`) that sends each request to the next relay, so a test's
create, appends and reads land on different relays (any relay serves any stream), and
mounts the suite's stream paths under the relays' ``--durable-open-prefix``. The suite
runs under its own vitest with the JSON reporter; every test must pass; the skipped ones
(the suite's own ``skip``) and those the spec let us choose otherwise are listed in
docs/DURABLE.md. Skipped with the reason where node/npm or the registry is missing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from devstack.cluster.launcher import ClusterInfo
from tests.support.cli import run_cli
from tests.support.npm import npm_ready
from tests.support.relay import relay_process
from tests.support.rrproxy import round_robin

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "clients" / "durable"
PACKAGE = SUITE / "node_modules" / "@durable-streams" / "server-conformance-tests"
MOUNT = "conformance/"
# the relays' flags: the open prefix, and a long-poll wait the suite's 21 s test timeout
# holds with room (the suite waits up to its default 20 s + 1)
FLAGS = ("--durable-open-prefix", "/" + MOUNT, "--durable-long-poll-s", "3")


def _results(report: dict[str, object]) -> tuple[list[str], list[str], list[str]]:
    """The names of the passed, failed and skipped tests of vitest's JSON report."""
    passed, failed, skipped = [], [], []
    for f in report["testResults"]:  # type: ignore[attr-defined]
        for t in f["assertionResults"]:
            name = t["fullName"]
            status = t["status"]
            if status == "passed":
                passed.append(name)
            elif status in ("skipped", "pending", "todo"):
                skipped.append(name)
            else:
                failed.append(f"{name}: {' | '.join(t.get('failureMessages', []))[:300]}")
    return passed, failed, skipped


@pytest.mark.timeout(900)  # about 340 tests, some of them long-polls: 2-4 minutes
async def test_conformance_suite(cluster: ClusterInfo, tmp_path: Path) -> None:
    why = await npm_ready(SUITE, "@durable-streams/server-conformance-tests")
    if why is not None:
        pytest.skip(why)
    node = shutil.which("node")
    assert node is not None
    vitest = SUITE / "node_modules" / "vitest" / "vitest.mjs"
    out = tmp_path / "conformance.json"
    async with (
        relay_process(cluster, tmp_path, "ds-conf-a", *FLAGS) as a,
        relay_process(cluster, tmp_path, "ds-conf-b", *FLAGS) as b,
        round_robin([a.base, b.base], MOUNT) as url,
    ):
        argv = [
            node, str(vitest), "run", "--config", "vitest.config.mjs", "--no-coverage",
            "--reporter=json", f"--outputFile={out}",
        ]  # fmt: skip
        env = {**os.environ, "CONFORMANCE_TEST_URL": url, "NO_COLOR": "1"}
        ran = await run_cli(argv, env=env, cwd=SUITE, timeout_s=900)
    assert out.exists(), f"the suite wrote no report (exit {ran.code}): {ran.err[-2000:]}"
    passed, failed, skipped = _results(json.loads(out.read_text()))
    summary = f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped"
    (tmp_path / "summary.txt").write_text(summary + "\n" + "\n".join(failed) + "\n")
    print(f"durable streams conformance: {summary}")
    assert not failed, summary + "\n" + "\n".join(failed)
    assert passed, "the suite ran no test"
