"""deploy/k8s stays valid Kubernetes and true to the code.

Every object of the base and the mock-engines component is validated against the
schemas of a pinned Kubernetes version (``kubernetes-validate``, strict: unknown fields
fail); the example overlay is built with ``kustomize`` or ``kubectl kustomize`` where
either binary exists (skipped with the reason otherwise) and its output validated too.
The rest reads the raw manifests: every container command parses with the real CLI and
yields a valid config, probes hit routes the apps serve, grace periods cover preStop +
drain deadline, selectors and ports line up, the HPA's custom metric is exported, and the
ingress is streaming-safe without stickiness.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from devstack.cli import build_parser as devstack_parser
from relay.edge.config import ENV, from_args
from relay.edge.metrics import RelayMetrics
from relay.protocol.keys import new_session_id
from tests.support.cli import run_cli
from tokenrelay.cli import build_parser

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests are checked against
ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = [
    *sorted((K8S / "base").glob("*.yaml")),
    *sorted((K8S / "components" / "mock-engines").glob("*.yaml")),
]
CONFIG_ENV = K8S / "base" / "config.env"
MARGIN_S = 5  # cleanup after the drain: hub, Redis, HTTP runner


# what the Secret would hold (never committed as a manifest): a strong random value
POD_SECRET = "k8s-test-secret-4f1c9a7e2d6b8053c1e9a4d7"


def _objects(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        for doc in yaml.safe_load_all(p.read_text()):
            if doc and "kustomize.config.k8s.io" not in doc.get("apiVersion", ""):
                out.append(doc)
    return out


def _find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = obj["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _config() -> dict[str, str]:
    pairs = (ln.split("=", 1) for ln in CONFIG_ENV.read_text().splitlines())
    return {k: v for k, v in (p for p in pairs if len(p) == 2) if not k.startswith("#")}


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in args]


def _pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes would fill it (fields faked)."""
    env = dict(_config()) if container.get("envFrom") else {}
    fields = {"metadata.name": "pod-0", "status.podIP": "10.0.0.7"}
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in src:
            env[e["name"]] = fields[src["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in src:
            env[e["name"]] = _config()[src["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in src:
            env[e["name"]] = POD_SECRET
    return env


def _labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _prestop_s(container: dict[str, Any]) -> float:
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    return float(cmd[1])


OBJECTS = _objects(MANIFESTS)


@pytest.mark.parametrize(
    "obj", OBJECTS, ids=[f"{o['kind']}/{o['metadata']['name']}" for o in OBJECTS]
)
def test_every_object_is_valid_for_the_pinned_kubernetes(obj: dict[str, Any]) -> None:
    kv.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_object() -> None:
    broken = copy.deepcopy(_find(OBJECTS, "Deployment", "tokenrelay-relay"))
    _container(broken)["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


def test_relay_command_and_environment_make_a_valid_config() -> None:
    c = _container(_find(OBJECTS, "Deployment", "tokenrelay-relay"))
    env = _pod_env(c)
    assert set(env) <= set(ENV.values()), "an env var the relay does not read"
    args = build_parser().parse_args(_expand(c["args"], env))
    cfg = from_args(args, env)
    assert (cfg.host, cfg.port, cfg.relay_id) == ("0.0.0.0", 8000, "pod-0")
    assert cfg.redis_url == _config()["TOKENRELAY_REDIS_URL"]
    assert cfg.auth_enabled
    assert cfg.secret == POD_SECRET


def test_worker_command_parses_with_the_real_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.cli import config_from_args

    c = _container(_find(OBJECTS, "Deployment", "tokenrelay-worker"))
    env = _pod_env(c)
    for k, v in env.items():  # --redis and --secret default to the environment
        monkeypatch.setenv(k, v)
    cfg = config_from_args(build_parser().parse_args(_expand(c["args"], env)))
    assert cfg.worker_id == "pod-0"
    assert cfg.secret == POD_SECRET
    assert cfg.redis_url == _config()["TOKENRELAY_REDIS_URL"]
    assert cfg.shutdown_deadline_s == float(_config()["TOKENRELAY_SHUTDOWN_DEADLINE_S"])
    assert cfg.discover_engines, "the base finds engines that announce themselves"


def test_mock_engine_command_parses_and_announces_itself() -> None:
    from devstack.mockengine.cli import EngineSettings
    from relay.service.settings import load

    c = _container(_find(OBJECTS, "StatefulSet", "mock-engine"))
    assert c["command"] == ["python", "-m", "devstack"]  # the image's copy (Dockerfile)
    env = _pod_env(c)
    opts = load(EngineSettings, devstack_parser().parse_args(_expand(c["args"], env)), env)
    assert (opts.engine_id, opts.port, opts.host) == ("pod-0", 8000, "0.0.0.0")
    assert opts.redis_url == _config()["TOKENRELAY_REDIS_URL"]
    assert opts.announce_url == "http://10.0.0.7:8000"
    assert opts.cap == int(_config()["TOKENRELAY_ENGINE_CAP"])


def _routes(app: Any) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}


def test_probes_hit_routes_the_apps_serve() -> None:
    from relay.edge.config import RelayConfig
    from relay.edge.http.app import make_app as relay_app
    from worker.api import make_app as worker_app
    from worker.config import WorkerConfig

    served = {
        "tokenrelay-relay": _routes(relay_app(RelayConfig(insecure_no_auth=True))),
        "tokenrelay-worker": _routes(worker_app(WorkerConfig())),
    }
    for name, routes in served.items():
        c = _container(_find(OBJECTS, "Deployment", name))
        ports = {p["name"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert ("GET", get["path"]) in routes
            assert get["port"] in ports


def test_grace_periods_cover_prestop_and_the_drain_deadlines() -> None:
    cfg = _config()
    for name, deadline in (
        ("tokenrelay-relay", float(cfg["TOKENRELAY_DRAIN_DEADLINE_S"])),
        ("tokenrelay-worker", float(cfg["TOKENRELAY_SHUTDOWN_DEADLINE_S"])),
    ):
        spec = _find(OBJECTS, "Deployment", name)["spec"]["template"]["spec"]
        need = _prestop_s(_container(_find(OBJECTS, "Deployment", name))) + deadline + MARGIN_S
        assert spec["terminationGracePeriodSeconds"] >= need, name
    relay = _container(_find(OBJECTS, "Deployment", "tokenrelay-relay"))
    assert _pod_env(relay)["TOKENRELAY_DRAIN_DEADLINE_S"] == cfg["TOKENRELAY_DRAIN_DEADLINE_S"]


def test_selectors_and_ports_line_up() -> None:
    workloads = [o for o in OBJECTS if o["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in (o for o in OBJECTS if o["kind"] == "Service"):
        sel = svc["spec"]["selector"].items()
        picked = [w for w in workloads if sel <= _labels(w).items()]
        assert len(picked) == 1, svc["metadata"]["name"]
        names = {p["name"] for p in _container(picked[0])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
        assert svc["spec"].get("sessionAffinity", "None") == "None"
    for pdb in (o for o in OBJECTS if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert [w for w in workloads if w["spec"]["selector"]["matchLabels"] == sel]


def test_autoscalers_target_deployments_and_an_exported_gauge() -> None:
    relay = _find(OBJECTS, "HorizontalPodAutoscaler", "tokenrelay-relay")["spec"]
    worker = _find(OBJECTS, "HorizontalPodAutoscaler", "tokenrelay-worker")["spec"]
    for spec, name in ((relay, "tokenrelay-relay"), (worker, "tokenrelay-worker")):
        assert spec["scaleTargetRef"]["name"] == name
        target = _find(OBJECTS, "Deployment", name)
        assert "replicas" not in target["spec"], f"{name}: the HPA owns replicas"
        assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    (metric,) = relay["metrics"]
    name = metric["pods"]["metric"]["name"]
    text = RelayMetrics("hpa").render()[0].decode()
    assert f"# TYPE {name} gauge" in text, "the relay HPA's metric is not an exported gauge"
    assert worker["metrics"][0]["resource"]["name"] == "cpu"
    container = _container(_find(OBJECTS, "Deployment", "tokenrelay-worker"))
    assert "cpu" in container["resources"]["requests"], "CPU utilization needs a request"


def test_ingress_is_streaming_safe_and_not_sticky() -> None:
    ingresses = [o for o in OBJECTS if o["kind"] == "Ingress"]
    for ing in ingresses:
        keys = " ".join(ing["metadata"].get("annotations", {}))
        assert not re.search(r"affinity|session-cookie|upstream-hash-by", keys)
        assert "non_idempotent" not in str(ing["metadata"].get("annotations"))
    streams = _find(OBJECTS, "Ingress", "tokenrelay-streams")
    ann = streams["metadata"]["annotations"]
    pre = "nginx.ingress.kubernetes.io/"
    assert ann[pre + "proxy-buffering"] == "off"
    assert int(ann[pre + "proxy-read-timeout"]) >= 3600
    assert int(ann[pre + "proxy-send-timeout"]) >= 3600
    (path,) = streams["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"]["name"] == "tokenrelay-relay"
    sid = new_session_id()
    for tail, relay in (("events", True), ("ws", True), ("turns", False)):
        assert bool(re.match(path["path"], f"/v1/sessions/{sid}/{tail}")) is relay
    api = _find(OBJECTS, "Ingress", "tokenrelay-api")
    (path,) = api["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"]["name"] == "tokenrelay-worker"
    assert re.match(path["path"], f"/v1/sessions/{sid}/turns")
    openai = _find(OBJECTS, "Ingress", "tokenrelay-openai")
    assert openai["metadata"]["annotations"][pre + "proxy-buffering"] == "off"
    (path,) = openai["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"]["name"] == "tokenrelay-worker"
    rid = f"resp_{sid}_3_17"
    for url, ok in (
        ("/v1/chat/completions", True),
        ("/v1/responses", True),
        (f"/v1/responses/{rid}", True),
        (f"/v1/responses/{rid}/cancel", True),
        (f"/v1/responses/{rid}/input_items", True),
        ("/v1/jobs", False),
    ):
        assert bool(re.match(path["path"], url)) is ok, url


def test_the_token_secret_comes_from_one_secret() -> None:
    refs = set()
    for w in (o for o in OBJECTS if o["kind"] in ("Deployment", "StatefulSet")):
        for e in _container(w).get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((e["name"], ref["name"], ref["key"]))
    assert refs == {
        ("TOKENRELAY_SECRET", "tokenrelay-secret", "secret"),
        ("TOKENRELAY_ADMIN_KEY", "tokenrelay-secret", "admin-key"),
        ("TOKENRELAY_GATEWAY_KEYS", "tokenrelay-secret", "gateway-keys"),
    }
    assert not [o for o in OBJECTS if o["kind"] == "Secret"], "never commit a secret"


def _major(version_text: str) -> int:
    """The major version of kustomize in ``kustomize version`` / ``kubectl version``."""
    m = re.search(r"(?:Kustomize Version: |kustomize/|^)v?(\d+)\.\d+", version_text, re.M)
    return int(m.group(1)) if m else 0


async def _kustomize() -> list[str]:
    """kustomize >= 4 (components): the binary, else kubectl's embedded one."""
    candidates = (
        (["kustomize", "build"], ["kustomize", "version"]),
        (["kubectl", "kustomize"], ["kubectl", "version", "--client"]),
    )
    for build, version in candidates:
        if shutil.which(build[0]):
            out = await run_cli(version, timeout_s=30)
            if _major(out.out) >= 4:
                return build
    pytest.skip(
        "no kustomize >= 4 (kustomize, or the one in kubectl >= 1.21) on PATH: "
        "the overlay build is not checked"
    )


async def _build(path: Path) -> list[dict[str, Any]]:
    out = await run_cli([*await _kustomize(), str(path)], timeout_s=60)
    assert out.code == 0, out.err
    return [d for d in yaml.safe_load_all(out.out) if d]


async def test_example_overlay_builds_into_valid_objects() -> None:
    objs = await _build(K8S / "overlays" / "example")
    for obj in objs:
        kv.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "tokenrelay"
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("Deployment") == 2
    assert kinds.count("StatefulSet") == 1
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["name"].startswith("tokenrelay-config-")  # hashed: rolls pods
    assert cm["data"]["TOKENRELAY_REDIS_URL"] != _config()["TOKENRELAY_REDIS_URL"]
    for w in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        c = _container(w)
        assert c["image"] == "registry.example.com/tokenrelay:0.1.0"
        names = {e["configMapKeyRef"]["name"] for e in _refs(c) if "configMapKeyRef" in e}
        names |= {f["configMapRef"]["name"] for f in c.get("envFrom", [])}
        assert names <= {cm["metadata"]["name"]}


def _refs(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["valueFrom"] for e in container.get("env", []) if "valueFrom" in e]


async def test_real_engines_patch_gives_the_workers_their_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.cli import config_from_args

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copy(K8S / "overlays" / "example" / "real-engines.yaml", overlay)
    base = os.path.relpath(K8S / "base", overlay)  # kustomize wants a relative root
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{base}]\n"
        "patches:\n"
        "  - path: real-engines.yaml\n"
        "    target: {kind: Deployment, name: tokenrelay-worker}\n"
    )
    objs = await _build(overlay)
    c = _container(_find(objs, "Deployment", "tokenrelay-worker"))
    env = _pod_env({**c, "envFrom": True})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = config_from_args(build_parser().parse_args(_expand(c["args"], env)))
    assert [e.id for e in cfg.engines] == ["vllm-0", "vllm-1"]
    assert cfg.engines[0].cap == int(_config()["TOKENRELAY_ENGINE_CAP"])
