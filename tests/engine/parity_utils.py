"""Shared helpers of the end-to-end parity tests: prompts, transformers' greedy reference with
top-2 margins, and the token comparison that tolerates only near-ties."""

from __future__ import annotations

import random

import torch
import transformers

from jaxserve import LLM

NEAR_TIE = 1e-3  # top-1 minus top-2 logit under which either token is a fair greedy choice
MAX_TOKENS = 10


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 11)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (23, 7)]
    return prompts


def hf_greedy(folder, prompts):
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
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]
    pool = sched.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
