"""The JaxTransferConnector end to end, a producer and a consumer engine in one process, each with
its own jax.experimental.transfer server on 127.0.0.1: a prefill's answer names its offer, the
consumer pulls the prompt's KV device to device (the same bytes as the producer's pages) and
answers with the producer's own greedy tokens; an offer that cannot be pulled (a producer gone,
a lease ended, another layout or prompt) is computed instead or fails the request, as
kv_load_failure_policy says, and so is an offer the producer's cap released for a newer one or a
pull that hangs (abandoned after pull_timeout_s while the engine serves others); nothing is held
afterwards on either side, and after a warm-up the connector's gathers and scatters compile
nothing. Shutting both engines down (the module's last test) stops every thread they started
and frees the producer's transfer port."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from engine_utils import SMALL, assert_nothing_held, random_prompts

from jaxserve import LLMEngine, SamplingParams
from jaxserve.core.kv_cache_utils import extend_block_hashes
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.request import Request
from jaxserve.runner.job_shapes import job_request, job_warmup_set
from jaxserve.runner.kv_transfer_worker import make_transfer_connector

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(
    max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True}
)
CONFIG = dict(SMALL, num_kv_blocks=96)


def _kv(role: str, **extra) -> dict:
    return {"kv_connector": "JaxTransferConnector", "kv_role": role, **extra}


@pytest.fixture(scope="module")
def threads_before() -> set[threading.Thread]:
    """The threads alive before the module's engines were built."""
    return set(threading.enumerate())


@pytest.fixture(scope="module")
def producer(threads_before):
    engine = LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_producer"), **CONFIG)
    yield engine
    engine.shutdown()  # the last test shut it down already: harmless


@pytest.fixture(scope="module")
def consumer(threads_before):
    engine = LLMEngine("tiny-random-llama", kv_transfer_config=_kv("kv_consumer"), **CONFIG)
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], tag: str):
    """Each prompt's finished RequestOutput."""
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, sp)
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return [done[f"{tag}-{i}"] for i in range(len(prompts))]


def _greedy(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids) for o in _run(engine, prompts, [GREEDY] * len(prompts), tag)
    ]


def _prefill(producer: LLMEngine, prompts: list[list[int]], tag: str) -> list[dict]:
    """The producer's kv_transfer_params for each prompt's decode."""
    return [o.kv_transfer_params for o in _run(producer, prompts, [PREFILL] * len(prompts), tag)]


def _decode(consumer: LLMEngine, prompts: list[list[int]], params: list[dict], tag: str):
    sps = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, kv_transfer_params=p)
           for p in params]  # fmt: skip
    return _run(consumer, prompts, sps, tag)


def _block(engine: LLMEngine, block_hash: bytes) -> np.ndarray:
    """The cached block's K and V pages of every layer [L, 2, K, P, H]."""
    block_id = engine.scheduler.kv_cache_manager.block_pool.cached_blocks[block_hash].block_id
    pages = engine.runner.kv_caches
    return np.stack([np.stack([np.asarray(k[:, block_id]), np.asarray(v[:, block_id])])
                     for k, v in pages])  # fmt: skip


