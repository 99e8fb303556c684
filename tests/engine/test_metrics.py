"""EngineMetrics on its own (no engine): the engine counters it mirrors from get_stats(),
host KV tier included, and the gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.metrics import EngineMetrics

HOST_COUNTERS = (
    "host_cache_hits",
    "device_to_host_bytes",
    "host_to_device_bytes",
    "num_swap_preemptions",
    "num_swap_fallbacks",
)


def _stats(**counters: int) -> dict[str, float]:
    base = dict(num_requests_running=2, num_requests_waiting=1, kv_cache_usage=0.25)
    base.update(prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    base.update(dict.fromkeys(HOST_COUNTERS, 0))
    return {**base, **counters}


def _samples(m: EngineMetrics) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
        if s.labels.get("model_name") == "m" and len(s.labels) == 1
    }


def test_host_tier_counters_follow_get_stats():
    m = EngineMetrics("m")
    m.observe_stats(_stats(host_cache_hits=32, device_to_host_bytes=4096, num_swap_preemptions=1))
    m.observe_stats(
        _stats(host_cache_hits=48, device_to_host_bytes=4096, host_to_device_bytes=2048)
    )
    samples = _samples(m)
    assert samples["jaxserve:host_cache_hits_total"] == 48
    assert samples["jaxserve:device_to_host_bytes_total"] == 4096
    assert samples["jaxserve:host_to_device_bytes_total"] == 2048
    # A counter never goes down: a stats value below the last one seen adds nothing.
    assert samples["jaxserve:num_swap_preemptions_total"] == 1
    assert samples["jaxserve:num_swap_fallbacks_total"] == 0
    assert samples["jaxserve:num_requests_running"] == 2
    assert samples["jaxserve:kv_cache_usage_perc"] == 0.25
