"""The Grafana dashboard and the Prometheus alerts read metrics the code exports.

Every metric name in ``deploy/grafana/tokenrelay.json`` and ``deploy/prometheus/alerts.yml``
must be exported by a relay or a worker (their real registries, the relay's bound to a
real hub) and listed in the metrics table (docs/METRICS.md); the one outside name allowed is
kube-state-metrics' readiness series. Where ``promtool`` is installed (PATH, or unpacked
into .venv/tools by ``make promtool``), it checks the rules, runs their unit tests
(``alerts_test.yml``) and parses every dashboard query as a recording rule.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import RedisCluster

from relay.broker.rediscluster.broker import RedisBroker
from relay.edge.fanout.hub import Hub
from relay.edge.metrics import RelayMetrics
from tests.support.cli import run_cli
from worker.metrics import WorkerMetrics
from worker.routing.lease import EngineSpec
from worker.routing.router import Router

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenrelay.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
METRICS = ROOT / "docs" / "METRICS.md"
EXTERNAL = {"kube_pod_status_ready"}  # kube-state-metrics: the pods' readiness probes
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
# PromQL words that are not metric names (functions, aggregations, keywords).
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "clamp_min", "clamp_max", "absent", "by", "without", "on", "ignoring", "group_left",
    "group_right", "bool", "and", "or", "unless", "max_over_time", "min_over_time",
    "avg_over_time", "deriv", "delta", "topk", "bottomk", "offset", "e", "inf", "nan",
}  # fmt: skip


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: strings, label matchers, grouping clauses
    and range selectors removed, then every identifier that is not a PromQL word."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def _family(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _exposed(text: bytes) -> set[str]:
    """Every name a scrape can return: families (TYPE lines), histogram series, samples."""
    out: set[str] = set()
    for m in re.finditer(rb"^# TYPE (\S+) (\S+)", text, re.M):
        name, kind = m.group(1).decode(), m.group(2).decode()
        out.add(name)
        if kind == "histogram":
            out |= {name + s for s in HISTOGRAM_SUFFIXES}
    out |= {m.decode() for m in re.findall(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M)}
    return out


def _documented() -> set[str]:
    return set(re.findall(r"`(tokenrelay_[a-z_]+)", METRICS.read_text()))


def _referenced() -> dict[str, set[str]]:
    """metric name -> where it is used."""
    where: dict[str, set[str]] = {}
    for p in _panels():
        for t in p["targets"]:
            for n in metric_names(t["expr"]):
                where.setdefault(n, set()).add(f"panel {p['title']!r}")
    for r in _rules():
        for n in metric_names(r["expr"]):
            where.setdefault(n, set()).add(f"alert {r['alert']}")
    return where


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="b c"}[5m]))) '
        "/ clamp_min(sum without (pod) (b_total), 1e-9) > on (engine) group_left max(c)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


@pytest.mark.integration
async def test_every_metric_used_is_exported_and_documented(redis: RedisCluster) -> None:
    hub = Hub(RedisBroker(redis, "dashboards"), reap_interval_s=0)
    await hub.start()
    try:
        relay = RelayMetrics("dashboards")
        relay.bind_hub(hub.stats)
        exported = _exposed(relay.render()[0])
    finally:
        await hub.close()
    worker = WorkerMetrics()
    worker.bind_router(Router([EngineSpec(id="e", url="http://e", cap=1)]))
    exported |= _exposed(worker.render())
    used = _referenced()
    assert len(used) > 20
    missing = {n: sorted(w) for n, w in used.items() if n not in exported | EXTERNAL}
    assert missing == {}, "used but not exported"
    documented = _documented()
    undocumented = {
        n: sorted(w) for n, w in used.items() if _family(n) not in documented | EXTERNAL
    }
    assert undocumented == {}, "used but not in docs/METRICS.md"


def test_dashboard_covers_what_an_operator_asks() -> None:
    used = set(_referenced())
    for needed in (
        "tokenrelay_relay_connections",  # streams per relay
        "tokenrelay_relay_frames_out_total",  # frames per relay
        "tokenrelay_relay_hub_frames_in_total",
        "tokenrelay_relay_hop_latency_seconds_bucket",  # hop latencies
        "tokenrelay_relay_publish_to_edge_seconds_bucket",
        "tokenrelay_relay_edge_to_socket_seconds_bucket",
        "tokenrelay_relay_hub_gaps_total",  # gaps and repairs
        "tokenrelay_relay_hub_repairs_total",
        "tokenrelay_worker_engine_in_flight",  # engine in-flight vs cap
        "tokenrelay_worker_engine_cap",
        "tokenrelay_worker_route_spills_total",  # spills
        "tokenrelay_worker_cache_affinity_captured_total",  # cache affinity
        "tokenrelay_worker_ttft_seconds_bucket",  # TTFT
    ):
        assert needed in used, needed


def test_dashboard_is_well_formed() -> None:
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in _panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs == [chr(65 + i) for i in range(len(refs))], p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, p["title"]


def test_alerts_cover_the_failures_that_matter() -> None:
    by_name = {r["alert"]: r for r in _rules()}
    wanted = {
        "TokenrelayGaps": "tokenrelay_relay_hub_gaps_total",
        "TokenrelayRepairsRising": "tokenrelay_relay_hub_repairs_total",
        "TokenrelayRelayNotReady": "kube_pod_status_ready",
        "TokenrelayEngineOverCap": "tokenrelay_worker_engine_in_flight",
        "TokenrelayDoubleRelease": "tokenrelay_worker_router_double_releases_total",
    }
    for alert, metric in wanted.items():
        assert metric in metric_names(by_name[alert]["expr"]), alert
    for r in _rules():
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]


def _promtool() -> str:
    found = shutil.which("promtool")
    local = ROOT / ".venv" / "tools" / "usr" / "bin" / "promtool"
    if found:
        return found
    if local.exists():
        return str(local)
    pytest.skip("promtool not installed (make promtool unpacks it from Debian's prometheus)")


async def _run(*args: str, cwd: Path | None = None) -> None:
    out = await run_cli([_promtool(), *args], cwd=cwd, timeout_s=60)
    assert out.code == 0, out.out + out.err


async def test_promtool_checks_the_rules_and_their_unit_tests() -> None:
    await _run("check", "rules", str(ALERTS))
    await _run("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)


async def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(_dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    await _run("check", "rules", str(path))
