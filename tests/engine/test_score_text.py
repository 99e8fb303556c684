"""LLM.score on text against transformers, and LLM(tokenizer=...): the text paths that
tokenization can make silently wrong."""

from __future__ import annotations

import pathlib

import pytest
from engine_utils import assert_nothing_held
from tokenizers import Tokenizer

from jaxserve import LLM
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAIRS = [
    ("Hello", " world"),
    ("The capital of France is", " Paris, of course."),
    ("a", "b c d e f"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=3)


def _hf_scores(folder: pathlib.Path, pairs) -> list[float]:
    """Sum of log p(continuation token | everything before it), by transformers; the prompt
    tokenized as a prompt (BOS first), the continuation as plain text that follows it."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    scores = []
    with torch.no_grad():
        for prompt, cont in pairs:
            p_ids = tokenizer.encode(prompt).ids
            c_ids = tokenizer.encode(cont, add_special_tokens=False).ids
            assert p_ids[0] != c_ids[0]  # the tokenizer adds a BOS to the prompt only
            logprobs = torch.log_softmax(model(torch.tensor([p_ids + c_ids])).logits[0], -1)
            n = len(p_ids)
            scores.append(sum(float(logprobs[n + i - 1, t]) for i, t in enumerate(c_ids)))
    return scores


@pytest.mark.slow
def test_text_scores_match_transformers(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, block_size=8, warmup=False)
    prompts, conts = zip(*PAIRS, strict=True)
    ours = llm.score(list(prompts), list(conts))
    assert ours == pytest.approx(_hf_scores(checkpoint, PAIRS), abs=2e-3)
    # Token ids give the same scores as text.
    tokenizer = llm.get_tokenizer()
    ids = llm.score(
        [tokenizer.encode(p).ids for p in prompts],
        [tokenizer.encode(c, add_special_tokens=False).ids for c in conts],
    )
    assert ids == pytest.approx(ours, abs=1e-5)
    assert_nothing_held(llm.engine)


@pytest.mark.slow
def test_tokenizer_argument_is_used(checkpoint, tmp_path):
    bare = write_tiny_hf_checkpoint(tmp_path / "bare", "llama", seed=3, with_tokenizer=False)
    without = LLM(str(bare), num_kv_blocks=16, block_size=8, warmup=False)
    with pytest.raises(ValueError, match="has no tokenizer"):
        without.generate("Hello", use_tqdm=False)
    llm = LLM(str(bare), tokenizer=str(checkpoint), num_kv_blocks=16, block_size=8, warmup=False)
    (out,) = llm.generate("Hello", use_tqdm=False)
    expected = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode("Hello").ids
    assert out.prompt_token_ids == expected
    with pytest.raises(FileNotFoundError, match="tokenizer='/no/such/folder': no such folder"):
        LLM(str(bare), tokenizer="/no/such/folder")
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        LLM(str(bare), tokenizer=str(bare))
    with pytest.raises(TypeError, match="ModelConfig.tokenizer must be a folder path"):
        LLM(str(bare), tokenizer=3)
