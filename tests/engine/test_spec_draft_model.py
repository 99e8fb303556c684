"""Speculative decoding with a draft model: the target itself as its draft (every draft right:
acceptance 1, k + 1 tokens a step) and a different, smaller model (drafts often wrong), both
token for token the engine without speculation, greedy and seeded, under chunking, preemption
and shared prefixes; nothing compiles after warm-up; bad drafts refused before loading."""

from __future__ import annotations

import pytest
from engine_utils import assert_nothing_held, random_prompts, step_program

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

K = 3
STRESS = dict(
    block_size=4, num_kv_blocks=16, max_num_seqs=6, max_num_batched_tokens=16,
    max_model_len=96, warmup=False, dtype="float32",
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
# Twice the prompts, twice as long: more than even the roomy pool holds (preemption).
LONG = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
}
_SHARED = [21, 22, 23, 24, 25, 26, 27, 28]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, a smaller draft of the same vocabulary, a draft of another vocabulary)."""
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_hf_checkpoint(root / "target", "llama", num_hidden_layers=2)
    draft = write_tiny_hf_checkpoint(root / "draft", "llama", seed=1, num_hidden_layers=1,
                                     with_tokenizer=False)  # fmt: skip
    other = write_tiny_hf_checkpoint(root / "other", "llama", vocab_size=300,
                                     with_tokenizer=False)  # fmt: skip
    return str(target), str(draft), str(other)


def _prompts() -> list[list[int]]:
    randoms = [[t % 512 for t in p] for p in random_prompts(3, seed=5, lo=6, hi=20)]
    return randoms + [_SHARED + [1, 2], _SHARED + [3], [7, 8] * 6]


def _run(llm: LLM, params, prompts: list[list[int]] | None = None) -> list[list[int]]:
    prompts = _prompts() if prompts is None else prompts
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_nothing_held(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def _draft_config(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K,
            "policy": "always"}  # fmt: skip


@pytest.fixture(scope="module")
def roomy(models) -> LLM:
    """The target as its own draft, with room in the pool for _prompts() (LONG's load
    overfills it; the fault tests reuse it: each leaves it serving)."""
    return LLM(models[0], speculative_config=_draft_config(models[0]),
               **{**STRESS, "num_kv_blocks": 40})  # fmt: skip


@pytest.fixture(scope="module")
def reference(models):
    plain = LLM(models[0], **STRESS)
    out = {"greedy": _run(plain, GREEDY), "seeded": _run(plain, SEEDED)}
    for name, params in LONG.items():
        out[f"{name} long"] = _run(plain, params, _prompts() * 2)
    return out


def test_the_target_as_its_own_draft_is_always_right(roomy, reference):
    # With room in the pool every draft is right: k + 1 tokens a step wherever the budget and
    # the length limits allow k drafts.
    before = roomy.get_stats()
    assert _run(roomy, GREEDY) == reference["greedy"]
    drafts, accepted = (
        roomy.get_stats()[key] - before[key]
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    assert accepted == drafts > 0
    # More than the pool holds preempts, and drops lookahead slots (some drafts then miss):
    # same tokens. (The same engine: a smaller pool would compile every step again.)
    before = roomy.get_stats()
    for name, params in LONG.items():
        assert _run(roomy, params, _prompts() * 2) == reference[f"{name} long"]
    preempted, accepted = (
        roomy.get_stats()[key] - before[key]
        for key in ("num_preemptions", "spec_decode_num_accepted_tokens")
    )
    assert preempted > 0 and accepted > 0


def test_a_smaller_draft_changes_no_token(models, reference):
    llm = LLM(models[0], speculative_config=_draft_config(models[1]), **STRESS)
    assert _run(llm, GREEDY) == reference["greedy"]
    assert _run(llm, SEEDED) == reference["seeded"]
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_fewer_drafts_run_fewer_draft_steps(roomy):
    """The policy's "fit" arm asks for fewer than k drafts: the draft model runs only that
    many steps, in the same executable (the count is an argument, not a shape), and proposes
    the first drafts of the k-step proposal."""
    engine = roomy.engine
    engine.add_request("fewer", {"prompt_token_ids": _SHARED}, GREEDY)
    engine.step()  # its prefill: now a row of the runner
    (req,) = engine.scheduler.running
    draft = engine.runner.draft
    full = draft.propose([req], K)[req.request_id]
    compiled = draft.compiles.num_fresh + draft.compiles.num_cache_hits
    try:
        assert len(full) == K and len(set(full)) > 1
        for steps in range(1, K):
            assert draft.propose([req], steps)[req.request_id] == full[:steps]
            rows = draft._propose_rows([req], 0, steps)
            assert not rows[:, steps:].any()  # never drafted
        assert draft.compiles.num_fresh + draft.compiles.num_cache_hits == compiled
    finally:
        engine.abort_request("fewer")
    assert_nothing_held(engine)


@pytest.mark.slow
def test_nothing_compiles_after_warmup_with_a_draft_model(models):
    """A draft of other shapes than the target (one layer): its proposal and its own block
    copies are warmed up, and an unseeded random request's sampled drafts (their q buffers,
    the general-q rule) and constrained requests' drafts compile nothing more."""
    # Budget 16 (4 rows of k + 1) and pages of 16: 24 programs to warm up instead of 26.
    engine = LLMEngine(
        models[0], num_kv_blocks=24, block_size=16, max_num_seqs=4, max_num_batched_tokens=16,
        max_model_len=64, speculative_config=_draft_config(models[1]),
    )  # fmt: skip
    before = engine.get_stats()
    compiled = before["num_compilations"] + before["num_compilation_cache_hits"]
    for i, prompt in enumerate([[5, 6, 7] * 5, [9, 8] * 9, [3, 4, 5, 6, 7, 8]]):
        params = SamplingParams(temperature=0.7 * (i % 2), seed=None if i == 1 else i,
                                max_tokens=20, n=1 + (i == 2), ignore_eos=True)  # fmt: skip
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    # Constrained requests speculate too (a mask per verification row, sampled drafts never
    # cut): the sampler's list variant, nothing new.
    for i, params in enumerate([
        SamplingParams(temperature=1.0, max_tokens=20, structured_outputs={"regex": "(ab)+c"}),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={5: 2.0},
                       bad_words=["ab"]),
    ]):  # fmt: skip
        engine.add_request(f"c{i}", {"prompt_token_ids": [5, 6, 7] * 4}, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_cow_copies"] > 0  # n = 2: the draft's pages were copied too
    assert stats["recompilations"] == []
    assert stats["num_compilations"] + stats["num_compilation_cache_hits"] == compiled


def _acceptance(llm: LLM, params: SamplingParams) -> float:
    before = llm.get_stats()
    prompts = [{"prompt_token_ids": [t % 64 for t in p]} for p in _prompts()]
    llm.generate(prompts, params, use_tqdm=False)
    assert_nothing_held(llm.engine)
    drafts, accepted = (
        llm.get_stats()[key] - before[key]
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    assert drafts > 0
    return accepted / drafts


def test_unseeded_random_requests_verify_sampled_drafts(tmp_path):
    """An unseeded random request gets drafts sampled from the draft model, its q kept for the
    rejection sampler's general rule; a seeded one gets greedy drafts (its tokens stay those
    without speculation). With the target as its own draft and q over the whole vocabulary
    (64 tokens, within DRAFT_TOP_Q), q is the target's own distribution: nearly every sampled
    draft is accepted, where a greedy draft is accepted with probability p(argmax) only."""
    model = str(write_tiny_hf_checkpoint(tmp_path / "v64", "llama", vocab_size=64,
                                         num_hidden_layers=1, with_tokenizer=False))  # fmt: skip
    llm = LLM(model, speculative_config=_draft_config(model), **{**STRESS, "num_kv_blocks": 40})
    sampled = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    assert _acceptance(llm, sampled) > 0.95
    assert _acceptance(llm, seeded) < 0.5
    stats = llm.get_stats()
    assert stats["recompilations"] == []


def test_a_draft_of_another_vocabulary_is_refused_before_loading(models):
    with pytest.raises(ValueError, match=r"vocab_size=300.*has 512|vocab_size"):
        LLM(models[0], speculative_config=_draft_config(models[2]), **STRESS)


# Where a fault can land in a speculating step: (owner, attribute, after the real call?).
_FAULTS = {
    "the forward half, after it ran": ("runner", "_forward", True),
    "the sample half, after it ran": ("runner", "_sample", True),
    "the draft's proposal": ("draft", "_propose", False),
    "the draft's proposal, after it ran": ("draft", "_propose", True),
    "the scheduler update (rollback)": ("scheduler", "update_from_output", False),
    "setting the drafts": ("scheduler", "set_spec_tokens", False),
}


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize("where", list(_FAULTS))
def test_a_fault_mid_speculation_aborts_and_the_engine_serves_on(roomy, reference, where, exc,
                                                                 monkeypatch):  # fmt: skip
    llm, engine = roomy, roomy.engine
    owners = {"runner": engine.runner, "draft": engine.runner.draft, "scheduler": engine.scheduler}
    owner_name, attr, after = _FAULTS[where]
    owner = owners[owner_name]
    attr = step_program(owner, attr) if owner_name == "runner" else attr
    real, calls = getattr(owner, attr), []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and not after:
            raise exc
        result = real(*args, **kwargs)
        if len(calls) == 3:
            raise exc
        return result

    monkeypatch.setattr(owner, attr, faulty)
    with pytest.raises(type(exc)):
        _run(llm, GREEDY)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and engine.runner.is_idle
    assert_nothing_held(engine)
    assert _run(llm, GREEDY) == reference["greedy"]
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
