"""The KV connector across hosts: "RayStoreConnector" on a local two-node Ray cluster (two
raylets on this machine, ray.cluster_utils.Cluster). The producer engine runs in this process on
the head node, the consumer in an actor on the other node; the blocks travel through the store
actor. The consumer's greedy tokens equal the producer's while it loads the prompt blocks."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

NAMESPACE = "jaxserve-kv-test"
CONFIG = dict(block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, warmup=False)  # fmt: skip
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(30 + 7 * i)] for i in range(3)]


def _kv(role: str) -> dict:
    return {"kv_connector": "RayStoreConnector", "kv_role": role,
            "kv_connector_extra_config": {"ray_namespace": NAMESPACE}}  # fmt: skip


def _greedy(engine, prompts) -> list[list[int]]:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    for _ in range(300):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    return [done[str(i)] for i in range(len(prompts))]


class _Consumer:
    """A consumer engine in an actor on the other node."""

    def run(self, prompts) -> tuple[list[list[int]], int, str]:
        import socket

        from jaxserve import LLMEngine

        engine = LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_consumer"), **CONFIG)
        tokens = _greedy(engine, prompts)
        loaded = engine.get_stats()["kv_connector_loaded_blocks"]
        return tokens, loaded, ray.get_runtime_context().get_node_id() + socket.gethostname()


@pytest.mark.slow
def test_engines_on_two_ray_nodes_share_kv_blocks():
    from ray.cluster_utils import Cluster

    from jaxserve import LLMEngine

    # This module is not importable on the workers: its actor class travels by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Two raylets on this machine (Ray binds them to the host's own address: its bootstrap
    # rewrites 127.0.0.1 to it; nothing leaves the machine).
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "resources": {"head": 1}})  # fmt: skip
    cluster.add_node(num_cpus=1, resources={"other": 1})
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        producer = LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_producer"),
                             **CONFIG)  # fmt: skip
        want = _greedy(producer, PROMPTS)
        store = producer.core.scheduler.kv_connector.store
        saved = producer.get_stats()["kv_connector_saved_blocks"]
        assert saved == sum(len(p) // 8 for p in PROMPTS)
        consumer = ray.remote(num_cpus=1, resources={"other": 1})(_Consumer).remote()
        tokens, loaded, where = ray.get(consumer.run.remote(PROMPTS), timeout=600)
        assert tokens == want
        assert loaded == sum((len(p) - 1) // 8 for p in PROMPTS)
        assert where.startswith(next(n["NodeID"] for n in ray.nodes()
                                     if "other" in n["Resources"]))  # fmt: skip
        store.kill()
    finally:
        ray.shutdown()
        cluster.shutdown()
