"""The KV connector end to end, two engines in one process sharing a store folder (as two
processes on one host share /dev/shm): a consumer's greedy tokens equal the producer's own (one
colocated engine) while it loads the prompts' blocks instead of computing them, asynchronously
(the default: a request waits for its KV while the others step) or synchronously; a store that
lost blocks (a producer killed mid-transfer, a lease expired) only makes the consumer compute
them, with the same tokens; aborts, also of a request waiting for its KV, free every block;
the connector's copies are warmed up (nothing compiles after); FP8 pages travel as they are."""

from __future__ import annotations

import os
import threading

import pytest
from engine_utils import SMALL, assert_nothing_held, random_prompts

from jaxserve import LLMEngine, SamplingParams
from jaxserve.core.kv_cache_utils import extend_block_hashes
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.job_shapes import job_request, job_warmup_set

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = dict(SMALL, num_kv_blocks=96)


def _kv(role: str, path: str) -> dict:
    return {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": path}}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv-store"))


@pytest.fixture(scope="module")
def producer(store_path) -> LLMEngine:
    return LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_producer", store_path),
                     **CONFIG)  # fmt: skip


@pytest.fixture(scope="module")
def consumer(store_path) -> LLMEngine:
    return LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_consumer", store_path),
                     **CONFIG)  # fmt: skip


def _run(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, GREEDY)
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    return [done[f"{tag}-{i}"] for i in range(len(prompts))]


def _store_files(engine: LLMEngine) -> list[str]:
    folder = engine.core.scheduler.kv_connector.store.folder
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


