"""Sampling features end to end: logprobs and prompt logprobs against transformers, parallel
sampling (n > 1) sharing blocks with copy-on-write, batch scoring and chat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.engine.fan_out import mix_seed
from jaxserve.runner.logprob_chunks import CHUNK_ROWS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf_pair(hf_folder):
    folder = hf_folder
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        warmup=False,
    )
    return model, llm


def _hf_logprobs(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()  # [len, V]


@pytest.mark.slow
def test_logprobs_and_prompt_logprobs_match_transformers(hf_pair):
    model, llm = hf_pair
    prompt = [7, 99, 23, 301, 45, 12, 400, 8, 77, 150, 3, 260, 31, 90, 11, 5, 222, 6, 19, 48]
    params = SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)  # 20-token prompt, 16-token budget
    completion = out.outputs[0]
    ref = _hf_logprobs(model, prompt + completion.token_ids)

    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]]) < TOL
        top = np.argsort(-ref[i - 1])[:2]
        for rank, tok in enumerate(top, start=1):
            if tok in entry:
                assert abs(entry[tok].logprob - ref[i - 1, tok]) < TOL
                assert entry[tok].rank == rank
        assert len(entry) in (2, 3)  # the prompt token plus top-2 (it may be one of them)

    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry[tok].logprob - row[tok]) < TOL
        assert entry[tok].rank == 1  # greedy
        assert set(np.argsort(-row)[:3]) == set(entry)
        total += row[tok]
    assert abs(completion.cumulative_logprob - total) < 10 * TOL


@pytest.mark.slow
def test_prompt_logprobs_of_a_step_longer_than_one_chunk(hf_folder, hf_pair):
    """Two prompts of 200 and 100 tokens in one step of 300 rows: its prompt logprobs are
    computed CHUNK_ROWS (256) rows at a time (runner/logprob_chunks.py), a chunk boundary
    inside the first prompt and the second in the next chunk; each is still transformers'."""
    model, _ = hf_pair
    llm = LLM(
        str(hf_folder),
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_num_batched_tokens=512,  # both prompts in the first step
        max_num_seqs=2,
        max_model_len=256,
        warmup=False,
    )
    assert 300 > CHUNK_ROWS
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (200, 100)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["num_steps"] == 1  # one step: 300 prompt rows
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_logprobs(model, prompt)
        got = [out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i]
        want = [ref[i - 1, tok] for i, tok in enumerate(prompt) if i]
        np.testing.assert_allclose(got, want, atol=TOL)


@pytest.mark.slow
def test_prompt_logprobs_are_complete_for_a_cached_prompt(hf_pair):
    _, llm = hf_pair
    prompt = list(range(40, 61))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt)
    assert all(out.prompt_logprobs[i][prompt[i]].logprob <= 0 for i in range(1, len(prompt)))


def test_score_is_the_continuation_logprob(hf_pair):
    model, llm = hf_pair
    prompts = [[5, 17, 42, 9], [300, 11]]
    conts = [[88, 23], [7, 7, 7]]
    scores = llm.score(prompts, conts)
    for p, c, s in zip(prompts, conts, scores, strict=True):
        ref = _hf_logprobs(model, p + c)
        expected = sum(ref[len(p) - 1 + j, tok] for j, tok in enumerate(c))
        assert abs(s - expected) < 10 * TOL


@pytest.mark.slow
def test_parallel_sampling_shares_blocks_with_copy_on_write():
    engine = LLMEngine(
        "tiny-random-llama",
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        warmup=False,
    )
    prompt = list(range(10, 31))  # 21 tokens: blocks of 8, 8 and a partial one of 5
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    engine.add_request("r", prompt, params)
    pool = engine.scheduler.kv_cache_manager.block_pool
    shared_seen = False
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        shared_seen |= any(b.ref_cnt == 3 for b in pool.blocks[1:])
    assert shared_seen, "the children never shared the prompt blocks"
    stats = engine.get_stats()
    assert stats["num_cow_copies"] >= 2  # each child but the last writer copies the partial block
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    tokens = [tuple(c.token_ids) for c in final.outputs]
    assert all(len(t) == 12 for t in tokens)
    assert len(set(tokens)) == 3, "children must draw independent streams"
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    # Each child reads the right KV through its copied block: it gives exactly what a lone
    # request with the child's seed gives. And the whole request is reproducible.
    llm = LLM(
        "tiny-random-llama",
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        warmup=False,
    )
    seeds = [11] + [mix_seed(11, i) for i in (1, 2)]
    alone = llm.generate(
        [prompt] * 3, [dataclasses.replace(params, n=1, seed=s) for s in seeds], use_tqdm=False
    )
    assert [tuple(o.outputs[0].token_ids) for o in alone] == tokens
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == tokens


@pytest.mark.slow
def test_chat_renders_the_template_and_generates():
    llm = LLM(
        "tiny-random-llama",
        block_size=8,
        num_kv_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
        warmup=False,
    )
    messages = [{"role": "user", "content": "Hello there!"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert "Hello there!" in out.prompt
    assert out.finished and out.outputs[0].token_ids
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}])
