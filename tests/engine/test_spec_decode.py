"""Speculative decoding end to end on the demo model: greedy and seeded tokens identical to the
engine without speculation (token for token) under scheduler stress, with drafts that are
always right, always wrong, and n-gram lookups; stops inside accepted runs; logprobs; the
counters; nothing compiles after warm-up; bad configs refused before anything loads."""

from __future__ import annotations

import contextlib

import pytest
from engine_utils import assert_nothing_held, random_prompts

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.spec_decode import SpecDecoder
from jaxserve.speculative_config import SpeculativeConfig

K = 3
# Tiny blocks, a tiny pool and budget: chunked prefill and preemption happen.
STRESS = dict(
    block_size=4, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=16,
    max_model_len=96, warmup=False,
)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "policy": "always"}
_SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def _prompts() -> list[list[int]]:
    """Repetitive prompts (n-gram hits), random ones, and two sharing a prefix."""
    repetitive = [[5, 6, 7, 8] * 6, [40, 41, 42] * 5 + [40]]
    return repetitive + random_prompts(3, seed=7, lo=8, hi=30) + [_SHARED + [1, 2], _SHARED + [3]]


class _Oracle:
    """A proposer that knows each request's reference tokens: drafts always right, or (with
    ``wrong``) always wrong."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
        self.reference = reference
        self.wrong = wrong

    def propose(self, requests, k):
        drafts = {}
        for req in requests:
            full = list(req.prompt_token_ids) + self.reference[tuple(req.prompt_token_ids)]
            n = len(req.all_token_ids)
            assert full[:n] == req.all_token_ids  # outputs so far are the reference
            guess = full[n : n + k]
            drafts[req.request_id] = [(t + 1) % 256 for t in guess] if self.wrong else guess
        return drafts


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny-random-llama", **STRESS)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM("tiny-random-llama", speculative_config=NGRAM, **STRESS)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_nothing_held(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


@contextlib.contextmanager
def _proposing(llm: LLM, decoder: SpecDecoder):
    """``llm`` (the module's n-gram engine, idle) speculating with ``decoder`` for the block:
    the tests of other proposers reuse its compiled steps instead of building an engine."""
    core = llm.engine.core
    saved, core.spec = core.spec, decoder
    try:
        yield
    finally:
        core.spec = saved


def _deltas(llm: LLM, before: dict, *keys: str) -> list:
    after = llm.get_stats()
    return [after[key] - before[key] for key in keys]


_DRAFTS, _ACCEPTED = "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=24,
                        ignore_eos=True)  # fmt: skip


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ngram_tokens_are_those_without_speculation(plain, spec, params):
    prompts = _prompts()
    before = spec.get_stats()
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    after = spec.get_stats()
    assert after["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"]
    assert after["num_preemptions"] > 0 or before["num_preemptions"] > 0


def test_suffix_decoding_tokens_are_those_without_speculation(plain, spec):
    """The "suffix" method: drafts from the request's own tokens and from earlier outputs of
    the engine; greedy and seeded tokens unchanged. The same prompts served twice: the second
    time every output is in the engine-wide tree, and most drafts are right."""
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=K, policy="always",
                               suffix_decoding_max_spec_factor=4.0)  # fmt: skip
    prompts = _prompts()
    with _proposing(
        spec, SpecDecoder(config, token_buckets=spec.engine.runner.buckets.token_buckets)
    ):
        for params in (GREEDY, SEEDED):
            assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
        before = spec.get_stats()
        assert _tokens(spec, prompts, GREEDY) == _tokens(plain, prompts, GREEDY)
        drafts, accepted = _deltas(spec, before, _DRAFTS, _ACCEPTED)
    assert accepted > 0.8 * drafts > 0


def test_auto_policy_tries_every_draft_length_and_changes_no_token(plain, spec):
    """The automatic policy measures each of its arms in every batch bucket it meets: "k",
    "off", and at 2 running requests "fit" (2 tokens pad to 4: one draft each fills the
    padding); greedy tokens stay those without speculation whichever it runs."""
    core = spec.engine.core
    always = core.spec
    config = SpeculativeConfig(**{**NGRAM, "policy": "auto"})
    core.spec = SpecDecoder(config, token_buckets=core.runner.buckets.token_buckets)
    try:
        prompts = _prompts()
        longer = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        for batch, params in ((prompts, GREEDY), (prompts[:2], longer)):  # each arm W steps
            assert _tokens(spec, batch, params) == _tokens(plain, batch, params)
        stats = spec.get_stats()
    finally:
        core.spec = always
    per_length = stats["spec_decode_policy_steps_per_length"]
    assert len(per_length) == K + 1 and all(per_length[n] > 0 for n in (0, 1, K))
    assert stats["spec_decode_policy_best_arm"][2] in ("k:3", "fit:1", "off:0")


@pytest.mark.parametrize("wrong", [False, True], ids=["always-right", "always-wrong"])
def test_oracle_drafts_change_steps_not_tokens(plain, spec, wrong):
    prompts = _prompts()
    plain_before = plain.get_stats()
    reference = _tokens(plain, prompts, GREEDY)
    (plain_steps,) = _deltas(plain, plain_before, "num_steps")
    oracle = _Oracle({tuple(p): r for p, r in zip(prompts, reference, strict=True)}, wrong)
    before = spec.get_stats()
    with _proposing(spec, SpecDecoder(SpeculativeConfig(**NGRAM), proposer=oracle)):
        assert _tokens(spec, prompts, GREEDY) == reference
        stats = spec.get_stats()
    assert stats["spec_decode_proposer_seconds"] > 0.0  # the proposer's host time, timed
    assert "spec_decode_proposer_seconds" not in plain.get_stats()
    drafts, accepted, steps = _deltas(spec, before, _DRAFTS, _ACCEPTED, "num_steps")
    assert drafts > 0
    if wrong:
        assert accepted == 0
    else:  # every draft the budget let through is accepted
        assert accepted == drafts
        assert steps < plain_steps


def test_stops_and_lengths_inside_accepted_runs(plain, spec):
    prompt = [5, 6, 7, 8] * 6
    reference = _tokens(plain, [prompt], GREEDY)[0]
    oracle = _Oracle({tuple(prompt): reference})
    before = spec.get_stats()
    with _proposing(spec, SpecDecoder(SpeculativeConfig(**NGRAM), proposer=oracle)):
        _stop_cases(spec, prompt, reference)
    (accepted,) = _deltas(spec, before, _ACCEPTED)
    assert accepted > 0


def _stop_cases(llm: LLM, prompt: list[int], reference: list[int]) -> None:
    stop_at = 5  # a stop token in the middle of a k + 1 run
    stop_id = reference[stop_at]
    first = reference.index(stop_id)
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
         reference[: first + 1], "stop"),
        (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), reference[:6], "length"),
        (SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), reference[:1], "length"),
    ]  # fmt: skip
    for params, want, reason in cases:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == reason
        assert_nothing_held(llm.engine)
    # A stop string ends the text at the string, with nothing after it emitted.
    tok = llm.get_tokenizer()
    text = tok.decode(reference)
    cut = text[len(text) // 3 : len(text) // 3 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[cut], ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out.outputs[0].text == text[: text.index(cut)]
    assert_nothing_held(llm.engine)


def test_logprobs_are_the_targets(plain, spec):
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    ours = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    base = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(ours, base, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 12
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


def test_penalised_requests_are_served_without_drafts(plain, spec):
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3,
                            presence_penalty=0.5, ignore_eos=True)  # fmt: skip
    before = spec.get_stats()["spec_decode_num_draft_tokens"]
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    assert spec.get_stats()["spec_decode_num_draft_tokens"] == before


@pytest.mark.slow
def test_nothing_compiles_after_warmup_with_speculation():
    # Budget 16 (4 rows of k + 1) and pages of 16: 17 programs to warm up instead of 19, none
    # of 24 or 32 tokens (a third less compile time).
    engine = LLMEngine(
        "tiny-random-llama", num_kv_blocks=24, block_size=16, max_num_seqs=4,
        max_num_batched_tokens=16, max_model_len=64, speculative_config=NGRAM,
    )  # fmt: skip
    before = engine.get_stats()
    compiled = before["num_compilations"] + before["num_compilation_cache_hits"]
    for i, prompt in enumerate([[5, 6, 7] * 5, [9, 8] * 9, [3, 4, 5, 6, 7, 8]]):
        engine.add_request(
            str(i),
            {"prompt_token_ids": prompt},
            SamplingParams(
                temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=20, ignore_eos=True
            ),
        )
    # Constrained requests speculate too, a mask per verification row (no new shape).
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "(ab)+c"}),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={5: 2.0},
                       bad_words=["the"], allowed_token_ids=list(range(3, 300))),
    ]  # fmt: skip
    for i, params in enumerate(constrained):
        engine.add_request(f"c{i}", {"prompt_token_ids": [5, 6, 7] * 4}, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_compilations"] + stats["num_compilation_cache_hits"] == compiled
    assert stats["recompilations"] == []


@pytest.mark.parametrize(
    "value, error, match",
    [
        ({"method": "eagle3", "num_speculative_tokens": 2}, ValueError, "not implemented"),
        ({"method": "medusa2"}, ValueError, r"must be one of \['ngram', 'suffix', 'draft_model'\]"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 33}, ValueError, r"\[1, 32\], got 33"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, ValueError,
         "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, ValueError, "unknown keys"),
        ({"num_speculative_tokens": 2}, ValueError, "needs a 'method'"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, TypeError, "must be an int"),
        ({"method": "draft_model"}, ValueError, r"\['model'\] must name the draft model"),
        ({"method": "ngram", "model": "x"}, ValueError, "is for method 'draft_model'"),
        ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, ValueError,
         "is for method 'suffix', not 'ngram'"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ValueError,
         r"max_tree_depth'\] must be in \[1, 1024\], got 0"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, ValueError,
         r"min_token_prob'\] must be in \[0, 1\]"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")}, ValueError,
         "max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": "9"}, TypeError,
         "must be an int"),
        ("ngram", TypeError, "must be a dict"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_are_refused_before_loading(value, error, match):
    with pytest.raises(error, match=match):
        LLM("/nonexistent/checkpoint", speculative_config=value)


def test_one_sequence_at_a_time_still_speculates(plain):
    """max_num_seqs=1 (latency-bound serving) leaves no spare request rows: the drafts use the
    runner's row bucket, which is at least 8."""
    prompts = _prompts()[:2]
    reference = _tokens(plain, prompts, GREEDY)
    llm = LLM("tiny-random-llama", speculative_config=NGRAM, **{**STRESS, "max_num_seqs": 1})
    oracle = _Oracle({tuple(p): r for p, r in zip(prompts, reference, strict=True)})
    llm.engine.core.spec = SpecDecoder(SpeculativeConfig(**NGRAM), proposer=oracle)
    assert _tokens(llm, prompts, GREEDY) == reference
    stats = llm.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
