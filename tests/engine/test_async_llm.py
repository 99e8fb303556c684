"""AsyncLLM (the engine thread, streams, aborts, failures, metrics) and LLM.stream."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from engine_utils import SMALL, assert_nothing_held, random_prompts

from jaxserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from jaxserve.engine.async_llm import EngineError, QueueFullError

# Every test builds and steps an AsyncLLM: the slow tier (tests/serve keeps it in the fast one).
# On one xdist worker: the module's engine fixture is built (and compiled) once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("async_llm")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DELTA = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM("tiny-random-llama", num_kv_blocks=64, **SMALL)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected():
    """Greedy outputs of LLM.generate on the same prompts (the reference)."""
    llm = LLM("tiny-random-llama", num_kv_blocks=64, **SMALL)
    prompts = random_prompts(12, seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def collect(engine: AsyncLLM, prompt, params, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def wait_idle(engine: AsyncLLM) -> dict:
    """Aborts land on the engine thread's next pass: poll (bounded) until nothing is held."""
    deadline = time.monotonic() + 30
    while True:
        stats = engine.get_stats()
        if (
            stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]
            or time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.02)


def test_the_three_output_kinds_agree_with_generate(engine, expected):
    prompts, reference = expected
    text, tokens = reference[0]
    deltas = run(collect(engine, prompts[0], DELTA, "delta"))
    assert "".join(o.outputs[0].text for o in deltas) == text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == tokens
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"
    cumulative = run(collect(engine, prompts[0], GREEDY, "cumulative"))
    assert len(cumulative) > 1
    for a, b in zip(cumulative, cumulative[1:], strict=False):  # each extends the previous
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert (cumulative[-1].outputs[0].text, cumulative[-1].outputs[0].token_ids) == reference[0]
    final = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
    (only,) = run(collect(engine, prompts[0], final, "final"))
    assert only.finished and only.outputs[0].token_ids == tokens
    m = only.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_generation_tokens == len(tokens)


def test_concurrent_streams_each_get_their_own_tokens(engine, expected):
    prompts, reference = expected

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, DELTA, f"c{i}") for i, p in enumerate(prompts))
        )

    results = run(main())
    for outs, (text, tokens) in zip(results, reference, strict=True):
        assert "".join(o.outputs[0].text for o in outs) == text
        assert [t for o in outs for t in o.outputs[0].token_ids] == tokens
    assert_nothing_held(engine.engine)


def slow_steps(engine: AsyncLLM, monkeypatch, seconds: float = 0.02) -> None:
    """Each engine step takes at least ``seconds``: a request of 100 tokens outlasts the
    test's own moves."""
    runner = engine.engine.runner
    real = runner.dispatch

    def slow(so, trace=None):
        time.sleep(seconds)
        return real(so, trace)

    monkeypatch.setattr(runner, "dispatch", slow)


def test_a_consumer_that_goes_away_aborts_its_request(engine, expected, monkeypatch):
    prompts, _ = expected
    long = dataclasses.replace(DELTA, max_tokens=100)
    slow_steps(engine, monkeypatch)

    async def main():
        agen = engine.generate(prompts[1], long, "gone")
        await agen.__anext__()
        await agen.aclose()  # as a server does when the client disconnects
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompts[2], long, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    stats = wait_idle(engine)
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]
    assert_nothing_held(engine.engine)
    assert b'jaxserve:request_success_total{finished_reason="abort"' in engine.metrics.render()
    # The ids are free again.
    outs = run(collect(engine, prompts[1], GREEDY, "gone"))
    assert outs[-1].finished


