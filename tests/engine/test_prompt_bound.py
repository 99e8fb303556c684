"""The early length check (engine/prompt_bound.py) refuses only prompts that cannot fit: every
text it refuses tokenizes to more than max_model_len tokens, and a tokenizer whose unknown token
can stand for any length of text gets no bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxserve.checkpoints_tools import build_tiny_tokenizer
from jaxserve.engine.prompt_bound import NORMALIZER_SLACK, check_text_length, max_token_chars

TINY = build_tiny_tokenizer()


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8"), max_size=400),
    max_model_len=st.integers(1, 40),
)
def test_a_refused_text_never_fits(text, max_model_len):
    bound = max_token_chars(TINY)
    assert bound is not None
    try:
        check_text_length(text, max_model_len, bound)
    except ValueError as e:
        assert len(TINY.encode(text).ids) > max_model_len
        assert f"max_model_len={max_model_len}" in str(e) and f"{len(text)} characters" in str(e)


def test_the_bound_is_the_longest_entry_times_the_slack():
    bound = max_token_chars(TINY)
    limit = 4 * bound * NORMALIZER_SLACK
    check_text_length("x" * limit, 4, bound)
    with pytest.raises(ValueError, match="refused before tokenizing"):
        check_text_length("x" * (limit + 1), 4, bound)


def _tokenizer(model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.mark.parametrize(
    ("model", "bounded"),
    [
        (models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"), False),
        (models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"), False),
        (models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True), False),
        (models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=False), True),
        (
            models.BPE(
                {"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True, byte_fallback=True
            ),
            True,
        ),
        (models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0), False),
        (models.Unigram([("a", -1.0), ("b", -1.0)]), True),
    ],
)
def test_an_unknown_token_that_covers_runs_leaves_no_bound(model, bounded):
    tok = _tokenizer(model)
    assert (max_token_chars(tok) is not None) == bounded
    if not bounded:
        # One token for a word of any length: the check must let it through.
        assert len(tok.encode("z" * 1000).ids) == 1
        check_text_length("z" * 10**6, 1, max_token_chars(tok))
