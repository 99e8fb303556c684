"""End-to-end behaviour of LLM / LLMEngine on the built-in demo model: batch invariance, seeds,
no compilation after warm-up, aborts, bad input, and the docs/architecture.md invariants."""

from __future__ import annotations

import random

import pytest
from engine_utils import SMALL, assert_nothing_held, random_prompts

from jaxserve import LLM, LLMEngine, SamplingParams, StructuredOutputsParams

# Token constraints (jaxserve/structured/, runner/token_constraints.py), one at random.
_CONSTRAINTS = [
    {},
    {},
    {"logit_bias": {5: 3.0, 9: -100.0}},
    {"allowed_token_ids": [2, 5, 6, 7]},
    {"bad_words": ["the", "France"]},
    {"structured_outputs": StructuredOutputsParams(regex="[a-c]{1,8}")},
    {"structured_outputs": StructuredOutputsParams(json={"type": "array", "maxItems": 2})},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random-llama", num_kv_blocks=64, **SMALL)


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["The capital of France is", [5, 6, 7, 8], {"prompt_token_ids": [9, 10, 11]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The capital of France is", None, None]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    for out in outs:
        assert out.finished
        (completion,) = out.outputs
        assert 1 <= len(completion.token_ids) <= 5
        assert completion.finish_reason in ("stop", "length")
    tokenizer = llm.get_tokenizer()
    text_out = outs[0].outputs[0]
    assert text_out.text == tokenizer.decode(text_out.token_ids)
    assert_nothing_held(llm.engine)


@pytest.mark.slow
def test_greedy_and_seeded_tokens_do_not_depend_on_the_batch(llm):
    target = random_prompts(1, seed=1, lo=30, hi=31)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    alone = [
        llm.generate([target], p, use_tqdm=False)[0].outputs[0].token_ids for p in (greedy, seeded)
    ]
    # In a crowd, in a tiny pool with a tiny budget: chunking and preemption happen.
    crowded = LLM(
        "tiny-random-llama",
        num_kv_blocks=14,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        max_model_len=128,
        warmup=False,
    )
    others = random_prompts(5, seed=2)
    other_params = [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)] * 5
    outs = crowded.generate(
        [target, target] + others, [greedy, seeded] + other_params, use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == alone[0]
    assert outs[1].outputs[0].token_ids == alone[1]
    assert crowded.get_stats()["num_preemptions"] > 0
    assert_nothing_held(crowded.engine)


@pytest.mark.slow
def test_unseeded_requests_follow_the_engine_seed():
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM("tiny-random-llama", seed=s, num_kv_blocks=64, **SMALL).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def _any_sampling_params(rng: random.Random) -> SamplingParams:
    """Every SamplingParams feature, at random: what warm-up must already have compiled."""
    max_tokens = rng.randrange(1, 12)
    return SamplingParams(
        n=rng.choice([1, 1, 2, 3]),
        temperature=rng.choice([0.0, 0.8]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([-1, 5]),
        min_p=rng.choice([0.0, 0.05]),
        max_tokens=max_tokens,
        min_tokens=min(rng.choice([0, 0, 2]), max_tokens),
        seed=rng.choice([None, rng.randrange(9)]),
        logprobs=rng.choice([None, None, 0, 3, 20]),
        prompt_logprobs=rng.choice([None, None, None, 0, 5]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        stop=rng.choice([None, ["e"]]),
        stop_token_ids=rng.choice([None, [7]]),
        ignore_eos=rng.choice([False, True]),
        **rng.choice(_CONSTRAINTS),
    )


@pytest.mark.slow
def test_nothing_compiles_after_warmup():
    engine = LLMEngine(
        "tiny-random-llama",
        num_kv_blocks=48,
        warmup=True,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # tests/runner/test_warmup.py's ENGINE: one set of steps
        max_model_len=64,
    )
    stats = engine.get_stats()
    # Fresh compilations and loads from the session's compilation cache (tests/conftest.py):
    # an engine built earlier in the session may have compiled the same shapes.
    compiled = stats["num_compilations"] + stats["num_compilation_cache_hits"]
    plan = stats["plan"]
    buckets = engine.runner.buckets
    # The step's forward half at every batch shape and its sample half at every row bucket
    # in the sampler's two variants (no penalty and no ban, or some), and the copy-on-write
    # block copy (n > 1) at every padded size; the CPU's fused step instead runs the
    # decode-shaped buckets as one program per variant (job_shapes.fused_shape).
    copy_sizes = engine.runner.copy_sizes
    assert copy_sizes == (1, 2, 4)  # up to max_num_seqs copies a step
    shapes = buckets.all_shapes()
    num_rows = len({r for _, r, _ in shapes})
    num_variants = len(engine.runner.sampling.variant_widths)
    if plan["fused_step"]:
        assert compiled == engine.runner.warmup_set().num_step_compilations(fused=True)
    else:
        assert compiled == len(shapes) + num_rows * num_variants + len(copy_sizes)
    tokens = buckets.token_buckets
    assert (tokens[0] == 1) == plan["single_token_bucket"]
    assert (6 in tokens) == plan["mid_token_buckets"]  # 3 * 2^k between the powers of two
    rng = random.Random(0)
    next_id = 0
    while engine.get_stats()["num_steps"] < 80:
        if rng.random() < 0.3:  # keep a stream of new requests arriving: mixed steps
            params = _any_sampling_params(rng)
            engine.add_request(str(next_id), random_prompts(1, seed=next_id, hi=40)[0], params)
            next_id += 1
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats["num_compilations"] + stats["num_compilation_cache_hits"] == compiled, stats[
        "recompilations"
    ]
    assert stats["recompilations"] == []
    assert_nothing_held(engine)


@pytest.mark.slow
def test_abort_at_every_stage_frees_everything():
    engine = LLMEngine("tiny-random-llama", num_kv_blocks=12, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(6, seed=4, lo=20, hi=60)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.abort_request("5")  # still waiting
    engine.step()  # 0 is mid-prefill (budget 32)
    engine.abort_request("0")
    for _ in range(6):
        engine.step()
    engine.abort_request(["1", "2", "unknown"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(engine)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], None, "empty"),
        ("", None, "empty"),
        ([1, 2, 5000], None, "5000.*vocabulary"),
        ([1, -3], None, "-3.*vocabulary"),
        (list(range(3, 200)), None, "max_model_len=128"),
        ({"foo": 1}, None, "prompt_token_ids"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert out[0].finished
    assert_nothing_held(llm.engine)


def test_prompt_larger_than_the_pool_is_rejected():
    engine = LLMEngine("tiny-random-llama", num_kv_blocks=4, **SMALL)
    with pytest.raises(ValueError, match="3 usable blocks"):
        engine.add_request("big", list(range(3, 60)), SamplingParams())
    assert_nothing_held(engine)


def test_request_level_errors(llm):
    with pytest.raises(ValueError, match="2 entries but there are 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[5, 6]], [{"temperature": 0}], use_tqdm=False)
    engine = llm.engine
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(engine)
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_sequences'"):
        LLM("tiny-random-llama", max_num_sequences=4)
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-random-llama", dtype="int8")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM("no-such-model")


def test_stop_strings_and_stop_tokens(llm):
    prompt = [5, 6, 7, 8, 9]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=16, stop=stop, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    tok = free.token_ids[4]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tok], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    assert_nothing_held(llm.engine)


def test_get_stats_keys(llm):
    keys = {
        "num_kv_blocks",
        "num_usable_kv_blocks",
        "num_free_kv_blocks",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "num_steps",
        "num_compilations",
        "peak_kv_slot_utilization",
        "plan",
    }
    stats = llm.get_stats()
    assert keys <= set(stats)
    plan_keys = {"platform", "device_kind", "attention", "sampler_draw", "dtype"}
    plan_keys |= {"kv_cache_dtype", "tensor_parallel_size"}
    assert plan_keys <= set(stats["plan"])
    assert stats["plan"]["platform"] == "cpu" and stats["plan"]["dtype"] == "float32"


@pytest.mark.slow
def test_finished_only_steps_return_the_same_final_outputs(llm):
    """step(finished_only=True) (what LLM.generate uses) returns each request once, when it
    finishes, equal to the final output of a step() run with the same seeds (both runs on the
    module's engine, each from an empty prefix cache: seeded tokens depend on nothing else)."""
    prompts = random_prompts(6, seed=11)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + 2 * i) for i in range(6)]
    finals = []
    engine = llm.engine
    for finished_only in (False, True):
        assert engine.reset_prefix_cache()
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
        seen = []
        while engine.has_unfinished_requests():
            outs = engine.step(finished_only=finished_only)
            if finished_only:
                assert all(o.finished for o in outs)
            seen += [o for o in outs if o.finished]
        assert sorted(o.request_id for o in seen) == [str(i) for i in range(6)]
        finals.append({o.request_id: o.outputs[0].token_ids for o in seen})
        assert_nothing_held(engine)
    assert finals[0] == finals[1]


def test_reset_prefix_cache_forgets_prefixes_and_refuses_while_requests_run(llm):
    prompt = list(range(5, 5 + 40))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hits = llm.get_stats()["prefix_cache_hits"]
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hits"] > hits  # the prefix was cached
    assert llm.reset_prefix_cache()
    hits = llm.get_stats()["prefix_cache_hits"]
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_stats()["prefix_cache_hits"] == hits and again == first  # computed again
    engine = llm.engine
    engine.add_request("busy", prompt, params)
    assert not engine.reset_prefix_cache()  # its blocks are in use: nothing changes
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(engine)


def test_step_tracer_sees_every_step_and_the_batch_shapes(llm):
    traces = []
    llm.engine.set_step_tracer(traces.append)
    try:
        prompts = [list(range(3, 3 + n)) for n in (7, 12)]
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    finally:
        llm.engine.set_step_tracer(None)
    ran = [t for t in traces if t.padded_tokens]
    # 19 prompt tokens and 2 x 2 decode tokens (the last sampled token is never fed back).
    assert sum(t.num_tokens for t in ran) == 7 + 12 + 2 * 2
    for t in ran:
        assert t.padded_tokens >= t.num_tokens and t.padded_rows >= t.num_rows
        assert (t.kv_lens >= t.q_lens).all() and t.all_greedy
        assert 0 < t.dispatch_s <= t.execute_s <= t.total_s
        assert t.device_s > 0 and t.device_idle_s >= 0 and t.ready_at >= t.dispatched_at
    n = len(traces)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(traces) == n  # off again
