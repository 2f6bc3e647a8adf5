"""docker-compose.yml stays true to the CLI: every command parses, ports line up.

No Docker engine runs here, so the file is checked by parsing it; where a compose
binary exists, ``config -q`` validates it too (it needs no engine).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest

from devstack.cli import build_parser as devstack_parser
from tests.support.cli import run_cli
from tokenrelay.cli import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
# the development stack's commands (mock engine, cluster init): not in the wheel, run
# from the image's copy of devstack/
DEVSTACK = ["python", "-m", "devstack"]
NGINX = ROOT / "deploy" / "nginx.conf"
_VAR = re.compile(r"\$\{([A-Z0-9_]+):-([^}]*)\}")


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def _argv(command: list[str]) -> list[str]:
    return [_VAR.sub(lambda m: m.group(2), part) for part in command]


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_the_stack_has_every_service() -> None:
    names = set(_services())
    assert {f"redis-{i}" for i in range(1, 7)} <= names
    assert {"redis-init", "engine-1", "engine-2", "engine-3"} <= names
    assert {"worker-1", "worker-2", "relay-1", "relay-2", "ingress"} <= names
    assert {"rabbitmq", "jobworker"} <= names


def test_every_tokenrelay_command_parses_with_the_real_cli() -> None:
    parsers = {"tokenrelay": build_parser(), "devstack": devstack_parser()}
    checked = {"tokenrelay": 0, "devstack": 0}
    for name, svc in _services().items():
        if svc.get("image", "").startswith("tokenrelay"):
            assert svc.get("entrypoint", DEVSTACK) == DEVSTACK, name  # else the image's
            which = "devstack" if "entrypoint" in svc else "tokenrelay"
            args = parsers[which].parse_args(_argv(svc["command"]))
            assert callable(args.func), name
            checked[which] += 1
    assert checked == {"tokenrelay": 2 + 1 + 2, "devstack": 1 + 3}  # workers, job worker,
    # relays; cluster init, engines


def test_the_image_holds_the_devstack_its_services_run() -> None:
    text = DOCKERFILE.read_text()
    final = text.rsplit("\nFROM ", 1)[1]  # the image's own stage
    assert "WORKDIR /app" in final  # python -m devstack finds ./devstack there
    assert "COPY devstack ./devstack" in final
    assert "COPY bench" not in text  # the benchmarks run from a checkout only
    assert '"tokenrelay"]' in final.splitlines()[-1]  # ENTRYPOINT: the installed wheel


def test_redis_init_forms_exactly_the_nodes_that_run() -> None:
    services = _services()
    init = _argv(services["redis-init"]["command"])
    nodes = _flag(init, "--node")
    assert len(nodes) == 6
    for node in nodes:
        host, port = node.split(":")
        cmd = services[host]["command"]
        assert cmd[cmd.index("--port") + 1] == port
        assert cmd[cmd.index("--cluster-enabled") + 1] == "yes"
        assert port != "6379"
    assert init[init.index("--replicas") + 1] == "1"


def test_ports_line_up_between_processes_and_the_ingress() -> None:
    services = _services()
    conf = NGINX.read_text()
    for kind in ("relay", "worker"):
        for i in (1, 2):
            argv = _argv(services[f"{kind}-{i}"]["command"])
            port = argv[argv.index("--port") + 1]
            assert f"server {kind}-{i}:{port}" in conf
            assert argv[argv.index("--host") + 1] == "0.0.0.0"
    worker = _argv(services["worker-1"]["command"])
    for url in _flag(worker, "--engine"):
        host, port = url.removeprefix("http://").split(":")
        engine = _argv(services[host]["command"])
        assert engine[engine.index("--port") + 1] == port
    assert services["ingress"]["ports"] == ["8080:8080"]
    assert "listen 8080;" in conf


def test_dependency_order_and_healthchecks() -> None:
    services = _services()
    for name in ("worker-1", "worker-2", "relay-1", "relay-2"):
        deps = services[name]["depends_on"]
        assert deps["redis-init"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in services[name]
    for i in (1, 2, 3):
        assert services["worker-1"]["depends_on"][f"engine-{i}"]["condition"] == "service_healthy"
    for name, svc in services.items():
        if name != "redis-init":
            assert "healthcheck" in svc, f"{name} has no healthcheck"


def test_nginx_has_no_sticky_sessions_and_does_not_buffer_streams() -> None:
    conf = NGINX.read_text()
    assert "ip_hash" not in conf
    assert "sticky" not in conf.replace("no sticky", "")
    assert "proxy_buffering off;" in conf


async def test_compose_config_validates_where_a_compose_binary_exists() -> None:
    if shutil.which("docker-compose"):
        cmd = ["docker-compose", "-f", str(COMPOSE), "config", "-q"]
    elif shutil.which("docker"):
        probe = await run_cli(["docker", "compose", "version"], timeout_s=30)
        if probe.code != 0:
            pytest.skip("no docker compose plugin and no docker-compose binary")
        cmd = ["docker", "compose", "-f", str(COMPOSE), "config", "-q"]
    else:
        pytest.skip("no compose binary on PATH; the file was checked by parsing above")
    # The file refuses to start without its secrets (no default secret or password).
    env = dict(
        os.environ,
        TOKENRELAY_SECRET=secrets.token_urlsafe(32),
        RABBITMQ_PASSWORD=secrets.token_urlsafe(16),
    )
    result = await run_cli(cmd, env=env, timeout_s=60)
    assert result.code == 0, result.err
    for name in ("TOKENRELAY_SECRET", "RABBITMQ_PASSWORD"):
        unset = {k: v for k, v in env.items() if k != name}
        result = await run_cli(cmd, env=unset, timeout_s=60)
        assert result.code != 0, name
        assert f"set {name}" in result.err, name


def test_compose_has_no_default_secret() -> None:
    text = COMPOSE.read_text()
    assert "${TOKENRELAY_SECRET:?set TOKENRELAY_SECRET}" in text
    assert "TOKENRELAY_SECRET:-" not in text
    assert "${RABBITMQ_PASSWORD:?set RABBITMQ_PASSWORD}" in text


def _get_paths(app: Any) -> set[str]:
    return {
        r.resource.canonical
        for r in app.router.routes()
        if r.method in ("GET", "*") and r.resource is not None
    }


def test_healthchecks_probe_routes_the_services_really_serve() -> None:
    from devstack.mockengine.server import EngineConfig
    from devstack.mockengine.server import make_app as engine_app
    from relay.edge.config import RelayConfig
    from relay.edge.http.app import make_app as relay_app
    from worker.api import make_app as worker_app
    from worker.config import WorkerConfig

    paths = {
        "relay": _get_paths(relay_app(RelayConfig(secret=secrets.token_urlsafe(32)))),
        "worker": _get_paths(worker_app(WorkerConfig(engine_urls=("e=http://e",), engine_cap=1))),
        "engine": _get_paths(engine_app(EngineConfig())),
    }
    checked = 0
    for name, svc in _services().items():
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        url = re.search(r"http://127\.0\.0\.1:8000(/[a-z/]*)", test)
        if url is None or not svc.get("command"):
            continue
        kind = svc["command"][0]
        assert url.group(1) in paths[kind], f"{name}: {url.group(1)} is not a {kind} route"
        checked += 1
    assert checked == 7  # 3 engines, 2 workers, 2 relays


def test_the_ingress_answers_health_itself_and_404s_unknown_paths() -> None:
    conf = NGINX.read_text()
    assert "location = /healthz" in conf
    assert "try_files $uri /index.html" not in conf  # no HTML page for /metrics & co.
