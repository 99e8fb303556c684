"""A server that serves while its larger buckets compile (engine/background_warmup.py): the
first stage warmed up at construction, the rest in the warm-up thread, each step capped at the
largest bucket ready; nothing compiles on the step path, and greedy tokens do not change.

One small engine for the module (T buckets 1..16 on the CPU: the first stage up to 8, the
background two more), held before its largest bucket until the tests release it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxserve import LLM, AsyncLLM, LLMEngine, SamplingParams
from jaxserve.config import RunnerConfig
from jaxserve.engine.background_warmup import BackgroundWarmup
from jaxserve.runner.compile_cache import CompileEvents

pytestmark = pytest.mark.slow

ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              num_kv_blocks=64, enable_background_warmup=True)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHORT = [5, 17, 3, 99, 42]
LONG = [(7 * i + 3) % 200 + 1 for i in range(45)]  # 45 tokens: > every cap but the last
TIMEOUT_S = 120


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def gated():
    """(engine, release): the engine's warm-up thread waits before its largest stage until
    release is set."""
    release = threading.Event()
    warm_up = BackgroundWarmup._warm_up

    def held(self, stage, jobs):
        if stage.tokens == ENGINE["max_num_batched_tokens"]:
            while not release.wait(0.02):
                self._checks()  # stop() still ends the thread
        warm_up(self, stage, jobs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BackgroundWarmup, "_warm_up", held)
        engine = LLMEngine("tiny-random-llama", **ENGINE)
    yield engine, release
    release.set()
    engine.shutdown()


def _counted_steps(engine: LLMEngine) -> list:
    """Wrap engine.step to record the compilations each step's own thread saw."""
    seen, step = [], engine.step

    def counted(**kwargs):
        before = CompileEvents.in_thread()
        try:
            return step(**kwargs)
        finally:
            seen.append(CompileEvents.in_thread().since(before))

    engine.step = counted
    return seen


async def _generate(server: AsyncLLM, prompt: list[int], request_id: str) -> list[int]:
    async for out in server.generate({"prompt_token_ids": prompt}, GREEDY, request_id):
        if out.finished:
            return list(out.outputs[0].token_ids)
    raise AssertionError("no final output")


def test_server_answers_before_its_largest_bucket_compiles(gated) -> None:
    """While the largest bucket waits, a server answers a short request and a long one (its
    prompt prefilled in chunks of the cap), every step capped, none compiling; once warm-up
    ends the cap lifts and the same prompts give the same greedy tokens."""
    engine, release = gated
    warmup = engine.background_warmup
    assert [s.tokens for s in warmup.stages] == [12, 16]
    _wait_for(lambda: warmup.cap.tokens == 12, "the 12-token stage")
    fresh_before = engine.runner.num_compilations + engine.runner.num_compilation_cache_hits
    steps = _counted_steps(engine)
    server = AsyncLLM.from_engine(engine)
    try:

        async def capped() -> tuple[list[int], list[int]]:
            short = await _generate(server, SHORT, "short")
            assert not warmup.done.is_set() and warmup.cap.tokens == 12
            return short, await _generate(server, LONG, "long")

        short, long = asyncio.run(asyncio.wait_for(capped(), TIMEOUT_S))
        assert warmup.cap.tokens == 12  # still held: both ran under the cap
        release.set()
        _wait_for(warmup.done.is_set, "the end of warm-up")
        assert warmup.cap.tokens is None and engine.get_stats()["step_token_cap"] is None
        assert engine.reset_prefix_cache()

        async def lifted() -> tuple[list[int], list[int]]:
            return await _generate(server, SHORT, "s2"), await _generate(server, LONG, "l2")

        assert asyncio.run(asyncio.wait_for(lifted(), TIMEOUT_S)) == (short, long)
    finally:
        server.shutdown()
        del engine.step
    assert len(steps) > len(LONG) // 12 and all(c.compilations == 0 for c in steps)
    # the 16-token bucket compiled in the warm-up thread, counted and not a recompilation
    stats = engine.get_stats()
    assert stats["num_compilations"] + stats["num_compilation_cache_hits"] > fresh_before
    assert stats["recompilations"] == []


def test_shutdown_while_warmup_compiles_ends_its_thread() -> None:
    """AsyncLLM.shutdown right after construction, while the warm-up thread compiles: every
    thread of the engine has ended when it returns, and the engine takes no more requests."""
    before = set(threading.enumerate())  # other tests' servers may still run in this process
    server = AsyncLLM("tiny-random-llama", **ENGINE)
    warmup = server.engine.background_warmup
    assert warmup is not None and warmup.is_alive
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("jaxserve")]
    assert {"jaxserve-warmup", "jaxserve-engine"} <= {t.name for t in ours}
    server.shutdown()
    assert not warmup.is_alive and warmup.done.is_set()
    assert not any(t.is_alive() for t in ours), [t.name for t in ours if t.is_alive()]
    assert warmup.cap.tokens in (None, 8, 12)
    with pytest.raises(RuntimeError, match="shut down"):  # the engine it built went with it
        server.engine.add_request("after", SHORT, GREEDY)


def test_background_warmup_is_for_servers() -> None:
    with pytest.raises(ValueError, match="enable_background_warmup=True needs warmup=True"):
        RunnerConfig(warmup="job", enable_background_warmup=True)
    with pytest.raises(TypeError, match="enable_background_warmup must be a bool"):
        RunnerConfig(enable_background_warmup="yes")
    with pytest.raises(ValueError, match="offline LLM warms up before its work"):
        LLM("tiny-random-llama", warmup=True, enable_background_warmup=True)
