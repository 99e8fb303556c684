"""The shape contract between a step's logits and its SamplingMetadata, checked when the
sampler is traced (sampler.sample): each field's shape, in the step's dimensions (R rows, the
list widths W, B, NB, the bitmask words M), and its dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.sampling_metadata import SamplingMetadata

_FIELD_SPECS = {  # field -> (shape: R rows, 2 seed words, W / B list widths; dtype)
    "temperature": (("R",), jnp.float32),
    "top_k": (("R",), jnp.int32),
    "top_p": (("R",), jnp.float32),
    "min_p": (("R",), jnp.float32),
    "presence_penalty": (("R",), jnp.float32),
    "frequency_penalty": (("R",), jnp.float32),
    "repetition_penalty": (("R",), jnp.float32),
    "seeds": (("R", 2), jnp.uint32),
    "output_pos": (("R",), jnp.int32),
    "num_logprobs": (("R",), jnp.int32),
    "penalty_token_ids": (("R", "W"), jnp.int32),
    "penalty_output_counts": (("R", "W"), jnp.int32),
    "banned_token_ids": (("R", "B"), jnp.int32),
    "token_bitmask": (("R", "M"), jnp.uint32),
    "bias_token_ids": (("R", "NB"), jnp.int32),
    "bias_values": (("R", "NB"), jnp.float32),
}


def check_metadata(logits: jax.Array, md: SamplingMetadata) -> None:
    """Raises ValueError naming the SamplingMetadata field whose shape or dtype does not fit
    ``logits`` (f32[R, V]). Shapes are static: this runs once per trace, nothing per step."""
    if logits.ndim != 2:
        raise ValueError(f"sample: logits must be [R, V], got shape {tuple(logits.shape)}")
    sizes: dict[str | int, int] = {"R": logits.shape[0], 2: 2}
    for name, dim in (
        ("penalty_token_ids", "W"),
        ("banned_token_ids", "B"),
        ("token_bitmask", "M"),
        ("bias_token_ids", "NB"),
    ):
        shape = np.shape(getattr(md, name))
        sizes[dim] = shape[1] if len(shape) == 2 else -1
    for name, (dims, dtype) in _FIELD_SPECS.items():
        value = getattr(md, name)
        want = tuple(sizes[d] for d in dims)
        shape, got = tuple(np.shape(value)), jnp.result_type(value)
        if shape != want or got != dtype:
            spec = "[" + ", ".join(f"{d}={sizes[d]}" if d != 2 else "2" for d in dims)
            raise ValueError(
                f"SamplingMetadata.{name} must be {jnp.dtype(dtype).name}{spec}] for logits of "
                f"shape {tuple(logits.shape)}, got {jnp.dtype(got).name}{list(shape)}"
            )
