"""Prometheus metrics for one server: request counters and latencies here, engine gauges read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from horizon.engine import Engine, Usage


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes (nothing to keep in sync)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        m = self.engine.metrics()

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"horizon_{name}", doc)
            g.add_metric([], float(value or 0))
            return g

        yield gauge("queue_length", "requests waiting for a slot", m["queue_length"])
        yield gauge("running_sequences", "sequences in the running batch", m["running"])
        yield gauge("cache_blocks_used", "DSA cache blocks in use (prefix cache included)", m["blocks_used"])
        yield gauge("cache_blocks_free", "DSA cache blocks free", m["blocks_free"])
        yield gauge("cache_blocks_prefix", "DSA cache blocks held by the prefix cache", m["blocks_prefix_cache"])
        yield gauge("kda_slots_free", "KDA state slots free", m["slots_free"])
        yield gauge("prefix_cache_entries", "finished turns kept for prefix reuse", m["prefix_entries"])
        yield gauge("prefix_cache_hits", "requests resumed from the prefix cache", m["prefix_hits"])
        yield gauge("preemptions", "sequences preempted for cache memory", m["preemptions"])
        yield gauge("tokens_per_second", "generated tokens per second (recent steps)", m["tokens_per_second"])
        yield gauge("indexer_topk_coverage", "sampled share of dense attention mass the DSA top-k keeps",
                    m["indexer_topk_coverage_mean"])
        yield gauge("decode_graphs_compiled", "compiled decode graphs ready (batch buckets x dense / sparse)",
                    m["decode_graphs_compiled"])
        yield gauge("decode_graphs_pending", "decode graphs the background compile has still to make (their steps "
                    "run eagerly meanwhile)", m["decode_graphs_pending"])
        yield gauge("compile_seconds", "time spent compiling decode graphs", m["compile_seconds"])
        tiers = GaugeMetricFamily("horizon_thinking_tokens", "thinking tokens generated per tier", labels=["tier"])
        for tier, n in m["thinking_tokens"].items():
            tiers.add_metric([tier], float(n))
        yield tiers


class TurnStoreCollector:
    """The server's memory of thinking turns (horizon.serving.turns): size, and restorations made and missed."""

    def __init__(self, turns):
        self.turns = turns

    def collect(self):
        t = self.turns
        for name, doc, value in (
                ("thinking_restored_turns", "assistant turns given back the thinking their client dropped", t.restored),
                ("thinking_unknown_turns", "tool-call turns without thinking the server could not restore (left to "
                                           "the history policy)", t.unknown),
                ("thinking_store_turns", "thinking turns kept for restoration", len(t)),
                ("thinking_store_bytes", "bytes the kept thinking turns take", t.nbytes)):
            g = GaugeMetricFamily(f"horizon_{name}", doc)
            g.add_metric([], float(value))
            yield g


class ServerMetrics:
    def __init__(self, engine: Engine, turns=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("horizon_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.tokens = Counter("horizon_tokens", "tokens by kind", ["kind"], registry=self.registry)
        self.ttft = Histogram("horizon_time_to_first_token_seconds", "time from request to first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                              registry=self.registry)
        self.registry.register(EngineCollector(engine))
        if turns is not None:
            self.registry.register(TurnStoreCollector(turns))

    def observe_usage(self, usage: Usage) -> None:
        self.tokens.labels("prompt").inc(usage.prompt_tokens)
        self.tokens.labels("completion").inc(usage.completion_tokens)
        self.tokens.labels("reasoning").inc(usage.reasoning_tokens)
        self.tokens.labels("cached_prompt").inc(usage.cached_tokens)
