"""Greedy generation of the whole engine matches Hugging Face transformers token for token, under
scheduler stress: tiny blocks, a pool too small for the batch (preemption), a token budget
smaller than the prompts (chunked prefill), prompts sharing a prefix (prefix-cache hits), and
again with prefix caching off. Where a token differs, it must be at a near-tie of transformers'
own top-2 logits (float32 summation order differs between the two stacks)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

NEAR_TIE = 1e-3  # top-1 minus top-2 logit under which either token is a fair greedy choice
MAX_TOKENS = 10

FAMILIES = {
    "llama3_rope": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral_window": ("mistral", dict(sliding_window=12)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 11)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (23, 7)]
    return prompts


def _hf_greedy(folder, prompts):
    """Greedy continuation of each prompt by transformers, with the top-2 margin per step."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            tokens, margins = [], []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top2 = torch.topk(logits, 2)
                tokens.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
                ids.append(tokens[-1])
            results.append((tokens, margins))
    return results


def assert_matches_hf(ours: list[int], hf: tuple[list[int], list[float]]) -> None:
    tokens, margins = hf
    for i, (a, b) in enumerate(zip(ours, tokens, strict=True)):
        if a != b:
            assert margins[i] < NEAR_TIE, (
                f"token {i}: jaxserve {a} != transformers {b} with top-2 margin {margins[i]:.2e}"
            )
            return  # after a tie the two continuations legitimately diverge


def assert_all_blocks_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    stats = llm.get_stats()
    assert not sched.has_unfinished_requests()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    pool = sched.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    folder = write_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)
    prompts = _prompts(512)
    return folder, prompts, _hf_greedy(folder, prompts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers_under_scheduler_stress(checkpoint, prefix_caching):
    folder, prompts, expected = checkpoint
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        num_kv_blocks=16,  # 15 usable blocks: the 4 requests need ~27, so preemption happens
        max_num_batched_tokens=16,  # smaller than most prompts: chunked prefill
        max_num_seqs=4,
        max_model_len=64,
        enable_prefix_caching=prefix_caching,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, hf in zip(outs, expected, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert_matches_hf(out.outputs[0].token_ids, hf)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    if prefix_caching:
        assert stats["prefix_cache_hits"] > 0
    else:
        assert stats["prefix_cache_hits"] == 0
    assert_all_blocks_free(llm)


def test_prefix_caching_does_not_change_tokens(tmp_path):
    family, overrides = FAMILIES["qwen3"]
    folder = write_tiny_hf_checkpoint(tmp_path, family, **overrides)
    prompts = _prompts(512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for caching in (True, False):
        llm = LLM(
            str(folder),
            block_size=4,
            num_kv_blocks=64,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            max_model_len=64,
            enable_prefix_caching=caching,
        )
        # Twice, so the second pass hits the cache filled by the first.
        outs = llm.generate(prompts + prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
    assert np.array_equal(runs[0][: len(prompts)], runs[0][len(prompts) :])
