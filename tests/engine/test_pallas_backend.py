"""attention_backend="pallas" end to end on CPU (the GPU kernel in interpret mode): the same greedy
tokens as the reference backend and as transformers, under chunking, prefix hits and preemption."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from parity_utils import (  # noqa: E402
    assert_all_blocks_free,
    assert_matches_hf,
    hf_greedy,
    make_prompts,
)

from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402


@pytest.mark.slow
def test_pallas_backend_matches_reference_and_transformers(tmp_path):
    folder = write_tiny_hf_checkpoint(tmp_path, "qwen3", head_dim=32)
    prompts = make_prompts(512)
    expected = hf_greedy(folder, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for backend in ("pallas", "reference"):
        llm = LLM(
            str(folder),
            dtype="float32",
            block_size=4,
            num_kv_blocks=16,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            max_model_len=64,
            attention_backend=backend,
            warmup=False,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        assert llm.get_stats()["num_preemptions"] > 0
        assert llm.get_stats()["prefix_cache_hits"] > 0
        assert_all_blocks_free(llm)
    assert tokens["pallas"] == tokens["reference"]
    for ours, hf in zip(tokens["pallas"], expected, strict=True):
        assert_matches_hf(ours, hf)
