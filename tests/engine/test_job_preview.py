"""A job handed to its engine's construction (engine/job_preview.py, runner/job_startup.py):
its shapes compile while the weights load, the job's own warm-up then finds nothing new, the
tokens are those of the job warmed up when it starts, and a job that reaches beyond its
preview still warms the rest up before its first step. Orders are checked by events, never
by wall-clock times."""

from __future__ import annotations

import threading

import pytest

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.checkpoints_tools.tiny_random import tiny_tokenizer_info
from jaxserve.engine.job_preview import JobPreview, PreviewRequest, read_request
from jaxserve.engine.prompts import PromptProcessor
from jaxserve.jobs.score_job import ScoreLine
from jaxserve.jobs.score_job import job_preview as score_preview
from jaxserve.runner import factory, job_startup
from jaxserve.runner.startup import StartupPipeline

ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              num_kv_blocks=40)  # fmt: skip
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, "The quick brown fox"]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)]  # fmt: skip
WAIT_S = 300  # a bound on every wait between the two threads: reached only when broken
# The whole module on one xdist worker, in the group tests/conftest.py gives the users of the
# module-scoped ``handed`` engine: the engines the later tests build (the CLI's, the
# weights-first one) then load the steps ``handed`` compiled from the session's compilation
# cache, instead of compiling them again on the other worker at the same time.
pytestmark = pytest.mark.xdist_group("module:tests/engine/test_job_preview.py")


def test_a_preview_checks_its_requests():
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        JobPreview.of(["a"], PARAMS)
    with pytest.raises(TypeError, match=r"requests\[0\] must be a PreviewRequest"):
        JobPreview(("a",))
    with pytest.raises(TypeError, match=r"requests\[0\]\.params must be a SamplingParams"):
        JobPreview((PreviewRequest("a", {"max_tokens": 3}),))
    assert JobPreview.of(["a", "b"], PARAMS[0]).requests[1] == PreviewRequest("b", PARAMS[0])


def test_warmup_for_is_refused_where_it_cannot_be_honoured():
    # Before anything is resolved or loaded: a bad model name would raise otherwise.
    preview = JobPreview.of(["a"], PARAMS[0])
    with pytest.raises(ValueError, match="warmup_for needs warmup='job'.*warmup=True"):
        LLMEngine("no-such-model", warmup=True, warmup_for=preview)
    with pytest.raises(ValueError, match="warmup=False"):
        LLM("no-such-model", warmup=False, warmup_for=preview)
    with pytest.raises(TypeError, match="warmup_for must be a JobPreview, got list"):
        LLM("no-such-model", warmup_for=["a"])


def test_a_preview_request_is_read_as_the_engine_reads_it():
    tokenizer = tiny_tokenizer_info()
    prompts = PromptProcessor(tokenizer, tokenizer.tokenizer.get_vocab_size(), 64, "tiny")
    _, prompt_ids = prompts.process("Hello world")
    _, more = prompts.process(" there", add_special_tokens=False)
    scored = read_request(prompts, PreviewRequest("Hello world", PARAMS[0], " there"))
    assert scored.num_prompt_tokens == len(prompt_ids) + len(more)
    assert (scored.max_tokens, scored.n, scored.needs_lists) == (6, 1, False)
    # A grammar or bad words: a per-step mask, the sampler's list variant.
    grammar = SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]+"})
    assert read_request(prompts, PreviewRequest("Hi", grammar)).needs_lists
    assert read_request(prompts, PreviewRequest("Hi", SamplingParams(bad_words=["x"]))).needs_lists
    # Unreadable: left out (the job's own check names it).
    assert read_request(prompts, PreviewRequest({"prompt_token_ids": [99999]}, PARAMS[0])) is None
    assert read_request(prompts, PreviewRequest("", PARAMS[0])) is None


def test_the_score_job_previews_prompt_and_continuation():
    lines = [ScoreLine("a", "The capital is", " Paris", "p.jsonl:1")]
    (request,) = score_preview(lines).requests
    assert (request.prompt, request.continuation) == ("The capital is", " Paris")
    assert request.params.prompt_logprobs == 0 and request.params.max_tokens == 1


