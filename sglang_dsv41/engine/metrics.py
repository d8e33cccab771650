"""Prometheus metrics of one server (a registry per app, so tests can run several apps).

Per-DP-rank gauges come from the leaders' latest RankStats at scrape time; request counters are
kept by the HTTP layer, labelled by route template (never the raw path) and status code, so
no request can add a series beyond routes x status codes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .dp_controller import DPController

PREFIX = "sglang_dsv41"


class _RankStatsCollector:
    def __init__(self, controller: "DPController"):
        self.controller = controller

    def describe(self):  # no fixed description: the label values appear with the first stats
        return []

    def collect(self):
        c = self.controller
        g_running = GaugeMetricFamily(f"{PREFIX}_num_running_reqs", "Running requests",
                                      labels=["dp_rank"])
        g_queued = GaugeMetricFamily(f"{PREFIX}_num_queued_reqs", "Queued requests",
                                     labels=["dp_rank"])
        g_inflight = GaugeMetricFamily(f"{PREFIX}_num_in_flight_reqs",
                                       "Requests dispatched and not finished", labels=["dp_rank"])
        g_kv = GaugeMetricFamily(f"{PREFIX}_kv_cache_usage", "Used fraction of the KV cache",
                                 labels=["dp_rank"])
        g_kv_used = GaugeMetricFamily(f"{PREFIX}_kv_used_tokens", "KV-cache tokens in use",
                                      labels=["dp_rank"])
        c_hit = CounterMetricFamily(f"{PREFIX}_prefix_cache_hit_tokens",
                                    "Prompt tokens served from the prefix cache",
                                    labels=["dp_rank"])
        c_prompt = CounterMetricFamily(f"{PREFIX}_prompt_tokens", "Prompt tokens received",
                                       labels=["dp_rank"])
        g_healthy = GaugeMetricFamily(f"{PREFIX}_healthy", "1 if every scheduler rank is healthy")
        in_flight = c.num_in_flight()
        for d in range(c.dp_size):
            label = [str(d)]
            g_inflight.add_metric(label, in_flight[d])
            s = c.stats.get(d)
            if s is None:
                continue
            g_running.add_metric(label, s.num_running)
            g_queued.add_metric(label, s.num_queued)
            g_kv_used.add_metric(label, s.kv_used_tokens)
            g_kv.add_metric(label, s.kv_used_tokens / s.kv_total_tokens if s.kv_total_tokens else 0)
            c_hit.add_metric(label, s.prefix_hit_tokens)
            c_prompt.add_metric(label, s.prompt_tokens)
        g_healthy.add_metric([], 1.0 if c.healthy else 0.0)
        yield from (g_running, g_queued, g_inflight, g_kv, g_kv_used, c_hit, c_prompt, g_healthy)


class ServerMetrics:
    def __init__(self, controller: "DPController"):
        self.registry = CollectorRegistry()
        self.registry.register(_RankStatsCollector(controller))
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.generated_tokens = Counter(f"{PREFIX}_generation_tokens",
                                        "Tokens generated", ["dp_rank"], registry=self.registry)

    def count(self, endpoint: str, status: int) -> None:
        """``endpoint`` is a route path from the app's route table (or "unmatched")."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
