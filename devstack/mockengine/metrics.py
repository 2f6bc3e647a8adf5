"""The mock engine's Prometheus metrics, under vLLM's names (``/metrics``), so that the
worker's engine probes and dashboards read it as they read vLLM."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """The engine's Prometheus series, named as vLLM names them (its gauges read the
    engine's gate and cache when scraped)."""

    def __init__(self, engine_id: str, model: str, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        lv = {"model_name": model, "engine": engine_id}
        reg = self.registry

        def gauge(name: str, doc: str, fn: Any) -> None:
            Gauge(name, doc, labels, registry=reg).labels(**lv).set_function(fn)

        gauge(
            "vllm:num_requests_running",
            "Requests running on the engine.",
            lambda: engine.gate.running,
        )
        gauge(
            "vllm:num_requests_waiting",
            "Requests waiting in the FIFO queue.",
            lambda: engine.gate.waiting,
        )
        gauge(
            "vllm:gpu_cache_usage_perc",
            "Fraction of prefix-cache blocks in use (0..1).",
            lambda: engine.cache.stats().usage,
        )
        gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "Cumulative prefix-cache hit rate (tokens).",
            lambda: engine.cache.stats().hit_rate,
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up.", labels, registry=reg
        ).labels(**lv)
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the cache.", labels, registry=reg
        ).labels(**lv)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        ).labels(**lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(**lv)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._lv = lv
        self.aborted = Counter(
            "tokenrelay_engine_aborted_requests",
            "Requests aborted because the client went away.",
            labels,
            registry=reg,
        ).labels(**lv)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._lv, finished_reason=reason).inc()
        if reason == "abort":
            self.aborted.inc()
