"""Prometheus series of a replica's place in a fleet: its shared state, its phrase cache, the weight its agent
check reports. Read from the hub at collect time (metrics.Metrics registers `ReplicaCollector`).

KEDA scales on `sum(tts_engine_slots_in_use) / sum(tts_engine_max_slots)` (deploy/k8s/keda-scaledobject.yaml),
which metrics.py already exports; these series are for the operator: is Redis up, does the cache pay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent_server.fleet.agent_check import weight_pct


class ReplicaCollector(Collector):
    def __init__(self, hub: Any) -> None:
        self.hub = hub

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self.hub)

    @staticmethod
    def _families(hub: Any) -> list[Metric]:
        up = GaugeMetricFamily("tts_shared_state_up", "1 while the shared state (Redis, or this process) answers",
                               labels=["backend"])
        episodes = CounterMetricFamily("tts_shared_state_unavailable", "Times the shared state became unreachable")
        remote_up = GaugeMetricFamily("tts_phrase_cache_remote_up", "1 while the phrase cache's Redis answers "
                                      "(0 too when there is none)")
        entries = GaugeMetricFamily("tts_phrase_cache_entries", "Segments in the in-process phrase cache")
        size = GaugeMetricFamily("tts_phrase_cache_bytes", "Bytes of PCM in the in-process phrase cache")
        budget = GaugeMetricFamily("tts_phrase_cache_budget_bytes", "The in-process phrase cache's byte budget")
        lookups = CounterMetricFamily("tts_phrase_cache_lookups", "Segment lookups, by result", labels=["result"])
        stores = CounterMetricFamily("tts_phrase_cache_stores", "Segments stored in the phrase cache")
        evictions = CounterMetricFamily("tts_phrase_cache_evictions", "Entries evicted from the in-process cache")
        remote_errors = CounterMetricFamily("tts_phrase_cache_remote_errors", "Failed phrase cache Redis calls")
        weight = GaugeMetricFamily("tts_agent_weight_percent", "The weight the HAProxy agent check reports now "
                                   "(0 while draining, loading or failed)")
        families: list[Metric] = [up, episodes, remote_up, entries, size, budget, lookups, stores, evictions,
                                  remote_errors, weight]
        if hub is None:
            return families
        shared, cache = hub.shared, hub.phrase_cache
        up.add_metric(["redis" if shared.shared else "local"], 1.0 if shared.available else 0.0)
        episodes.add_metric([], float(getattr(shared, "failures", 0)))
        remote_up.add_metric([], 1.0 if cache.remote is not None and cache.remote.available else 0.0)
        stats = cache.stats
        entries.add_metric([], float(cache.entries))
        size.add_metric([], float(cache.bytes))
        budget.add_metric([], float(cache.budget_bytes))
        lookups.add_metric(["hit_local"], float(stats.hits_local))
        lookups.add_metric(["hit_remote"], float(stats.hits_remote))
        lookups.add_metric(["miss"], float(stats.misses))
        stores.add_metric([], float(stats.stores))
        evictions.add_metric([], float(stats.evictions))
        remote_errors.add_metric([], float(stats.remote_errors))
        capacity = hub.capacity()
        weight.add_metric([], float(weight_pct(capacity)) if hub.ready else 0.0)
        return families
