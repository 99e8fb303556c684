"""Logits parity with Hugging Face transformers, per family, through the paged KV cache.

Each case writes a tiny random checkpoint with transformers, loads it with load_hf_checkpoint
and compares float32 logits at every position with transformers' (eager attention):
  (a) one sequence prefilled in one call, its pages shuffled and non-contiguous;
  (b) the same sequence in two prefill chunks then two decodes, sharing each step with a
      second sequence (its prefill starts mid-way: mixed prefill and decode rows), with padded
      tokens and padded sequence slots.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from paged_steps import Chunk, build_step

from jaxserve.checkpoints_tools import load_hf_checkpoint
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.models import get_model

BLOCK_SIZE = 4
NUM_PAGES = 16
NUM_TOKENS = 16  # padded T of every step
NUM_SEQS = 4  # padded R of every step
TABLE_WIDTH = 4  # B: pages a sequence may read (16 positions)
TOL = 1e-4  # float32 end to end; observed differences are ~1e-6

CASES = {
    "llama_rope_llama3": (
        "llama",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # wavelengths 6 .. 2e4 at H=16: some kept, some smoothed, the rest scaled.
                original_max_position_embeddings=64,
            )
        ),
    ),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_rope_linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral_sliding_window": ("mistral", dict(sliding_window=4)),
    "qwen2_qkv_bias": ("qwen2", {}),
    "qwen3_qk_norm_head_dim": ("qwen3", dict(head_dim=32)),  # D / N would be 16
    # The Gemmas' tiny settings (window 4, soft caps, local / global RoPE) are in
    # checkpoints_tools.testing.FAMILY_DEFAULTS.
    "gemma_geglu_tied": ("gemma", {}),
    "gemma2_softcap_local_global": ("gemma2", {}),
    "gemma3_local_global_rope": ("gemma3", {}),
    # Gemma3ForConditionalGeneration: its text tower, the vision tower's tensors left unread.
    "gemma3_multimodal_text_tower": ("gemma3_multimodal", {}),
    # MoE (4 experts, top-2): Mixtral renormalises its top-k; Qwen3-MoE does not by default,
    # and its layer 1 is dense (mlp_only_layers).
    "mixtral_moe": ("mixtral", {}),
    "qwen3_moe_dense_layer": ("qwen3_moe", {}),
    # Phi-3's fused projections and LongRoPE (original context 8): the long factors and the
    # attention factor, both sequences being longer than 8 ...
    "phi3_longrope_long": ("phi3", {}),
    # ... and the short factors: a model whose context is its original one (16 >= 13 tokens).
    "phi3_longrope_short": (
        "phi3",
        dict(max_position_embeddings=16, original_max_position_embeddings=16),
    ),
}

SEQ_A = [1, 57, 300, 12, 499, 8, 77, 123, 45, 256, 3, 99, 411]  # 13 tokens
SEQ_B = [1, 200, 5, 64, 310, 18, 7, 450, 222, 31]  # 10 tokens
TABLE_A = [9, 2, 14, 6]  # shuffled, non-contiguous; page 0 is the null page
TABLE_B = [11, 4, 13]


def _hf_logits(folder, seqs: dict[str, list[int]]) -> dict[str, np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        return {k: model(torch.tensor([ids])).logits[0].numpy() for k, ids in seqs.items()}


def _run_steps(model, params, steps: list[list[Chunk]]) -> dict[tuple[str, int], np.ndarray]:
    """Run each step through the jitted forward; logits of every real row by (seq, position)."""
    shape = model.kv_cache_shape(NUM_PAGES, BLOCK_SIZE)
    kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))] * model.arch.num_layers
    kv = jax.device_put(kv)
    forward = _jitted_forward(model)
    out = {}
    for chunks in steps:
        step = build_step(
            chunks,
            block_size=BLOCK_SIZE,
            num_tokens=NUM_TOKENS,
            num_seqs=NUM_SEQS,
            table_width=TABLE_WIDTH,
        )
        kv, hidden = forward(params, kv, step.input_ids, step.md)
        logits = np.asarray(model.compute_logits(params, hidden[: len(step.rows)]))
        out.update(zip(step.rows, logits, strict=True))
    return out


@functools.cache
def _jitted_forward(model):
    return jax.jit(model.forward, donate_argnums=1)  # one compile per model: all steps share T, R


def _max_diff(ours: dict[tuple[str, int], np.ndarray], ref: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(v - ref[name][pos]).max()) for (name, pos), v in ours.items())


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    folder = write_tiny_hf_checkpoint(
        tmp_path_factory.mktemp(request.param), family, with_tokenizer=False, **overrides
    )
    ref = _hf_logits(folder, {"a": SEQ_A, "b": SEQ_B})
    ckpt = load_hf_checkpoint(folder, dtype="float32")
    return ckpt, get_model(ckpt.arch, dtype=ckpt.dtype), ref


def test_single_prefill_matches_transformers(case) -> None:
    ckpt, model, ref = case
    a = Chunk("a", SEQ_A, TABLE_A, 0, len(SEQ_A))
    ours = _run_steps(model, ckpt.params, [[a]])
    assert sorted(ours) == [("a", p) for p in range(len(SEQ_A))]
    assert _max_diff(ours, ref) < TOL


def test_chunked_prefill_decode_mixed_batch_matches_transformers(case) -> None:
    ckpt, model, ref = case
    a = lambda start, stop: Chunk("a", SEQ_A, TABLE_A, start, stop)
    b = lambda start, stop: Chunk("b", SEQ_B, TABLE_B, start, stop)
    steps = [
        [a(0, 5)],  # A: first prefill chunk alone
        [a(5, 11), b(0, 7)],  # A: second chunk; B: prefill starts
        [b(7, 9), a(11, 12)],  # B: last prefill chunk; A: decode (slot order swapped)
        [a(12, 13), b(9, 10)],  # both decode
    ]
    ours = _run_steps(model, ckpt.params, steps)
    expected = [("a", p) for p in range(len(SEQ_A))] + [("b", p) for p in range(len(SEQ_B))]
    assert sorted(ours) == sorted(expected)
    assert _max_diff(ours, ref) < TOL


@pytest.mark.parametrize("case", ["mistral_sliding_window"], indirect=True)
def test_sliding_window_changes_logits(case) -> None:
    """Mistral's window is smaller than the sequence: positions past it must differ from full
    attention, or the parity above would not prove the window is honoured."""
    ckpt, model, ref = case
    assert model.arch.sliding_window == 4
    full = get_model(dataclasses.replace(ckpt.arch, sliding_window=None), dtype=ckpt.dtype)
    ours = _run_steps(full, ckpt.params, [[Chunk("a", SEQ_A, TABLE_A, 0, len(SEQ_A))]])
    late = {k: v for k, v in ours.items() if k[1] >= model.arch.sliding_window}
    assert _max_diff(late, ref) > 1e-3


# Each Gemma feature the parity above exercises, turned off: the logits must move, or parity
# would not prove the feature is honoured.
GEMMA_FEATURES_OFF = {
    "gemma2_softcap_local_global": [
        dict(attn_logit_softcap=None),
        dict(final_logit_softcap=None),
        dict(layer_types=("full_attention", "full_attention")),  # the local layer's window
    ],
    "gemma3_local_global_rope": [dict(local_rope_theta=None), dict(rope_scaling=None)],
}


@pytest.mark.parametrize("case", sorted(GEMMA_FEATURES_OFF), indirect=True)
def test_gemma_features_change_logits(case, request) -> None:
    ckpt, _, ref = case
    a = [Chunk("a", SEQ_A, TABLE_A, 0, len(SEQ_A))]
    for off in GEMMA_FEATURES_OFF[request.node.callspec.params["case"]]:
        model = get_model(dataclasses.replace(ckpt.arch, **off), dtype=ckpt.dtype)
        assert _max_diff(_run_steps(model, ckpt.params, [a]), ref) > 1e-2, off


@pytest.mark.parametrize("case", ["gemma3_multimodal_text_tower"], indirect=True)
def test_text_tower_loads_from_either_transformers_layout(case, tmp_path) -> None:
    """transformers 4.52 - 4.x saved the multimodal Gemma 3 as model.language_model.* and
    model.vision_tower.*; 5.x (written above) and the Hub's originals as language_model.model.*
    and vision_tower.*. Both load into the same params."""
    ckpt, _, _ = case
    folder = pathlib.Path(ckpt.path)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    moved = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    renamed = {}
    for name, value in tensors.items():
        old = next(p for p in moved if name.startswith(p))
        renamed[moved[old] + name.removeprefix(old)] = value
    assert any(n.startswith("model.vision_tower.") for n in renamed)
    safetensors.numpy.save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    other = load_hf_checkpoint(tmp_path, dtype="float32")
    assert other.arch == ckpt.arch and other.arch.architecture == "Gemma3ForConditionalGeneration"
    same = jax.tree_util.tree_map(np.array_equal, other.params, ckpt.params)
    assert all(jax.tree_util.tree_leaves(same))
