"""The built-in demo model "tiny-random-llama": a small Llama with fixed-seed random weights and a
byte-level BPE tokenizer trained in memory. No file, no download; the same bits every time."""

from __future__ import annotations

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxserve.checkpoints_tools.checkpoint import (
    LoadedCheckpoint,
    ParamSharding,
    place,
    resolve_dtype,
)
from jaxserve.checkpoints_tools.tiny_corpus import TINY_CORPUS
from jaxserve.checkpoints_tools.tokenizer import TokenizerInfo
from jaxserve.models import ModelArchConfig, get_model

TINY_RANDOM_LLAMA = "tiny-random-llama"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 (the Llama convention for bos/eos)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TINY_VOCAB_SIZE = 1024
_SEED = 0

# A minimal chat template (Jinja, as in tokenizer_config.json) so chat() works on the demo.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE trained on TINY_CORPUS: deterministic, any unicode text round-trips.

    Ids 0, 1, 2 are <pad>, <s>, </s>; encode() prepends <s>. The vocabulary has exactly
    `vocab_size` entries when the corpus yields enough merges (it does for 1024).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so every string encodes, not only the corpus's characters.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def tiny_random_llama_arch(vocab_size: int = TINY_VOCAB_SIZE) -> ModelArchConfig:
    """The demo architecture: D 128, L 4, N 4, K 2, H 32, F 256, 2048 positions."""
    return ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        # Large enough that the greedy argmax changes from step to step (varied demo text).
        initializer_range=0.1,
    )


def tiny_tokenizer_info(tokenizer: Tokenizer | None = None) -> TokenizerInfo:
    """The demo model's tokenizer facts (``tokenizer``: build_tiny_tokenizer()'s, built when
    None), as make_tiny_random_llama gives them."""
    return TokenizerInfo(
        tokenizer=build_tiny_tokenizer() if tokenizer is None else tokenizer,
        chat_template=TINY_CHAT_TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
        eos_token_ids=frozenset((EOS_ID,)),
    )


def make_tiny_random_llama(
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
    quantization: str | None = None,
) -> LoadedCheckpoint:
    """Build the demo model in memory. Same params and tokenizer on every call.

    dtype: as for load_hf_checkpoint ("auto" = float32).
    quantization: None, "int8" or "fp8": the same random weights, their linears quantized
        (CausalLM.init_params).
    """
    np_dtype = resolve_dtype(dtype)
    tokenizer = build_tiny_tokenizer()
    arch = tiny_random_llama_arch(tokenizer.get_vocab_size())
    model = get_model(arch, dtype=np_dtype, quantization=quantization)
    params = model.init_params(jax.random.key(_SEED))
    if param_sharding is not None:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: place(x, tuple(k.key for k in path), param_sharding), params
        )
    return LoadedCheckpoint(
        arch=arch,
        params=params,
        dtype=np.dtype(np_dtype),
        eos_token_ids=frozenset(arch.eos_token_ids),
        max_position_embeddings=arch.max_position_embeddings,
        tokenizer=tiny_tokenizer_info(tokenizer),
        generation_config={"bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
        path=None,
        quantization=quantization,
    )
