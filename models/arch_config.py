"""ModelArchConfig: the architecture of one decoder-only model, independent of any file format.

The supported families (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Mixtral,
Qwen3-MoE, Phi-3) share one decoder and differ only in the fields below; models/hf_configs/
builds this config from a Hugging Face config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    # Phi-3 LongRoPE: per-frequency divisors (H / 2 each) for contexts up to the original
    # length (short) and beyond it (long); attention_factor scales cos and sin (resolved by the
    # registry from factor or max_position_embeddings / original_max_position_embeddings).
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "attention_factor",
    ),
}
# Keys of ROPE_SCALING_KEYS whose values are lists of numbers (canonical: tuples of floats).
ROPE_LIST_KEYS = ("short_factor", "long_factor")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # gated MLP activations (SwiGLU, GeGLU)
# Attention kinds of ModelArchConfig.layer_types (HF's spelling).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


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


def _positive_floats(name: str, value: object) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {value!r}")
    for v in value:
        _check_positive_float(name, v)
    return tuple(float(v) for v in value)


def normalize_rope_scaling(rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the canonical form of a rope-scaling dict, or None for plain RoPE.

    Accepts the HF spellings ("type" or "rope_type"; "default" meaning none; "rope_theta" may
    ride along, as in transformers 5's rope_parameters). The result holds "type" plus exactly
    the keys of ROPE_SCALING_KEYS[type], as floats (the original context length as an int, the
    LongRoPE factor lists as tuples of floats).

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
        if key in ROPE_LIST_KEYS:
            out[key] = _positive_floats(f"rope_scaling[{key!r}]", value)
            continue
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
    (full attention) or >= 1 tokens, a query at position p seeing keys at p - window + 1 .. p;
    layer_types is empty (every layer alike) or names each layer's kind, and a sliding layer
    needs a sliding_window; soft caps, query_pre_attn_scalar and local_rope_theta are None or
    finite and > 0.
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
    # Gemma family (Gemma, Gemma 2, Gemma 3); the defaults are the Llama behaviour.
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + w) in float32 (params init at 0)
    scale_embeddings: bool = False  # embeddings x sqrt(D), the factor rounded to the model dtype
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # sm_scale = this ** -0.5; None: head_dim
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # f32 logits -> cap * tanh(logits / cap)
    # Per-layer attention kinds (FULL_ATTENTION / SLIDING_ATTENTION), length L; empty: every
    # layer attends within sliding_window (all of the context when that is None).
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    # Mixture of experts (Mixtral, Qwen3-MoE; models/moe.py). The MLP of each layer in
    # moe_layers routes every token to num_experts_per_tok of num_experts SwiGLU experts of
    # width moe_intermediate_size; the other layers keep the dense MLP (intermediate_size).
    # num_experts == 0: a dense model, and the other MoE fields keep their defaults.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # top-k experts per token, 1 <= k <= E
    moe_intermediate_size: int = 0  # F of each expert
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum 1 (Mixtral: True)
    moe_layers: tuple[int, ...] = ()  # sorted indices (< L) of the layers whose MLP is MoE

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
        self._check_gemma_fields()
        self._check_moe_fields()
        self._check_longrope()

    def _check_gemma_fields(self) -> None:
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
            "local_rope_theta",
        ):
            if getattr(self, name) is not None:
                _check_positive_float(name, getattr(self, name))
        types = self.layer_types
        if not isinstance(types, tuple) or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"ModelArchConfig.layer_types must be a tuple of {LAYER_TYPES}, got {types!r}"
            )
        if types and len(types) != self.num_layers:
            raise ValueError(
                f"ModelArchConfig.layer_types must name all {self.num_layers} layers, "
                f"got {len(types)}"
            )
        if SLIDING_ATTENTION in types and self.sliding_window is None:
            raise ValueError("ModelArchConfig.layer_types has sliding layers but no sliding_window")
        if self.local_rope_theta is not None and SLIDING_ATTENTION not in types:
            raise ValueError(
                "ModelArchConfig.local_rope_theta is set but layer_types has no sliding layer"
            )

    def _check_moe_fields(self) -> None:
        if self.num_experts == 0:
            if (
                self.num_experts_per_tok,
                self.moe_intermediate_size,
                self.norm_topk_prob,
                self.moe_layers,
            ) != (0, 0, False, ()):
                raise ValueError(
                    "ModelArchConfig MoE fields (num_experts_per_tok, moe_intermediate_size, "
                    "norm_topk_prob, moe_layers) are set but num_experts is 0"
                )
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _check_positive_int(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"ModelArchConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        layers = self.moe_layers
        if (
            not isinstance(layers, tuple)
            or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
            or list(layers) != sorted(set(layers))
            or any(not 0 <= i < self.num_layers for i in layers)
        ):
            raise ValueError(
                f"ModelArchConfig.moe_layers must be a sorted tuple of distinct layer indices "
                f"in [0, {self.num_layers}), got {layers!r}"
            )

    def _check_longrope(self) -> None:
        scaling = self.rope_scaling
        if scaling is None or scaling["type"] != "longrope":
            return
        for key in ROPE_LIST_KEYS:
            if len(scaling[key]) != self.head_dim // 2:
                raise ValueError(
                    f"ModelArchConfig.rope_scaling[{key!r}] must hold head_dim / 2 = "
                    f"{self.head_dim // 2} factors, got {len(scaling[key])}"
                )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts (models/moe.py)."""
        return layer in self.moe_layers

    @property
    def rope_attention_factor(self) -> float:
        """LongRoPE's scale of cos and sin (1 otherwise). It multiplies q and k after RoPE, so
        the attention scores by its square: sm_scale carries that instead of the tables."""
        scaling = self.rope_scaling
        if scaling is None or scaling["type"] != "longrope":
            return 1.0
        return scaling["attention_factor"]

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

    @property
    def sm_scale(self) -> float:
        """The attention scores' scale: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5,
        times rope_attention_factor ** 2 (LongRoPE)."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        return scale * self.rope_attention_factor**2

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within sliding_window (only its last tokens)."""
        if self.layer_types:
            return self.layer_types[layer] == SLIDING_ATTENTION
        return self.sliding_window is not None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None for full causal attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by the local RoPE (local_rope_theta, unscaled) rather
        than the global one (rope_theta with rope_scaling)."""
        return self.local_rope_theta is not None and self.is_sliding(layer)
