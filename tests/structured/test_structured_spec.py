"""Structured outputs, logit_bias, allowed_token_ids and bad_words with speculative decoding:
drafts are checked against each request's constraints and every verification row takes the
mask of its own output position, so greedy and seeded tokens are those of the engine without
speculation, token for token, and every output is valid. N-gram drafts, drafts always right
and always wrong (an oracle), a draft model (the target as its own draft: every greedy draft
right; sampled drafts for unseeded random requests: valid), n > 1, preemption, async
scheduling on and off."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from test_structured_generate import CODE, CONFIG, DIGITS, FLAG, PERSON, _tagged

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.spec_decode import SpecDecoder
from jaxserve.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}
REGEX = r"[a-c]{3}-[0-9]{2}"
GRAMMAR = 'start: pair ("," pair)?\npair: KEY "=" VAL\nKEY: /[a-z]{1,3}/\nVAL: /[0-9]{1,2}/'
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny-random-llama", **CONFIG)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM("tiny-random-llama", speculative_config=NGRAM, **CONFIG)


def assert_nothing_held(engine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]


def _grammar_params(**kw) -> list[SamplingParams]:
    def so(**c):
        return SamplingParams(max_tokens=100, structured_outputs=c, **kw)

    return [so(json=PERSON), so(json=DIGITS), so(json=CODE), so(regex=REGEX),
            so(choice=CHOICES), so(grammar=GRAMMAR)]  # fmt: skip


TAG = {"structures": [{"begin": "all=", "schema": FLAG, "end": ";"}], "triggers": ["all"]}


def _tag_params(tokenizer, **kw) -> SamplingParams:
    """A structural tag, its trigger's token favoured: free text, then tags back to back
    (repetitive: n-gram drafts run across tags and the free text between them)."""
    (trigger,) = tokenizer.encode("all", add_special_tokens=False).ids
    return SamplingParams(max_tokens=40, ignore_eos=True, logit_bias={trigger: 5.0},
                          structured_outputs={"structural_tag": TAG}, **kw)  # fmt: skip


def _token_params(tokenizer, **kw) -> list[SamplingParams]:
    """logit_bias, allowed_token_ids and a two-token bad word (with ignore_eos)."""
    seq = tokenizer.encode("France", add_special_tokens=False).ids
    (the,) = tokenizer.encode("the", add_special_tokens=False).ids
    base = dict(max_tokens=24, ignore_eos=True, **kw)
    return [
        SamplingParams(logit_bias={500: 3.0, 7: -100.0, the: 2.0}, **base),
        SamplingParams(allowed_token_ids=sorted({*seq, the, 500}), bad_words=["France"], **base),
        SamplingParams(bad_words=["France", "the"], **base),
    ]


def _check_valid(params: SamplingParams, outputs) -> None:
    so = params.structured_outputs
    for c in outputs:
        if so is not None and so.structural_tag is not None:  # cut by max_tokens: parts
            _, values = _tagged(c.text, "all", "all=", ";")
            assert values, c.text
            for value in values:
                jsonschema.validate(value, FLAG)
        if so is None or c.finish_reason != "stop":
            continue
        if so.json is not None:
            schema = so.json if isinstance(so.json, dict) else json.loads(so.json)
            jsonschema.validate(json.loads(c.text), schema)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, c.text)
        elif so.choice is not None:
            assert c.text in so.choice


def _run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_nothing_held(llm.engine)
    for p, o in zip(params if isinstance(params, list) else [params] * len(outs), outs,
                    strict=True):  # fmt: skip
        _check_valid(p, o.outputs)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_and_seeded_tokens_are_those_without_speculation(plain, spec, async_scheduling):
    spec.engine.core.reset_scheduler(async_scheduling=async_scheduling)
    tokenizer = plain.get_tokenizer()
    params = []
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
        params += _grammar_params(**kw) + _token_params(tokenizer, **kw)
        params.append(_tag_params(tokenizer, **kw))
    params.append(SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60,
                                 structured_outputs={"json": DIGITS}))  # fmt: skip
    prompts = ["Hi", "Describe a person:", "Pick one"] * 7
    prompts = prompts[: len(params)]
    want = _run(plain, prompts, params)
    before = spec.get_stats()["spec_decode_num_draft_tokens"]
    assert _run(spec, prompts, params) == want
    assert spec.get_stats()["spec_decode_num_draft_tokens"] > before


class _Oracle:
    """Proposes each request's reference continuation (always right) and, past its end, its
    own first tokens again, or with "wrong" the next token id of each (mostly forbidden by the
    grammar: cut). With "uncut", it says its drafts are sampled: constraints do not cut them
    (draft_checks.py), and a run past the grammar's end is trimmed after the step."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], kind: str) -> None:
        self.reference, self.wrong = reference, kind == "always-wrong"
        self.uncut = kind == "uncut"

    def samples_drafts(self, request) -> bool:
        return self.uncut

    def propose(self, requests, k):
        drafts = {}
        for req in requests:
            reference = self.reference[tuple(req.prompt_token_ids)]
            full = list(req.prompt_token_ids) + reference + reference
            guess = full[len(req.all_token_ids) : len(req.all_token_ids) + k]
            drafts[req.request_id] = [(t + 1) % 1000 for t in guess] if self.wrong else guess
        return drafts


