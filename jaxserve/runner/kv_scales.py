"""The per-layer scales of an FP8 KV cache: the checkpoint's, else computed, else 1.0.

    scales f32[L, 2]    scales[i] = (k_scale, v_scale) of layer i: its pages hold K / k_scale
                        and V / v_scale (pallas_kernels/ragged_paged_attention/kv_quant.py)

Source, in order:

1. The checkpoint's own tensors, as llm-compressor and vLLM name them:
   ``model.layers.{i}.self_attn.k_scale`` and ``model.layers.{i}.self_attn.v_scale`` (f32
   scalars, shape () or [1]) in the folder's ``*.safetensors``. Read here, apart from the
   weight loader, with safetensors' own reader: a few scalars, no device.
2. Computed from the data (CacheConfig.calculate_kv_scales, the default): one calibration
   forward pass when the engine is built, each layer's largest |K| and |V| mapped well inside
   the FP8 range (runner/kv_calibration.py, vLLM's rule on a fixed prompt).
3. 1.0 for every layer (calculate_kv_scales=False; vLLM's default when a checkpoint has none):
   the cast saturates at the FP8 dtype's largest finite value (448 for e4m3, 57344 for e5m2),
   so K / V entries beyond that are clipped, and entries below 2^-6 (e4m3) are subnormal.

The scales are host numpy, sent with every step's AttentionMetadata (tiny, and so replicated
under tensor parallelism like the rest of the metadata); they never change during the
engine's life, and they are not per block: a block copied or moved elsewhere keeps its meaning.
"""

from __future__ import annotations

import logging
import math
import pathlib
import re
from collections.abc import Callable

import numpy as np

logger = logging.getLogger("jaxserve")

_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def read_kv_scales(folder: str | pathlib.Path, num_layers: int) -> np.ndarray | None:
    """f32[L, 2] (k_scale, v_scale) per layer from the folder's safetensors files, or None
    when they hold no such tensor.

    Raises:
        ValueError: a scale tensor that is not one finite value > 0, a layer index >= L, or
            scales for some layers (or only K or only V) but not all; the tensor and file named.
    """
    from safetensors import safe_open

    found: dict[tuple[int, int], float] = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                match = _SCALE_NAME.fullmatch(name)
                if match is None:
                    continue
                layer, which = int(match[1]), "kv".index(match[2])
                value = np.asarray(f.get_tensor(name), np.float32)
                where = f"tensor {name!r} in {file}"
                if layer >= num_layers:
                    raise ValueError(f"{where}: layer {layer} >= the model's {num_layers} layers")
                if value.size != 1 or not math.isfinite(float(value.reshape(-1)[0])):
                    raise ValueError(f"{where} must be one finite value, got shape {value.shape}")
                if float(value.reshape(-1)[0]) <= 0:
                    raise ValueError(f"{where} must be > 0, got {float(value.reshape(-1)[0])}")
                found[layer, which] = float(value.reshape(-1)[0])
    if not found:
        return None
    missing = [
        f"model.layers.{i}.self_attn.{'kv'[j]}_scale"
        for i in range(num_layers)
        for j in range(2)
        if (i, j) not in found
    ]
    if missing:
        raise ValueError(
            f"{folder}: the checkpoint has KV scales for some layers but not {missing[0]} "
            f"({len(missing)} missing in all)"
        )
    scales = np.ones((num_layers, 2), np.float32)
    for (layer, which), value in found.items():
        scales[layer, which] = value
    return scales


def kv_scales_for(
    kv_cache_dtype: str,
    folder: str | None,
    num_layers: int,
    calculate: Callable[[], np.ndarray] | None = None,
) -> np.ndarray | None:
    """The engine's f32[L, 2] scales for a KV cache stored in `kv_cache_dtype` (a dtype name):
    None unless it is FP8; the checkpoint folder's (None: a built-in model) when it has them,
    else ``calculate()`` (kv_calibration.calculate_kv_scales) when given, else ones (logged).

    Raises:
        ValueError: as read_kv_scales.
    """
    if not kv_cache_dtype.startswith("float8"):
        return None
    scales = None if folder is None else read_kv_scales(folder, num_layers)
    if scales is None and calculate is not None:
        return calculate()
    if scales is None:
        logger.info(
            "FP8 KV cache (%s): the checkpoint has no k_scale / v_scale tensors and "
            "calculate_kv_scales is off; using 1.0",
            kv_cache_dtype,
        )
        return np.ones((num_layers, 2), np.float32)
    logger.info(
        "FP8 KV cache (%s): the checkpoint's scales, k_scale %.4g..%.4g, v_scale %.4g..%.4g",
        kv_cache_dtype,
        scales[:, 0].min(),
        scales[:, 0].max(),
        scales[:, 1].min(),
        scales[:, 1].max(),
    )
    return scales