def test_a_consumer_loads_the_producers_blocks_and_answers_the_same(producer, consumer):
    prompts = random_prompts(4, seed=1, lo=20, hi=60)
    want = _run(producer, prompts, "p")
    saved = producer.get_stats()["kv_connector_saved_blocks"]
    assert saved == sum(len(p) // 8 for p in prompts) == len(_store_files(producer))
    before = consumer.get_stats()
    assert _run(consumer, prompts, "c") == want
    after = consumer.get_stats()
    loaded = after["kv_connector_loaded_blocks"] - before["kv_connector_loaded_blocks"]
    assert loaded == sum((len(p) - 1) // 8 for p in prompts)  # every block it may take over
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 8 * loaded
    assert_nothing_held(producer)
    assert_nothing_held(consumer)
    # The same prompts again on the producer: its own device cache, nothing saved twice.
    assert _run(producer, prompts, "p2") == want
    assert producer.get_stats()["kv_connector_saved_blocks"] == saved


def test_blocks_lost_in_transfer_are_recomputed_with_the_same_tokens(producer, consumer):
    """A producer killed mid-transfer: some blocks never reached the store, the last one only
    as a temporary file; another block expired. The consumer computes from the first one it
    cannot read."""
    prompts = random_prompts(3, seed=2, lo=40, hi=60)
    want = _run(producer, prompts, "q")
    files = _store_files(producer)
    os.unlink(files[len(files) // 2])
    os.replace(files[-1], files[-1] + ".123.tmp")
    old = os.stat(files[0]).st_mtime - 3600
    os.utime(files[1], (old, old))  # past its lease
    before = consumer.get_stats()["kv_connector_loaded_blocks"]
    assert _run(consumer, prompts, "d") == want
    loaded = consumer.get_stats()["kv_connector_loaded_blocks"] - before
    assert 0 < loaded < sum((len(p) - 1) // 8 for p in prompts)
    assert_nothing_held(consumer)


def test_a_producer_stores_again_a_cached_block_the_store_lost(producer):
    """A block that left the store (its lease ended) while it stayed in the producer's device
    cache is stored again by the next request that hits it, so what a prefill promises is
    there."""
    (prompt,) = random_prompts(1, seed=11, lo=30, hi=40)
    _run(producer, [prompt], "e")
    req = Request("h", prompt, GREEDY)
    folder = producer.scheduler.kv_connector.store.folder
    paths = [os.path.join(folder, h.hex()) for h in extend_block_hashes(req, 8, len(prompt))]
    assert all(os.path.exists(p) for p in paths)
    os.unlink(paths[1])
    saved = producer.get_stats()["kv_connector_saved_blocks"]
    _run(producer, [prompt], "e2")  # its blocks are prefix hits in the producer's own cache
    assert os.path.exists(paths[1])
    assert producer.get_stats()["kv_connector_saved_blocks"] == saved + 1


def test_aborted_requests_free_every_block_on_both_sides(producer, consumer):
    prompts = random_prompts(3, seed=3, lo=30, hi=50)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for engine, tag in ((producer, "ap"), (consumer, "ac")):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, long)
        for _ in range(3):
            engine.step()
        engine.abort_request([f"{tag}-{i}" for i in range(len(prompts))])
        assert_nothing_held(engine)


def _engine_request(engine: LLMEngine, request_id: str):
    (req,) = [r for rid, r in engine.scheduler.requests.items() if rid.startswith(request_id)]
    return req


@pytest.fixture
def gated_store(consumer, monkeypatch):
    """The consumer's store reads wait until the test opens the gate (a slow transfer)."""
    store = consumer.scheduler.kv_connector.store
    gate, read = threading.Event(), store.read_prefix
    monkeypatch.setattr(store, "read_prefix", lambda hashes: (gate.wait(60), read(hashes))[1])
    try:
        yield gate
    finally:
        gate.set()


def test_a_delayed_load_waits_while_the_others_step(producer, consumer, gated_store):
    stored, fresh = random_prompts(2, seed=5, lo=30, hi=50)
    (want,) = _run(producer, [stored], "s")
    consumer.add_request("slow", {"prompt_token_ids": stored}, GREEDY)
    consumer.add_request("other", {"prompt_token_ids": fresh[:12]}, GREEDY)
    slow, tokens = _engine_request(consumer, "slow#"), {}
    for _ in range(6):
        for out in consumer.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert slow.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # its KV is still being read
    assert len(tokens["other"]) >= 3 and "slow" not in tokens
    assert consumer.get_stats()["num_requests_waiting_for_remote_kvs"] == 1
    gated_store.set()
    for _ in range(200):
        for out in consumer.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if not consumer.has_unfinished_requests():
            break
    assert tokens["slow"] == want
    assert slow.num_cached_tokens == (len(stored) - 1) // 8 * 8  # loaded, not computed
    assert_nothing_held(consumer)


def test_an_abort_while_the_kv_loads_frees_everything(producer, consumer, gated_store):
    (stored,) = random_prompts(1, seed=8, lo=30, hi=50)
    _run(producer, [stored], "a")
    consumer.add_request("gone", {"prompt_token_ids": stored}, GREEDY)
    consumer.step()
    assert _engine_request(consumer, "gone#").status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert consumer.runner.kv_connector.num_pending_loads == 1
    consumer.abort_request("gone")
    assert_nothing_held(consumer)
    gated_store.set()
    consumer.step()  # hands the abort to the runner: the load is dropped, never written
    assert consumer.runner.kv_connector.num_pending_loads == 0
    assert_nothing_held(consumer)


def test_synchronous_loads_give_the_same_tokens(producer, consumer):
    connector = consumer.scheduler.kv_connector
    prompts = random_prompts(2, seed=9, lo=20, hi=40)
    want = _run(producer, prompts, "y")
    connector.load_async = False  # kv_connector_extra_config {"load_async": false}
    try:
        before = consumer.get_stats()["kv_connector_loaded_blocks"]
        assert _run(consumer, prompts, "z") == want
    finally:
        connector.load_async = True
    loaded = consumer.get_stats()["kv_connector_loaded_blocks"] - before
    assert loaded == sum((len(p) - 1) // 8 for p in prompts)
    assert_nothing_held(consumer)


def test_nothing_compiles_after_warmup_with_a_connector(producer, consumer):
    """The connector's copies are in the warm-up set and counted: after a warm-up for a job,
    the job's loads (and its steps) compile nothing."""
    runner = consumer.runner
    staging = runner.kv_connector.staging.compiles
    assert staging in runner.all_compiles()
    prompts = random_prompts(3, seed=10, lo=20, hi=60)
    want = _run(producer, prompts, "w")
    config = consumer.config
    what = job_warmup_set(
        [job_request(len(p), GREEDY, False) for p in prompts],
        runner.buckets,
        block_size=8,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        variant_widths=runner.sampling.variant_widths,
        copy_sizes=runner.copy_sizes,
        num_usable_blocks=consumer.info.num_kv_blocks - 1,
    )
    runner.warmup(what=what)
    assert staging.num_fresh + staging.num_cache_hits >= 2 * len(
        runner.kv_connector.staging.copy_sizes
    )
    before = consumer.get_stats()
    assert _run(consumer, prompts, "x") == want
    after = consumer.get_stats()
    assert after["kv_connector_loaded_blocks"] > before["kv_connector_loaded_blocks"]
    assert after["recompilations"] == before["recompilations"]
    compiled = after["num_compilations"] + after["num_compilation_cache_hits"]
    assert compiled == before["num_compilations"] + before["num_compilation_cache_hits"]


@pytest.mark.slow  # an engine of its own
def test_fp8_pages_round_trip_through_the_store(tmp_path):
    """One engine as producer and consumer (kv_both): its device cache emptied between the
    runs, the second run's prompt blocks come from the store, in float8, with the same tokens."""
    engine = LLMEngine("tiny-random-llama", kv_cache_dtype="fp8",
                       kv_transfer_config=_kv("kv_both", str(tmp_path)), **CONFIG)  # fmt: skip
    prompts = random_prompts(2, seed=4, lo=30, hi=50)
    want = _run(engine, prompts, "f")
    assert engine.reset_prefix_cache()
    assert _run(engine, prompts, "g") == want
    assert engine.get_stats()["kv_connector_loaded_blocks"] == sum((len(p) - 1) // 8
                                                                   for p in prompts)  # fmt: skip
    assert_nothing_held(engine)
