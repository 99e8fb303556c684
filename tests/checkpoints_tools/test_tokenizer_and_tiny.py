"""load_tokenizer (tokenizer.json, tokenizer_config.json, EOS ids) and the built-in
tiny-random-llama demo model."""

from __future__ import annotations

import json
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints_tools import (
    load_checkpoint,
    load_hf_checkpoint,
    load_tokenizer,
    make_tiny_random_llama,
)
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.models import AttentionMetadata, get_model

MULTIBYTE = "Grüße, naïve café — 日本語のテキスト 🙂👍🏽 Ωμέγα"


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("qwen2")
    return write_tiny_hf_checkpoint(folder, "qwen2", tie_word_embeddings=True)


def test_load_tokenizer_reads_specials_and_eos_union(qwen2_folder) -> None:
    gen_file = qwen2_folder / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen_file.write_text(json.dumps(gen | {"eos_token_id": [2, 7]}))
    info = load_tokenizer(qwen2_folder)
    assert info.tokenizer is not None and info.bos_token == "<s>" and info.eos_token == "</s>"
    assert "add_generation_prompt" in info.chat_template
    assert info.eos_token_ids == frozenset({2, 7})  # config.json's 2 and generation_config's list
    ids = info.tokenizer.encode(MULTIBYTE).ids
    assert info.tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE
    ckpt = load_hf_checkpoint(qwen2_folder)
    assert ckpt.eos_token_ids == frozenset({2, 7}) and ckpt.tokenizer.tokenizer is not None
    assert ckpt.arch.tie_word_embeddings and "lm_head" not in ckpt.params


def test_no_tokenizer_files_is_fine(tmp_path) -> None:
    folder = write_tiny_hf_checkpoint(tmp_path, "mistral", with_tokenizer=False, eos_token_id=5)
    info = load_tokenizer(folder)
    assert info.tokenizer is None and info.chat_template is None
    assert info.eos_token_ids == frozenset({5})
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(folder)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_random_llama()


def test_tiny_random_llama_is_deterministic(tiny) -> None:
    again = make_tiny_random_llama()
    assert tiny.arch == again.arch
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, tiny.params, again.params))
    assert tiny.tokenizer.tokenizer.to_str() == again.tokenizer.tokenizer.to_str()
    assert tiny.arch.vocab_size == tiny.tokenizer.tokenizer.get_vocab_size() == 1024
    assert tiny.eos_token_ids == frozenset({2}) and tiny.max_position_embeddings == 2048


def test_tiny_tokenizer_round_trips_multibyte_text(tiny) -> None:
    tok = tiny.tokenizer.tokenizer
    enc = tok.encode(MULTIBYTE)
    assert enc.ids[0] == 1  # <s>
    assert all(0 <= i < tiny.arch.vocab_size for i in enc.ids)
    assert tok.decode(enc.ids, skip_special_tokens=True) == MULTIBYTE
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]


def test_tiny_greedy_predictions_vary(tiny) -> None:
    """Random weights with std 0.1 must not collapse onto one token (the demo prints text)."""
    ids = tiny.tokenizer.tokenizer.encode("The capital of France is a city").ids
    t = len(ids)
    model = get_model(tiny.arch, dtype=tiny.dtype)
    kv = [(jnp.zeros(model.kv_cache_shape(4, 16), tiny.dtype),) * 2] * tiny.arch.num_layers
    md = AttentionMetadata(
        positions=jnp.arange(t, dtype=jnp.int32),
        slot_mapping=jnp.arange(16, 16 + t, dtype=jnp.int32),  # page 1
        block_tables=jnp.array([[1]], jnp.int32),
        kv_lens=jnp.array([t], jnp.int32),
        cu_q_lens=jnp.array([0, t], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    _, hidden = jax.jit(model.forward)(tiny.params, kv, jnp.asarray(ids, jnp.int32), md)
    greedy = np.asarray(model.compute_logits(tiny.params, hidden).argmax(-1))
    assert len(set(greedy.tolist())) >= t // 2


def test_load_checkpoint_dispatch(qwen2_folder) -> None:
    assert load_checkpoint("tiny-random-llama", dtype="bfloat16").dtype == jnp.bfloat16
    assert load_checkpoint(qwen2_folder).arch.architecture == "Qwen2ForCausalLM"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint("no-such-model")
    with pytest.raises(ValueError, match="family"):
        write_tiny_hf_checkpoint(qwen2_folder / "x", "gpt2")


def test_a_sentencepiece_only_tokenizer_is_refused_at_load_naming_the_file(tmp_path) -> None:
    """tokenizer.model and no tokenizer.json used to load with no tokenizer and no word, and
    fail only at the first text prompt (issue 29, item 16)."""
    folder = write_tiny_hf_checkpoint(tmp_path / "sp", "llama", with_tokenizer=False)
    (folder / "tokenizer.model").write_bytes(b"\x0a\x0b sentencepiece model proto")
    with pytest.raises(ValueError, match=r"tokenizer\.model: a sentencepiece tokenizer") as err:
        load_hf_checkpoint(folder)
    assert "tokenizer.json" in str(err.value)
    with pytest.raises(ValueError, match=r"tokenizer\.model"):
        load_tokenizer(folder)


def test_tokenizer_model_next_to_tokenizer_json_is_left_alone(qwen2_folder, tmp_path) -> None:
    folder = tmp_path / "both"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((qwen2_folder / name).read_bytes())
    (folder / "tokenizer.model").write_bytes(b"unused")
    assert load_tokenizer(folder).tokenizer is not None


def test_an_eos_id_outside_the_vocabulary_is_warned_about_once(tmp_path, caplog) -> None:
    """Such an id can never be sampled, so no request stops on it (issue 29, item 17)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 40, 33]}))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        info = load_tokenizer(tmp_path)
    assert info.eos_token_ids == frozenset({2, 33, 40})  # kept: harmless
    (record,) = [r for r in caplog.records if "vocabulary" in r.getMessage()]
    message = record.getMessage()
    assert "generation_config.json eos_token_id=[33, 40]" in message
    assert "vocab_size=32" in message and "EOS stops on [2] only" in message
    assert "config.json eos_token_id=" not in message.replace("generation_config.json", "")
    caplog.clear()
    (tmp_path / "generation_config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        load_tokenizer(tmp_path)
    assert not caplog.records  # in the vocabulary: nothing to say
