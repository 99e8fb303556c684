"""Greedy generation of the whole engine matches Hugging Face transformers token for token, under
scheduler stress: tiny blocks, a pool too small for the batch (preemption), a token budget
smaller than the prompts (chunked prefill), prompts sharing a prefix (prefix-cache hits), and
again with prefix caching off. Where a token differs, it must be at a near-tie of transformers'
own top-2 logits (float32 summation order differs between the two stacks)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from parity_utils import (  # noqa: E402
    MAX_TOKENS,
    assert_all_blocks_free,
    assert_matches_hf,
    hf_greedy,
    make_prompts,
)

from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

# Every case builds an engine and runs transformers: the slow tier (the fast one keeps the
# logits parity of every family, tests/models/test_hf_parity.py).
pytestmark = pytest.mark.slow

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
    # Windows of 4, soft caps, local / global RoPE: checkpoints_tools.testing.FAMILY_DEFAULTS.
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    # 4 experts, top-2 (Qwen3-MoE with a dense layer); Phi-3's LongRoPE past its original
    # context of 8: checkpoints_tools.testing.FAMILY_DEFAULTS.
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True)),
    "phi3": ("phi3", {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    folder = write_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)
    prompts = make_prompts(512)
    return request.param, (folder, prompts, hf_greedy(folder, prompts))


def test_greedy_matches_transformers_under_scheduler_stress(checkpoint):
    name, case = checkpoint
    _check_under_stress(*case, prefix_caching=True)
    if name == "llama3_rope":
        # Prefix caching off changes the scheduler's path, not the model's: one family, on its
        # checkpoint and transformers' tokens (its steps load from the compilation cache).
        _check_under_stress(*case, prefix_caching=False)


def _check_under_stress(folder, prompts, expected, *, prefix_caching: bool) -> None:
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        num_kv_blocks=16,  # 15 usable blocks: the 4 requests need ~27, so preemption happens
        max_num_batched_tokens=16,  # smaller than most prompts: chunked prefill
        max_num_seqs=4,
        max_model_len=64,
        enable_prefix_caching=prefix_caching,
        warmup=False,
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
    prompts = make_prompts(512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for caching in (True, False):
        llm = LLM(
            str(folder),
            block_size=4,
            num_kv_blocks=64,
            max_num_batched_tokens=16,  # the stress tests' (fewer steps to compile than 32)
            max_num_seqs=4,
            max_model_len=64,
            enable_prefix_caching=caching,
            warmup=False,
        )
        # Twice, so the second pass hits the cache filled by the first.
        outs = llm.generate(prompts + prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
    assert np.array_equal(runs[0][: len(prompts)], runs[0][len(prompts) :])