@pytest.mark.parametrize("kind", ["always-right", "always-wrong", "uncut"])
def test_oracle_drafts_through_the_grammar_change_steps_not_tokens(plain, spec, kind):
    """Right drafts run through a grammar up to its end (the draft that would end it is cut:
    its row is the step's last); wrong ones are cut at the first token it forbids; uncut ones
    run past the end, and the run is trimmed there."""
    prompts = [[11 + i, 12, 13, 14 + i] for i in range(7)]
    params = [*_grammar_params(temperature=0.0), _tag_params(plain.get_tokenizer())]
    want = _run(plain, [{"prompt_token_ids": p} for p in prompts], params)
    reference = {tuple(p): w[0] for p, w in zip(prompts, want, strict=True)}
    core = spec.engine.core
    saved = core.spec
    core.spec = SpecDecoder(SpeculativeConfig(**NGRAM), proposer=_Oracle(reference, kind))
    try:
        before = spec.get_stats()
        got = _run(spec, [{"prompt_token_ids": p} for p in prompts], params)
        after = spec.get_stats()
    finally:
        core.spec = saved
    assert got == want
    drafts, accepted = (
        after[key] - before[key]
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    if kind == "always-wrong":
        assert accepted == 0
    elif kind == "always-right":
        assert accepted == drafts > 0
        assert after["num_steps"] - before["num_steps"] < sum(map(len, reference.values()))


def test_suffix_decoding_drafts_through_the_grammar(plain, spec):
    """The "suffix" method (a host proposer, swapped into the n-gram engine): the second time
    the same requests run, their outputs are in the engine-wide tree and most drafts are
    right; tokens unchanged."""
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=3, policy="always",
                               suffix_decoding_max_spec_factor=4.0)  # fmt: skip
    prompts = ["Hi", "Describe a person:", "Pick one"] * 2
    params = _grammar_params(temperature=0.0)
    want = _run(plain, prompts, params)
    core = spec.engine.core
    saved, core.spec = core.spec, SpecDecoder(config)
    try:
        assert _run(spec, prompts, params) == want
        before = spec.get_stats()
        assert _run(spec, prompts, params) == want
        after = spec.get_stats()
    finally:
        core.spec = saved
    drafts, accepted = (
        after[key] - before[key]
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    assert accepted > 0.5 * drafts > 0


def test_preemption_with_drafts_keeps_each_matcher_in_step(plain, spec):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(8)]
    params = SamplingParams(max_tokens=86, temperature=0.0, structured_outputs={"json": PERSON})
    before = spec.get_stats()["num_preemptions"]
    want = _run(plain, [{"prompt_token_ids": p} for p in prompts], params)
    assert _run(spec, [{"prompt_token_ids": p} for p in prompts], params) == want
    assert spec.get_stats()["num_preemptions"] > before


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("spec-structured")
    return str(write_tiny_hf_checkpoint(root / "target", "llama", num_hidden_layers=2))


@pytest.mark.slow  # two engines of their own
def test_a_draft_models_drafts_are_checked_greedy_exact_and_sampled_valid(target):
    draft = {"method": "draft_model", "model": target, "num_speculative_tokens": 3,
             "policy": "always"}  # fmt: skip
    small = {**CONFIG, "max_num_seqs": 4}
    prompts = ["Hi", "Describe a person:", "Pick one"] * 2
    greedy = _grammar_params(temperature=0.0)
    want = _run(LLM(target, **small), prompts, greedy)
    llm = LLM(target, speculative_config=draft, **small)
    assert _run(llm, prompts, greedy) == want
    stats = llm.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    # Unseeded random requests: drafts sampled from the draft model (never cut), a run past
    # the grammar's end trimmed; every output valid and complete.
    sampled = _grammar_params(temperature=1.0)[2:5]  # CODE, the regex, the choice
    outs = llm.generate(prompts[: len(sampled)], sampled, use_tqdm=False)
    for p, o in zip(sampled, outs, strict=True):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        _check_valid(p, o.outputs)
    assert_nothing_held(llm.engine)


def test_constraints_that_leave_no_token_end_the_request_with_drafts(spec):
    (the,) = spec.get_tokenizer().encode("the", add_special_tokens=False).ids
    eos = sorted(spec.engine.info.eos_token_ids)
    dead_ends = [
        SamplingParams(allowed_token_ids=[the], bad_words=["the"], temperature=1.0, seed=7),
        SamplingParams(allowed_token_ids=[5], structured_outputs={"choice": ["the"]}),
    ]
    for o in spec.generate(["the the the the", "y"], dead_ends, use_tqdm=False):
        (c,) = o.outputs
        assert c.finish_reason == "abort" and c.token_ids == eos[:1]
    assert_nothing_held(spec.engine)
