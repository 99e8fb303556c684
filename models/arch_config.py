"""ModelArchConfig: the architecture of one decoder-only model, independent of any file format.

The four supported families (Llama, Mistral, Qwen2, Qwen3) share one decoder and differ only in
the fields below; models/registry.py builds this config from a Hugging Face config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}
HIDDEN_ACTS = ("silu",)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ModelArchConfig.{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"ModelArchConfig.{name} must be >= 1, got {value}")


def _check_positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"ModelArchConfig.{name} must be a finite number > 0, got {value!r}")


def normalize_rope_scaling(rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the canonical form of a rope-scaling dict, or None for plain RoPE.

    Accepts the HF spellings ("type" or "rope_type"; "default" meaning none; "rope_theta" may
    ride along, as in transformers 5's rope_parameters). The result holds "type" plus exactly
    the keys of ROPE_SCALING_KEYS[type], as floats (the original context length as an int).

    Raises:
        ValueError: an unsupported rope type (named), or a missing, invalid or unknown key.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {rope_scaling!r}")
    rope_type = rope_scaling.get("type", rope_scaling.get("rope_type"))
    if rope_type not in (None, "default", *ROPE_SCALING_KEYS):
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{sorted(ROPE_SCALING_KEYS)} or none"
        )
    # Keys we do not understand (e.g. partial_rotary_factor) would change the math: refuse.
    type_keys = ROPE_SCALING_KEYS.get(rope_type, ())
    unknown = set(rope_scaling) - {"type", "rope_type", "rope_theta", *type_keys}
    if unknown:
        raise ValueError(
            f"rope scaling of type {rope_type!r} has unsupported keys {sorted(unknown)}: "
            f"{rope_scaling}"
        )
    if rope_type in (None, "default"):
        return None
    out: dict[str, Any] = {"type": rope_type}
    for key in ROPE_SCALING_KEYS[rope_type]:
        if key not in rope_scaling:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}: {rope_scaling}")
        value = rope_scaling[key]
        _check_positive_float(f"rope_scaling[{key!r}]", value)
        if key == "original_max_position_embeddings" and value != int(value):
            # A token count: truncating 8192.5 would silently change the scaling.
            raise ValueError(f"rope_scaling[{key!r}] must be a whole number, got {value!r}")
        out[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(
            f"rope_scaling high_freq_factor must be > low_freq_factor, got {rope_scaling}"
        )
    return out


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters (glossary letters in brackets).

    Invariants (checked in __post_init__): every size >= 1; num_heads % num_kv_heads == 0;
    rope_scaling is None or canonical (see normalize_rope_scaling); sliding_window is None
    (full attention) or >= 1 tokens, a query at position p seeing keys at p - window + 1 .. p.
    """

    architecture: str  # HF `architectures[0]`, e.g. "LlamaForCausalLM"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N query heads
    num_kv_heads: int  # K (GQA: N % K == 0)
    head_dim: int  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # canonical; see normalize_rope_scaling
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # lm_head is embed.T
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3 when configured)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 `attention_bias`, not Qwen2)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm over H on q and k, before RoPE
    sliding_window: int | None = None  # Mistral; None = full causal attention
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    initializer_range: float = 0.02  # std of the random normal init (demo models, tests)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(
                f"ModelArchConfig.architecture must be a name, got {self.architecture!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArchConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArchConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            _check_positive_float(name, getattr(self, name))
        if normalize_rope_scaling(self.rope_scaling) != self.rope_scaling:
            raise ValueError(
                f"ModelArchConfig.rope_scaling must be canonical (normalize_rope_scaling), "
                f"got {self.rope_scaling!r}"
            )
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"ModelArchConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}"
            )
        if not isinstance(self.eos_token_ids, tuple):
            raise TypeError(
                f"ModelArchConfig.eos_token_ids must be a tuple, got {self.eos_token_ids!r}"
            )

    def __hash__(self) -> int:
        # rope_scaling is a dict; hash its items so the config can key jit caches.
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        values = tuple(getattr(self, f) for f in self.__dataclass_fields__ if f != "rope_scaling")
        return hash((values, scaling))

    @property
    def q_size(self) -> int:
        """N * H: width of the flattened query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """K * H: width of the flattened key (or value) projection."""
        return self.num_kv_heads * self.head_dim