def test_a_consumer_pulls_the_prompts_kv_and_answers_the_same(producer, consumer):
    prompts = random_prompts(3, seed=1, lo=20, hi=60)
    want = _greedy(producer, prompts, "g")
    before = consumer.get_stats()
    params = _prefill(producer, prompts, "p")
    for p, prompt in zip(params, prompts, strict=True):
        assert p["remote_num_tokens"] == len(prompt) // 8 * 8 and p["remote_host"] == "127.0.0.1"
    outs = _decode(consumer, prompts, params, "c")
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    after = consumer.get_stats()
    loaded = after["kv_connector_loaded_blocks"] - before["kv_connector_loaded_blocks"]
    assert loaded == sum((len(p) - 1) // 8 for p in prompts)  # every block it may take over
    assert after["kv_connector_load_failures"] == before["kv_connector_load_failures"]
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 8 * 8 for p in prompts]
    # The pulled blocks hold the producer's bytes.
    hashes = extend_block_hashes(Request("h", prompts[0], GREEDY), 8, (len(prompts[0]) - 1) // 8)
    for h in hashes:
        np.testing.assert_array_equal(_block(consumer, h), _block(producer, h))
    assert producer.get_stats()["kv_transfer_offers"] >= len(prompts)
    assert_nothing_held(producer)
    assert_nothing_held(consumer)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nobody listens there


@pytest.mark.parametrize(
    "seed, spoil",
    [
        (20, lambda p: p.update(remote_port=_dead_port())),  # the producer is gone
        (21, lambda p: p.update(remote_expires_at=time.time() - 1)),  # its lease ended
        (22, lambda p: p.update(remote_layout="another-model")),  # another layout
        (23, lambda p: p.update(remote_block_hash="00" * 32)),  # another prompt's KV
    ],
    ids=["producer-gone", "lease-expired", "layout", "prompt"],
)
def test_an_offer_that_cannot_be_pulled_is_recomputed(producer, consumer, seed, spoil):
    """(Each case its own prompt: the consumer's cache holds the ones computed before.)"""
    prompts = random_prompts(1, seed=seed, lo=30, hi=50)
    (want,) = _greedy(producer, prompts, "r")
    (params,) = _prefill(producer, prompts, "rp")
    spoil(params)
    before = consumer.get_stats()
    (out,) = _decode(consumer, prompts, [params], "rc")
    assert list(out.outputs[0].token_ids) == want
    after = consumer.get_stats()
    assert after["kv_connector_loaded_blocks"] == before["kv_connector_loaded_blocks"]
    assert after["kv_connector_load_failures"] == before["kv_connector_load_failures"] + 1
    assert_nothing_held(consumer)


@pytest.mark.slow  # an engine of its own
def test_fail_policy_ends_the_request_and_fp8_pages_travel():
    """One engine of both roles with FP8 pages pulls its own offer (its device cache emptied
    in between): the same tokens; with kv_load_failure_policy "fail", a producer gone ends the
    request with finish_reason "error"."""
    engine = LLMEngine("tiny-random-llama", kv_cache_dtype="fp8",
                       kv_transfer_config=_kv("kv_both", kv_load_failure_policy="fail"),
                       **CONFIG)  # fmt: skip
    prompts = random_prompts(1, seed=4, lo=30, hi=50)
    want = _greedy(engine, prompts, "f")
    params = _prefill(engine, prompts, "fp")
    assert engine.reset_prefix_cache()
    outs = _decode(engine, prompts, params, "fc")
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert engine.get_stats()["kv_connector_loaded_blocks"] == sum((len(p) - 1) // 8
                                                                   for p in prompts)  # fmt: skip
    (params,) = _prefill(engine, prompts, "gp")
    assert engine.reset_prefix_cache()
    params["remote_port"] = _dead_port()
    (out,) = _decode(engine, prompts, [params], "gc")
    assert out.outputs[0].finish_reason == "error"
    assert_nothing_held(engine)


def test_nothing_compiles_after_warmup_with_the_transfer_connector(producer, consumer):
    """The gathers and scatters are in the warm-up set and counted: after a warm-up for a
    job, its offers, pulls and steps compile nothing on either side."""
    prompts = random_prompts(3, seed=10, lo=20, hi=60)
    want = _greedy(producer, prompts, "w")
    for engine in (producer, consumer):
        runner = engine.runner
        assert runner.kv_connector.staging.compiles in runner.all_compiles()
        config = engine.config
        what = job_warmup_set(
            [job_request(len(p), GREEDY, False) for p in prompts],
            runner.buckets,
            block_size=8,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            variant_widths=runner.sampling.variant_widths,
            copy_sizes=runner.copy_sizes,
            num_usable_blocks=engine.info.num_kv_blocks - 1,
        )
        runner.warmup(what=what)
    before = [e.get_stats() for e in (producer, consumer)]
    params = _prefill(producer, prompts, "wp")
    outs = _decode(consumer, prompts, params, "wc")
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    for engine, old in zip((producer, consumer), before, strict=True):
        new = engine.get_stats()
        assert new["recompilations"] == old["recompilations"]
        compiled = new["num_compilations"] + new["num_compilation_cache_hits"]
        assert compiled == old["num_compilations"] + old["num_compilation_cache_hits"]
    assert (
        consumer.get_stats()["kv_connector_loaded_blocks"] > before[1]["kv_connector_loaded_blocks"]
    )


def test_the_config_refuses_what_the_transfer_connector_cannot_honour():
    with pytest.raises(ValueError, match="shared_storage_path"):
        KVTransferConfig.from_value(
            _kv("kv_both", kv_connector_extra_config={"shared_storage_path": "/tmp/x"})
        )
    with pytest.raises(ValueError, match="load_async"):
        KVTransferConfig.from_value(_kv("kv_both", kv_connector_extra_config={"load_async": False}))
    with pytest.raises(ValueError, match="transfer_port"):
        KVTransferConfig.from_value(_kv("kv_both", kv_connector_extra_config={"transfer_port": -1}))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_held_offers_fraction"):
            KVTransferConfig.from_value(
                _kv("kv_both", kv_connector_extra_config={"max_held_offers_fraction": bad})
            )
    with pytest.raises(ValueError, match="transfer_host"):
        KVTransferConfig.from_value({"kv_connector_extra_config": {"transfer_host": "h"}})
    ok = KVTransferConfig.from_value(
        _kv("kv_consumer", kv_connector_extra_config={"transfer_port": 0, "pull_timeout_s": 5})
    )
    assert ok.transport == "jax_transfer" and ok.loads and not ok.saves


def test_aborts_on_either_side_free_every_block(producer, consumer):
    """A consumer's request aborted while its pull runs frees its blocks and its load is
    dropped; a prefill aborted before its answer leaves no offer behind in the books."""
    prompts = random_prompts(2, seed=30, lo=30, hi=50)
    (params,) = _prefill(producer, prompts[:1], "ap")
    sp = SamplingParams(max_tokens=8, temperature=0.0, kv_transfer_params=params)
    consumer.add_request("gone", {"prompt_token_ids": prompts[0]}, sp)
    consumer.step()
    assert consumer.get_stats()["num_requests_waiting_for_remote_kvs"] == 1
    consumer.abort_request("gone")
    assert_nothing_held(consumer)
    for _ in range(50):  # hands the abort to the runner: the pull's result is never written
        consumer.step()
        if consumer.runner.kv_connector.num_pending_loads == 0:
            break
    assert consumer.runner.kv_connector.num_pending_loads == 0
    assert_nothing_held(consumer)
    long = SamplingParams(
        max_tokens=4, temperature=0.0, kv_transfer_params={"do_remote_decode": True}
    )
    producer.add_request("cut", {"prompt_token_ids": prompts[1]}, long)
    for _ in range(3):
        producer.step()
    offered = producer.scheduler.kv_connector._offered
    assert [rid.split("#")[0] for rid in offered] == ["cut"]  # offered, not answered yet
    producer.abort_request("cut")
    producer.step()  # the abort reaches the connector's books
    assert not offered
    assert_nothing_held(producer)


def test_the_cap_releases_the_oldest_offer_and_its_consumer_recomputes(producer, consumer):
    """With room for one prompt's copy, a second offer releases the first: the first's decode
    gets an error at once and recomputes, the second's pulls; the same tokens, nothing held."""
    offers = producer.runner.kv_connector.offers
    prompts = random_prompts(2, seed=40, lo=33, hi=40)  # 4 blocks each: copies of 4
    want = _greedy(producer, prompts, "k")
    offers.release_expired(now=float("inf"))  # the earlier tests' offers (pulled) released
    assert offers.num_held == 0 and offers.held_blocks == 0
    evicted, cap = offers.num_evicted, offers.max_blocks
    # The cap is the one the memory plan reserved room for (max_held_offers_fraction 0.5).
    assert producer.info.memory.held_offers.blocks(96) == cap == 48
    assert consumer.info.memory.held_offers is None
    offers.max_blocks = 4
    try:
        params = _prefill(producer, prompts, "kp")
    finally:
        offers.max_blocks = cap
    assert offers.num_evicted == evicted + 1 and offers.num_held == 1
    stats = producer.get_stats()  # the runner half's counters reach get_stats (and /metrics)
    assert stats["kv_transfer_offers_evicted"] == offers.num_evicted
    assert stats["kv_transfer_offers_held"] == 1 and stats["kv_transfer_offer_blocks_held"] == 4
    before = consumer.get_stats()
    outs = _decode(consumer, prompts, params, "kc")
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    after = consumer.get_stats()
    assert after["kv_connector_load_failures"] == before["kv_connector_load_failures"] + 1
    assert [o.num_cached_tokens for o in outs] == [0, (len(prompts[1]) - 1) // 8 * 8]
    assert consumer.runner.kv_connector.pulls.num_abandoned == 0  # failed at once, no wait
    assert_nothing_held(producer)
    assert_nothing_held(consumer)


def test_a_hung_pull_never_blocks_the_engine(producer, consumer):
    """A pull of an id its producer never offered waits forever: the consumer abandons it
    after pull_timeout_s (its thread ends: the connection is poisoned) and recomputes, and
    another request is served meanwhile."""
    prompts = random_prompts(2, seed=50, lo=30, hi=40)
    want = _greedy(producer, prompts, "h")
    (params,) = _prefill(producer, prompts[:1], "hp")
    params["remote_transfer_id"] += 1  # nobody offers it
    pulls = consumer.runner.kv_connector.pulls
    timeout, pulls.timeout_s = pulls.timeout_s, 2.0
    abandoned, failures = pulls.num_abandoned, consumer.get_stats()["kv_connector_load_failures"]
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            kv_transfer_params=params)  # fmt: skip
        consumer.add_request("hung", {"prompt_token_ids": prompts[0]}, sp)
        consumer.add_request("free", {"prompt_token_ids": prompts[1]}, GREEDY)
        done: dict[str, tuple] = {}
        for _ in range(2000):  # bounded: each idle step waits for the pull a little
            for out in consumer.step():
                if out.finished:
                    done[out.request_id] = (out, pulls.num_abandoned - abandoned)
            if not consumer.has_unfinished_requests():
                break
    finally:
        pulls.timeout_s = timeout
    assert done["free"][1] == 0  # served while the hung pull was still waited for
    assert [list(done[r][0].outputs[0].token_ids) for r in ("hung", "free")] == want
    assert pulls.num_abandoned == abandoned + 1 and pulls.num_stuck == 0
    stats = consumer.get_stats()
    assert stats["kv_connector_load_failures"] == failures + 1
    assert stats["kv_transfer_pulls_abandoned"] == pulls.num_abandoned
    assert stats["kv_transfer_pulls_stuck"] == 0
    assert_nothing_held(consumer)


def _ours(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("jaxserve") and t not in before)  # fmt: skip


def test_shutdown_stops_every_thread_and_frees_the_transfer_port(
    producer, consumer, threads_before
):
    """(The module's last test: it shuts the module's engines down.) The producer's lease
    thread and the consumer's reader threads run; after shutdown none of the engines' threads
    is alive, nobody listens on the producer's port, which anyone may bind again (a plain
    socket, another transfer server); a second shutdown changes nothing, a new request is
    refused."""
    prompts = random_prompts(1, seed=60, lo=20, hi=30)
    _decode(consumer, prompts, _prefill(producer, prompts, "sp"), "sc")
    running = _ours(threads_before)
    assert "jaxserve-kv-leases" in running and any(
        n.startswith("jaxserve-kv-load") for n in running
    )
    port = producer.scheduler.kv_connector.port
    socket.create_connection(("127.0.0.1", port), 2.0).close()  # it listens
    for engine in (producer, consumer, producer, consumer):  # twice each: harmless
        engine.shutdown()
    assert _ours(threads_before) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), 2.0)
    with socket.socket() as s:  # the probe's TIME_WAIT allowed, a listener would not be
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    config = KVTransferConfig.from_value(
        _kv("kv_producer", kv_connector_extra_config={"transfer_port": port})
    )
    worker = make_transfer_connector(config, "m", 1, (1, 4, 8, 8), np.float32, None)
    assert worker.connector.port == port
    worker.close()
    with pytest.raises(RuntimeError, match="shut down"):
        producer.add_request("late", {"prompt_token_ids": prompts[0]}, GREEDY)
