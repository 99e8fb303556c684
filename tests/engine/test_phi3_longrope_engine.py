"""Phi-3's LongRoPE factor set is the engine's choice, by max_model_len: an engine serving at
most the original context (8 tokens in the tiny checkpoint, whose max_position_embeddings is
256) uses the short factors, and its greedy tokens are transformers' on those short sequences.
The long regime's parity is in tests/models/test_hf_parity.py and test_generate_parity.py."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from parity_utils import assert_matches_hf  # noqa: E402

from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

PROMPT = [1, 57, 300, 12]
NEW_TOKENS = 4  # 8 tokens in all: the original context, so transformers keeps the short set


def _hf_greedy(folder) -> tuple[list[int], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, tokens, margins = list(PROMPT), [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            top2 = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids.append(tokens[-1])
    return tokens, margins


@pytest.mark.slow
def test_max_model_len_within_the_original_context_uses_the_short_factors(tmp_path):
    folder = write_tiny_hf_checkpoint(tmp_path, "phi3", with_tokenizer=False)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=len(PROMPT) + NEW_TOKENS,
        block_size=4,
        num_kv_blocks=8,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        warmup=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert_matches_hf(out.outputs[0].token_ids, _hf_greedy(folder))
