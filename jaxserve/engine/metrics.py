"""EngineMetrics: the engine's Prometheus metrics, with vLLM's names under a ``jaxserve:``
prefix, in a registry of their own (one per engine: two engines in a process never mix).

    gauges      num_requests_running, num_requests_waiting (scheduler requests: one per sample),
                kv_cache_usage_perc (0..1, as vLLM)
    counters    prefix_cache_queries, prefix_cache_hits (tokens), num_preemptions,
                prompt_tokens, generation_tokens, request_success{finished_reason};
                the host KV tier's (jaxserve's own names, as get_stats() has them; all 0
                without a tier): host_cache_hits (tokens), device_to_host_bytes,
                host_to_device_bytes, num_swap_preemptions, num_swap_fallbacks
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                e2e_request_latency_seconds, request_queue_time_seconds

Fed by the engine loop (AsyncLLM): ``observe_stats`` after every step and every batch of new
requests or aborts, ``observe_output`` with every RequestOutput, ``observe_abort`` for each
request aborted before it finished. While every request wants its final output only (a batch
job), the loop sees finished outputs only: each request's inter-token latency is then its
average, observed once per token.
"""

from __future__ import annotations

from typing import Any

import prometheus_client as prom

from jaxserve.outputs import RequestOutput

PREFIX = "jaxserve:"
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Engine counters mirrored as Prometheus counters: stats key -> metric name.
_MIRRORED = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "host_cache_hits": "host_cache_hits",
    "device_to_host_bytes": "device_to_host_bytes",
    "host_to_device_bytes": "host_to_device_bytes",
    "num_swap_preemptions": "num_swap_preemptions",
    "num_swap_fallbacks": "num_swap_fallbacks",
    # the KV connector's blocks (0 without one): loaded from and saved to its store
    "kv_connector_loaded_blocks": "kv_connector_loaded_blocks",
    "kv_connector_saved_blocks": "kv_connector_saved_blocks",
    # lookups or loads that gave a request less KV than its kv_transfer_params promised
    "kv_connector_load_failures": "kv_connector_load_failures",
    # JaxTransferConnector: a producer's offers released by the cap and at their lease's end,
    # a consumer's pulls abandoned past pull_timeout_s and refused while too many hang
    "kv_transfer_offers_evicted": "kv_transfer_offers_evicted",
    "kv_transfer_offers_expired": "kv_transfer_offers_expired",
    "kv_transfer_pulls_abandoned": "kv_transfer_pulls_abandoned",
    "kv_transfer_pulls_refused": "kv_transfer_pulls_refused",
    # speculative decoding (vLLM's names; 0 while it is off)
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
}


class EngineMetrics:
    """Args:
    model_name: the ``model_name`` label of every metric (the served model's name).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = prom.CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> prom.Histogram:
            metric = prom.Histogram(PREFIX + name, doc, label, buckets=buckets, registry=reg)
            return metric.labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (1 = all)."
        )
        self.kv_transfer_offer_blocks_held = gauge(
            "kv_transfer_offer_blocks_held",
            "KV blocks a JaxTransferConnector producer holds offered (0 without one).",
        )
        self._mirrored = {
            key: counter(name, f"Engine counter {key}.") for key, name in _MIRRORED.items()
        }
        self._mirrored_last = dict.fromkeys(_MIRRORED, 0)
        self._accepted_per_pos = prom.Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative drafts, by position in their run (0-based).",
            ["model_name", "position"],
            registry=reg,
        )
        self._accepted_per_pos_last: list[int] = []
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = prom.Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        # request id -> (output tokens seen, time of the latest): for the inter-token latency.
        self._seen: dict[str, tuple[int, float]] = {}

    @property
    def content_type(self) -> str:
        return prom.CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prom.generate_latest(self.registry)

    # ---- fed by the engine loop -------------------------------------------------------------
    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Gauges and mirrored counters from LLMEngine.get_stats()."""
        self.num_requests_running.set(stats["num_requests_running"])
        self.num_requests_waiting.set(stats["num_requests_waiting"])
        self.kv_cache_usage_perc.set(stats["kv_cache_usage"])
        self.kv_transfer_offer_blocks_held.set(stats.get("kv_transfer_offer_blocks_held", 0))
        for key, metric in self._mirrored.items():
            value = stats.get(key, 0)
            if value > self._mirrored_last[key]:
                metric.inc(value - self._mirrored_last[key])
            self._mirrored_last[key] = value
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", [])
        last = self._accepted_per_pos_last + [0] * (len(per_pos) - len(self._accepted_per_pos_last))
        for pos, (value, before) in enumerate(zip(per_pos, last, strict=True)):
            if value > before:
                self._accepted_per_pos.labels(self.model_name, str(pos)).inc(value - before)
        self._accepted_per_pos_last = list(per_pos)

    def observe_output(self, out: RequestOutput) -> None:
        """Token counts and latencies of one (cumulative) RequestOutput."""
        m = out.metrics
        if m is None:
            return
        seen_tokens, seen_time = self._seen.get(out.request_id, (0, m.arrival_time))
        new_tokens = m.num_generation_tokens - seen_tokens
        if new_tokens > 0 and m.last_token_time is not None:
            if seen_tokens == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
                if m.time_in_queue is not None:
                    self.request_queue_time.observe(m.time_in_queue)
            else:
                # Tokens of one step arrive together: each gets an equal share of the gap.
                gap = (m.last_token_time - seen_time) / new_tokens
                for _ in range(new_tokens):
                    self.inter_token_latency.observe(gap)
            self.generation_tokens.inc(new_tokens)
            seen_tokens, seen_time = m.num_generation_tokens, m.last_token_time
        if out.finished:
            self._seen.pop(out.request_id, None)
            end = m.finished_time if m.finished_time is not None else seen_time
            self.e2e_request_latency.observe(end - m.arrival_time)
            for completion in out.outputs:
                self._success.labels(self.model_name, completion.finish_reason or "abort").inc()
        else:
            self._seen[out.request_id] = (seen_tokens, seen_time)

    def observe_abort(self, request_id: str, num_samples: int) -> None:
        """A request aborted before it finished (its samples count as finished by "abort")."""
        self._seen.pop(request_id, None)
        self._success.labels(self.model_name, "abort").inc(num_samples)