def test_abort_ends_the_stream_with_abort(engine, expected, monkeypatch):
    prompts, _ = expected
    slow_steps(engine, monkeypatch)
    long = dataclasses.replace(DELTA, max_tokens=100)

    async def main():
        outs = []
        async for out in engine.generate(prompts[3], long, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("to-abort")
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 100
    wait_idle(engine)
    assert_nothing_held(engine.engine)


def test_bad_requests_raise_before_anything_is_queued(engine, expected, monkeypatch):
    prompts, _ = expected
    slow_steps(engine, monkeypatch)

    async def first(prompt, params, request_id):
        return await engine.generate(prompt, params, request_id).__anext__()

    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(first([10**6], GREEDY, "bad-token"))
    with pytest.raises(ValueError, match="max_model_len"):
        run(first(list(range(3, 200)), GREEDY, "too-long"))
    with pytest.raises(TypeError, match="request_id must be a str"):
        run(first(prompts[0], GREEDY, 7))

    async def duplicate():
        agen = engine.generate(prompts[0], dataclasses.replace(DELTA, max_tokens=50), "dup")
        await agen.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use"):
                await first(prompts[0], GREEDY, "dup")
        finally:
            await agen.aclose()

    run(duplicate())
    wait_idle(engine)
    assert_nothing_held(engine.engine)


def test_max_waiting_requests_refuses_with_queue_full(expected):
    prompts, _ = expected
    engine = AsyncLLM("tiny-random-llama", max_waiting_requests=2, num_kv_blocks=64, **SMALL)
    try:

        async def main():
            agens = [engine.generate(p, DELTA, f"q{i}") for i, p in enumerate(prompts[:3])]
            # Queued in the same event-loop turn: the engine has not started any of them.
            firsts = [asyncio.ensure_future(a.__anext__()) for a in agens[:2]]
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
                await agens[2].__anext__()
            await asyncio.gather(*firsts)
            for a in agens[:2]:
                async for _ in a:
                    pass

        run(main())
        with pytest.raises(ValueError, match="max_waiting_requests must be >= 1"):
            AsyncLLM.from_engine(engine.engine, max_waiting_requests=0)
    finally:
        engine.shutdown()
    # It built its engine: shut down with it (LLMEngine.shutdown), which takes nothing more.
    with pytest.raises(RuntimeError, match="shut down"):
        engine.engine.add_request("late", prompts[0], DELTA)


@pytest.mark.slow
def test_a_failed_step_fails_its_streams_and_the_engine_serves_on(expected, monkeypatch):
    prompts, reference = expected
    engine = AsyncLLM("tiny-random-llama", num_kv_blocks=64, **SMALL)
    runner = engine.engine.runner
    real = runner.dispatch
    calls = {"n": 0}

    def flaky(so, trace=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(so, trace)

    monkeypatch.setattr(runner, "dispatch", flaky)
    try:
        with pytest.raises(EngineError, match="device lost"):
            run(collect(engine, prompts[0], DELTA, "doomed"))
        outs = run(collect(engine, prompts[0], DELTA, "after"))
        assert [t for o in outs for t in o.outputs[0].token_ids] == reference[0][1]
        assert_nothing_held(engine.engine)
    finally:
        engine.shutdown()
    assert not engine.is_running
    with pytest.raises(EngineError, match="not running"):
        run(collect(engine, prompts[0], DELTA, "late"))


@pytest.mark.slow
def test_shutdown_fails_the_streams_still_running(expected):
    prompts, _ = expected
    engine = AsyncLLM("tiny-random-llama", num_kv_blocks=64, **SMALL)

    async def main():
        agen = engine.generate(prompts[0], dataclasses.replace(DELTA, max_tokens=100), "s")
        await agen.__anext__()
        engine.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            async for _ in agen:
                pass

    run(main())
    assert_nothing_held(engine.engine)
    engine.shutdown()  # idempotent


def test_the_client_api_a_server_uses(engine, expected, monkeypatch):
    """What OpenAIServing asks of AsyncLLM: limits, the tokenizer, checks run in a worker thread
    (never on the event loop's), a CheckedRequest generate() queues as it is, the metrics."""
    prompts, reference = expected
    assert engine.max_model_len == engine.config.model.max_model_len > 0
    assert engine.model_name == "tiny-random-llama"
    assert engine.get_tokenizer() is engine.tokenizer
    threads = []
    check = engine.engine.check_request
    monkeypatch.setattr(
        engine.engine,
        "check_request",
        lambda *a, **k: threads.append(threading.get_ident()) or check(*a, **k),
    )

    async def main():
        text, ids = await engine.tokenize(prompts[0])
        assert (text, ids) == (None, prompts[0])
        checked = await engine.check_request({"prompt_token_ids": ids}, GREEDY)
        outs = [o async for o in engine.generate(checked, None, "client-api")]
        return threading.get_ident(), outs[-1].outputs[0].token_ids

    loop_thread, tokens = run(main())
    assert tokens == reference[0][1]
    assert threads and loop_thread not in threads
    with pytest.raises(ValueError, match="max_model_len|too long|exceeds"):
        run(engine.check_request({"prompt_token_ids": [5] * (engine.max_model_len + 1)}, GREEDY))
    body, content_type = engine.render_metrics()
    assert b"jaxserve:" in body and content_type.startswith("text/plain")


def test_metrics_count_tokens_and_requests_and_end_at_zero(engine, expected):
    prompts, _ = expected
    params = dataclasses.replace(DELTA, max_tokens=5)
    before = engine.get_stats()
    run(collect(engine, prompts[4], params, "m1"))
    wait_idle(engine)
    # The engine thread sets the gauges just after the step that freed the blocks: poll them.
    deadline = time.monotonic() + 30
    text = engine.metrics.render().decode()
    while "jaxserve:num_requests_running{" in text and time.monotonic() < deadline:
        if 'jaxserve:kv_cache_usage_perc{model_name="tiny-random-llama"} 0.0' in text:
            break
        time.sleep(0.02)
        text = engine.metrics.render().decode()
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "num_preemptions_total",
    ):
        assert f"jaxserve:{name}" in text, name
    assert 'jaxserve:request_success_total{finished_reason="length"' in text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("jaxserve:") and "{" in line
    }
    assert values["jaxserve:num_requests_running"] == 0
    assert values["jaxserve:num_requests_waiting"] == 0
    assert values["jaxserve:kv_cache_usage_perc"] == 0
    assert before["num_steps"] < engine.get_stats()["num_steps"]


@pytest.mark.slow
def test_llm_stream_yields_as_it_steps_and_aborts_when_closed(expected):
    prompts, reference = expected
    llm = LLM("tiny-random-llama", num_kv_blocks=64, **SMALL)
    texts = {}
    for out in llm.stream(prompts[:3], DELTA):
        texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
    # Interleaved as they progress; the ids count up in prompt order.
    assert [texts[k] for k in sorted(texts, key=int)] == [text for text, _ in reference[:3]]
    final = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = list(llm.stream(prompts[:2], final))
    assert [o.finished for o in outs] == [True, True]
    stream = llm.stream(prompts[0], dataclasses.replace(DELTA, max_tokens=100))
    next(stream)
    stream.close()  # a notebook's `break`
    assert_nothing_held(llm.engine)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.stream([prompts[0], [10**6]], GREEDY).__next__()
    assert_nothing_held(llm.engine)