@pytest.fixture(scope="module")
def handed():
    """(the LLM built with the job handed, the start-up's events, the construction's
    compilations): the load waits for the job's set to compile (a start-up that compiled it
    only after the weights were in would never get past it: bounded, it fails instead)."""
    events, compiled = [], threading.Event()
    real_event, real_compile, real_load = (
        StartupPipeline._event, job_startup.compile_set, factory._load_weights
    )  # fmt: skip

    def event(self, what, when):
        events.append((what, when))
        real_event(self, what, when)

    def compile_set(*args, **kwargs):
        real_compile(*args, **kwargs)
        compiled.set()

    def load(resolved):
        if not compiled.wait(WAIT_S):
            raise TimeoutError("the job's compilations waited for the weights")
        return real_load(resolved)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StartupPipeline, "_event", event)
        mp.setattr(job_startup, "compile_set", compile_set)
        mp.setattr(factory, "_load_weights", load)
        llm = LLM("tiny-random-llama", warmup_for=JobPreview.of(PROMPTS, PARAMS), **ENGINE)
    return llm, events, _compiled(llm)


@pytest.mark.slow
def test_a_handed_job_compiles_while_the_weights_load_and_nothing_after(handed):
    llm, events, at_construction = handed
    assert events == [("load", "start"), ("resolve", "end"), ("compile", "start"),
                      ("compile", "end"), ("load", "end"), ("weights", "attached")]  # fmt: skip
    runner = llm.engine.runner
    assert at_construction > 0 and runner.warmed  # compiled, and each step run once
    warmed = set(runner.warmed)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _compiled(llm) == at_construction and runner.warmed == warmed
    assert llm.get_stats()["recompilations"] == []
    # The path without the overlap: the job warms up when it starts, the same set, the same
    # tokens.
    plain = LLM("tiny-random-llama", **ENGINE)
    assert _compiled(plain) == 0
    reference = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert plain.engine.runner.warmed == warmed
    assert _compiled(plain) == at_construction
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.slow
def test_a_job_beyond_its_preview_warms_the_rest_up_before_its_step(handed):
    llm, _, _ = handed
    before = _compiled(llm)
    longer = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 25, 30, 28)]
    llm.generate(longer, PARAMS[0], use_tqdm=False)
    # Shapes the preview did not reach compiled by the job's warm-up, none after it.
    assert _compiled(llm) > before and llm.get_stats()["recompilations"] == []


def _compiled(llm: LLM) -> int:
    stats = llm.get_stats()
    return stats["num_compilations"] + stats["num_compilation_cache_hits"]


@pytest.mark.slow
def test_jaxserve_generate_hands_its_job_to_the_construction(tmp_path, monkeypatch, capsys):
    import json

    from jaxserve import cli
    from jaxserve.engine import llm as llm_module

    handed, warm_ups = [], []
    real_init, real_warm_up = llm_module.LLM.__init__, llm_module.LLM.warm_up

    def init(self, model, **kwargs):
        handed.append(kwargs.get("warmup_for"))
        real_init(self, model, **kwargs)

    def warm_up(self, requests):
        warm_ups.append(real_warm_up(self, requests))
        return warm_ups[-1]

    monkeypatch.setattr(llm_module.LLM, "__init__", init)
    monkeypatch.setattr(llm_module.LLM, "warm_up", warm_up)
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "The quick brown fox", "max_tokens": 5},
        {"prompt_token_ids": [1, 40, 41, 42, 43], "n": 2, "temperature": 1.0, "seed": 7},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "policy": "always"}
    argv = ["generate", "--input", str(prompts), "--no-progress", "--max-tokens", "4",
            "--speculative-config", json.dumps(ngram),
            *(f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items())]  # fmt: skip
    assert cli.main(argv) == 0
    (preview,) = handed
    assert [r.prompt for r in preview.requests] == [
        "The quick brown fox",
        {"prompt_token_ids": [1, 40, 41, 42, 43]},
    ]
    # Everything the job (its forks and its drafts included) reaches compiled at construction.
    assert warm_ups == [0]
    summary = capsys.readouterr().out
    assert "requests:           2 (3 completions)" in summary


@pytest.mark.slow
def test_the_weights_first_start_up_compiles_the_handed_set_too(handed, monkeypatch):
    # As an FP8 KV cache's or a Hub model's start-up: the load first, then the handed set, the
    # same set as the overlapped start-up's.
    monkeypatch.setattr(factory, "_weights_first", lambda resolved: True)
    llm = LLM("tiny-random-llama", warmup_for=JobPreview.of(PROMPTS, PARAMS), **ENGINE)
    at_construction = _compiled(llm)
    assert at_construction == handed[2] > 0
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _compiled(llm) == at_construction and llm.get_stats()["recompilations"] == []
