"""A replica's share of the machine (placement.py) and the merged /metrics (metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.fleet.metrics import KV_USAGE, WAITING, load_gauges, merge_expositions
from jaxserve.fleet.placement import detect_platform, plan_placements


def test_cpu_replicas_get_disjoint_equal_slices_of_the_cores():
    placements = plan_placements(3, 1, "cpu", cpus=[5, 0, 1, 2, 3, 4, 6], gpus=[])
    assert [p.cpus for p in placements] == [(0, 1), (2, 3), (4, 5)]
    assert all(p.env == {} for p in placements)
    shared = plan_placements(3, 1, "cpu", cpus=[0, 1], gpus=[])  # fewer cores than replicas
    assert all(p.cpus is None for p in shared)


def test_gpu_replicas_see_tensor_parallel_size_gpus_each():
    placements = plan_placements(2, 2, "gpu", cpus=[0], gpus=["0", "1", "2", "3"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="needs 6 GPUs; this machine shows 4"):
        plan_placements(3, 2, "gpu", cpus=[0], gpus=["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="not on 'tpu'"):
        plan_placements(2, 1, "tpu", cpus=[0], gpus=[])
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        plan_placements(0, 1, "cpu", cpus=[0], gpus=[])


def test_the_platform_comes_from_jax_platforms_first():
    assert detect_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert detect_platform({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    assert detect_platform({"JAX_PLATFORMS": "tpu"}) == "tpu"


_REPLICA = """# HELP jaxserve:num_requests_waiting Waiting.
# TYPE jaxserve:num_requests_waiting gauge
jaxserve:num_requests_waiting{{model_name="m"}} {waiting}
# HELP jaxserve:kv_cache_usage_perc Usage.
# TYPE jaxserve:kv_cache_usage_perc gauge
jaxserve:kv_cache_usage_perc{{model_name="m"}} {kv}
# HELP jaxserve:prefix_cache_hits Hits.
# TYPE jaxserve:prefix_cache_hits counter
jaxserve:prefix_cache_hits_total{{model_name="m"}} {hits}
# HELP jaxserve:ttft Time to first token.
# TYPE jaxserve:ttft histogram
jaxserve:ttft_bucket{{le="0.1",model_name="m"}} {hits}
jaxserve:ttft_bucket{{le="+Inf",model_name="m"}} {hits}
jaxserve:ttft_count{{model_name="m"}} {hits}
jaxserve:ttft_sum{{model_name="m"}} 1.5
"""


def test_merged_metrics_label_each_replica_and_sum_them():
    texts = [
        _REPLICA.format(waiting=2, kv=0.5, hits=10),
        None,  # a replica that did not answer: left out
        _REPLICA.format(waiting=1, kv=0.25, hits=4),
    ]
    assert load_gauges(texts[0])[WAITING] == 2 and load_gauges(texts[0])[KV_USAGE] == 0.5
    merged = merge_expositions(texts, "# TYPE jaxserve:front_x counter\njaxserve:front_x 1\n")
    samples = {}
    for family in text_string_to_metric_families(merged):  # a valid exposition
        for s in family.samples:
            samples[(s.name, s.labels.get("replica"), s.labels.get("le"))] = s.value
    assert samples[("jaxserve:num_requests_waiting", "0", None)] == 2
    assert samples[("jaxserve:num_requests_waiting", "2", None)] == 1
    assert samples[("jaxserve:num_requests_waiting", None, None)] == 3
    assert samples[("jaxserve:kv_cache_usage_perc", None, None)] == pytest.approx(0.375)  # mean
    assert samples[("jaxserve:prefix_cache_hits_total", None, None)] == 14
    assert samples[("jaxserve:ttft_bucket", None, "+Inf")] == 14
    assert samples[("jaxserve:ttft_sum", None, None)] == 3.0
    assert ("jaxserve:num_requests_waiting", "1", None) not in samples
    assert samples[("jaxserve:front_x_total", None, None)] == 1
