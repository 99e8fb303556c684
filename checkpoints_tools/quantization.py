"""8-bit weights in checkpoints: a config.json's `quantization_config`, and the tensors of the
quantized linears as the loader reads them (stored 8-bit, or quantized on load).

Two ways to get 8-bit weights (models/quant.py holds the format and the math):

  stored     an FP8 or int8 checkpoint, as llm-compressor writes them: each quantized linear
             `<linear>.weight` in F8_E4M3 or I8 [out, in] with `<linear>.weight_scale` f32
             (or bf16 / f16) of shape [] (per tensor) or [out] / [out, 1] (per channel).
             A MoE model's experts are such linears, one per expert and projection (Mixtral's
             `experts.<e>.w1` / `w2` / `w3`, Qwen3-MoE's `experts.<e>.gate_proj` / ...), their
             weights and scales stacked on load into experts_gate / experts_up / experts_down
             and experts_*_scale [E, out] (a per-tensor scale is spread over the channels).
             config.json declares it: {"quant_method": "fp8", "activation_scheme":
             "dynamic", "weight_block_size": null}, or {"quant_method": "compressed-tensors",
             "format": "float-quantized" | "naive-quantized" | "int-quantized",
             "config_groups": {...: {"weights": {"num_bits": 8, "type": "float" | "int",
             "strategy": "tensor" | "channel", "symmetric": true, ...}}}, "ignore": ["lm_head"]}.
  on load    a float checkpoint with LLM(quantization="int8" | "fp8"): each linear weight is
             read, converted to our layout and quantized per output channel on the host, one
             tensor at a time (quant.quantize_host), never the model upcast or held twice; a
             MoE expert's tensor is quantized alone and copied into its 8-bit stack's buffer.

What the engine cannot honour is refused with the config key and value named: block-wise scales
(weight_block_size, strategy "block" / "group"), other bit widths, asymmetric weights (zero
points), static activation scales (activation_scheme "static", input_activations with dynamic
false, input_scale tensors), output activation quantization, sparse formats and weight
transforms (sparsity_config, transform_config), other quant_methods. A decoder linear the
checkpoint kept in full precision (listed in `ignore`) is refused too: every layer's
projections and MoE experts are 8-bit or none are (an unquantized expert is named), and so is
an 8-bit MoE router (routers stay in the model dtype, as in vLLM). Which tensors are 8-bit is
read from the safetensors headers, so `ignore` itself is not parsed. Dynamic activation
quantization is run weight-only: activations stay in the model dtype (see models/quant.py),
which is at least as accurate. The LM head and the embedding are never quantized; a checkpoint
that stores them in 8 bits is refused.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.checkpoints_tools.hf_names import ParamPart, TensorSpec
from jaxserve.models import ModelArchConfig
from jaxserve.models.quant import (
    INPUT_AXES,
    SCALE_SUFFIX,
    check_quantizable,
    quantize_host,
    slice_input_axes,
)

logger = logging.getLogger("jaxserve")

# safetensors header dtype of each quantization's stored weights.
STORED_DTYPES = {"fp8": "F8_E4M3", "int8": "I8"}
SCALE_DTYPES = ("F32", "BF16", "F16")
WEIGHT_SCALE = "weight_scale"  # llm-compressor's name: `<linear>.weight_scale`
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized", "int-quantized")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a config.json's quantization_config declares, once checked.

    quantization: the engine's name of the weights' format, "fp8" or "int8".
    declared_by: where it is declared, for messages ("quantization_config.quant_method='fp8'",
        or a jaxserve Orbax folder's marker file).
    strategy: "tensor" or "channel" where the config says (the loader reads each scale's shape
        anyway); None for quant_method "fp8" (per tensor in practice) and Orbax folders.
    """

    quantization: str
    declared_by: str
    strategy: str | None = None


def _refuse(key: str, value: object, why: str) -> ValueError:
    return ValueError(f"quantization_config.{key}={value!r}: {why}")


def read_quantization_config(cfg: Mapping[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization from config.json (None: a float checkpoint).

    Raises:
        ValueError: a quantization the engine cannot honour (the key and value named).
        TypeError: quantization_config is not a JSON object.
    """
    qc = cfg.get("quantization_config", cfg.get("compression_config"))
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise TypeError(f"quantization_config must be a JSON object, got {qc!r}")
    if qc.get("kv_cache_scheme") is not None:
        logger.info(
            "quantization_config.kv_cache_scheme=%r: the checkpoint's k_scale / v_scale apply "
            "to an FP8 KV cache (kv_cache_dtype='fp8'); the weights load either way",
            qc["kv_cache_scheme"],
        )
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_config(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_config(qc)
    raise _refuse(
        "quant_method",
        method,
        "not supported; jaxserve loads 'fp8' and 'compressed-tensors' (8-bit float or int "
        "weights with per-tensor or per-channel scales)",
    )


def _fp8_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    if qc.get("weight_block_size") is not None:
        raise _refuse(
            "weight_block_size",
            qc["weight_block_size"],
            "block-wise FP8 scales are not implemented (per-tensor or per-channel only)",
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(
            "activation_scheme",
            scheme,
            "static activation scales are not implemented; only 'dynamic' (run weight-only: "
            "activations stay in the model dtype)",
        )
    return CheckpointQuantization("fp8", "quantization_config.quant_method='fp8'")


def _compressed_tensors_config(qc: Mapping[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise _refuse("format", fmt, f"not supported; jaxserve loads {COMPRESSED_FORMATS}")
    # Both change the math of the stored weights (sparse layouts, rotations to undo).
    sparsity = qc.get("sparsity_config")
    if sparsity is not None and (
        not isinstance(sparsity, Mapping) or sparsity.get("format") not in (None, "dense")
    ):
        raise _refuse("sparsity_config", sparsity, "sparse weight formats are not implemented")
    if qc.get("transform_config") is not None:
        raise _refuse(
            "transform_config", qc["transform_config"], "weight transforms are not implemented"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "expected a non-empty object of groups")
    schemes = {_group_scheme(f"config_groups.{name}", g) for name, g in groups.items()}
    if len(schemes) > 1:
        raise _refuse(
            "config_groups",
            sorted(schemes),
            "groups with different weight formats are not implemented (one 8-bit format only)",
        )
    quantization, strategy = schemes.pop()
    declared_by = "quantization_config.quant_method='compressed-tensors'"
    return CheckpointQuantization(quantization, declared_by, strategy)


def _group_scheme(key: str, group: object) -> tuple[str, str]:
    """(quantization, strategy) of one compressed-tensors config group, or a refusal."""
    if not isinstance(group, Mapping):
        raise _refuse(key, group, "expected an object")
    targets = group.get("targets")
    if not isinstance(targets, list) or not set(targets) <= {"Linear"}:
        raise _refuse(f"{key}.targets", targets, "only ['Linear'] is implemented")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise _refuse(f"{key}.weights", weights, "expected the weights' scheme (an object)")
    w = f"{key}.weights"
    expected = {"num_bits": 8, "symmetric": True, "dynamic": False}
    for name, value in expected.items():
        if weights.get(name, value) != value:
            raise _refuse(f"{w}.{name}", weights.get(name), f"only {value!r} is implemented")
    if weights.get("type") not in ("float", "int"):
        raise _refuse(f"{w}.type", weights.get("type"), "only 'float' and 'int' are implemented")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise _refuse(
            f"{w}.strategy", strategy, "only 'tensor' and 'channel' scales are implemented"
        )
    for name in ("group_size", "block_structure"):
        if weights.get(name) is not None:
            raise _refuse(f"{w}.{name}", weights[name], "grouped or block scales not implemented")
    acts = group.get("input_activations")
    if acts is not None and (not isinstance(acts, Mapping) or acts.get("dynamic") is not True):
        raise _refuse(
            f"{key}.input_activations",
            acts,
            "static activation scales are not implemented; only dynamic ones (run weight-only)",
        )
    if group.get("output_activations") is not None:
        raise _refuse(f"{key}.output_activations", group["output_activations"], "not implemented")
    return ("fp8" if weights["type"] == "float" else "int8"), strategy


def resolve_quantization(
    requested: str | None, declared: CheckpointQuantization | None, where: str
) -> str | None:
    """The quantization the engine runs: the checkpoint's own when it has one (None requested
    takes it, as vLLM does), else the requested one, quantized on load.

    Raises:
        ValueError: a request that differs from the checkpoint's own (both named), or an
            unknown value.
    """
    if declared is None:
        return requested
    if requested not in (None, declared.quantization):
        raise ValueError(
            f"quantization={requested!r} but {where} is a {declared.quantization} checkpoint "
            f"({declared.declared_by}); pass quantization={declared.quantization!r} or None "
            "(a checkpoint is not quantized again)"
        )
    return declared.quantization


def _is_quantized_linear(spec: TensorSpec) -> bool:
    kinds = {part.param_path[-1] in INPUT_AXES for part in spec.targets()}
    assert len(kinds) == 1, f"a fused tensor of quantized and plain params: {spec.param_path}"
    return kinds.pop()


@dataclass(frozen=True)
class QuantizedLoad:
    """How the loader gets the 8-bit linear weights of one checkpoint.

    quantization: "int8" or "fp8", the params' format (models/quant.py).
    stored: the checkpoint's own quantization (its weights and scales are read as they are),
        or None: its float weights are quantized on load.
    """

    quantization: str
    stored: CheckpointQuantization | None

    def linears(self, specs: Mapping[str, TensorSpec]) -> set[str]:
        """The HF tensors of `specs` that fill quantized linear weights (quant.INPUT_AXES)."""
        return {name for name, spec in specs.items() if _is_quantized_linear(spec)}

    def scale_names(self, specs: Mapping[str, TensorSpec]) -> dict[str, str]:
        """{weight tensor name: its scale tensor name} of the stored quantized linears."""
        if self.stored is None:
            return {}
        return {
            name: name.removesuffix("weight") + WEIGHT_SCALE
            for name in self.linears(specs)
            if name.endswith(".weight")
        }

    def check(
        self,
        arch: ModelArchConfig,
        specs: Mapping[str, TensorSpec],
        found: Mapping[str, Any],
    ) -> set[str]:
        """Check the 8-bit tensors' headers; return the weight tensors that are quantized
        linears (so the float-only check passes them over). `found` maps a name to an object
        with .file, .shape and .dtype (the safetensors header).

        Raises:
            ValueError: a quantized linear or MoE expert stored in another dtype (an expert
                or linear left in full precision), or a plain weight (LM head, embedding,
                norm, MoE router) stored in 8 bits; a missing or mis-shaped scale, or one in
                another dtype; input_scale tensors (static activation scales). Tensor, file
                and dtype named.
        """
        check_quantizable(arch, self.quantization)
        if self.stored is None:
            return self.linears(specs)
        static = sorted(n for n in found if n.endswith(".input_scale"))
        if static:
            raise ValueError(
                f"tensor {static[0]!r} in {found[static[0]].file}: static activation scales "
                "(input_scale) are not implemented; only dynamic activation schemes load"
            )
        want = STORED_DTYPES[self.quantization]
        quantized = set()
        for name, spec in specs.items():
            located = found.get(name)
            if located is None:
                continue  # reported as missing by the loader
            if not _is_quantized_linear(spec):
                if located.dtype.startswith(("F8_", "I8")):
                    raise ValueError(
                        f"tensor {name!r} in {located.file} has dtype {located.dtype}: jaxserve "
                        "keeps the LM head, embeddings, norms and routers in the model dtype "
                        "(list them in quantization_config's ignore)"
                    )
                continue
            if located.dtype != want:
                raise ValueError(
                    f"tensor {name!r} in {located.file} has dtype {located.dtype}, expected "
                    f"{want} ({self.quantization} checkpoint): every decoder linear and MoE "
                    "expert must be quantized (one kept in full precision by "
                    "quantization_config's ignore is not implemented)"
                )
            quantized.add(name)
        for name, scale in self.scale_names(specs).items():
            self._check_scale(scale, found, specs[name].hf_shape[0])
        return quantized

    def _check_scale(self, scale: str, found: Mapping[str, Any], out: int) -> None:
        located = found.get(scale)
        if located is None:
            raise ValueError(f"missing tensor {scale!r} (the scale of an 8-bit weight)")
        if located.dtype not in SCALE_DTYPES:
            raise ValueError(
                f"tensor {scale!r} in {located.file} has dtype {located.dtype}, expected one "
                f"of {SCALE_DTYPES}"
            )
        if located.shape not in ((), (1,), (out,), (out, 1)):
            raise ValueError(
                f"tensor {scale!r} in {located.file} has shape {located.shape}: only "
                f"per-tensor [] or per-channel [{out}] / [{out}, 1] scales are implemented "
                "(block-wise or grouped scales are not)"
            )

    def params(
        self, spec: TensorSpec, tensor: np.ndarray, scale: np.ndarray | None
    ) -> list[tuple[tuple[str, ...], np.ndarray]]:
        """(param path, host array) of every 8-bit weight and f32 scale this HF tensor fills.

        Args:
            tensor: the HF tensor as read ([out, in]; 8-bit when stored, else float).
            scale: its stored weight_scale ([], [out] or [out, 1]); None when quantizing.

        A MoE expert's tensor (spec.stack set) gives its slice of the stacked weight and of the
        stacked scale (one expert's [D, F] and [F], say), which the loader stacks.
        """
        out: list[tuple[tuple[str, ...], np.ndarray]] = []
        for part in spec.targets():
            name = part.param_path[-1]
            axes = INPUT_AXES[name] if spec.stack is None else slice_input_axes(name)
            scale_path = (*part.param_path[:-1], name + SCALE_SUFFIX)
            if scale is None:
                w, s = quantize_host(part.convert(tensor), axes, self.quantization)
            else:
                w, s = part.convert(tensor), _scale_in_layout(part, scale, tensor.shape, axes)
            out += [(part.param_path, w), (scale_path, s)]
        return out


def read_fp8_tensor(file: pathlib.Path, name: str) -> np.ndarray:
    """An F8_E4M3 tensor of a safetensors file as a float8_e4m3fn host array, copied from a
    memory map of its bytes (safetensors' numpy reader has no FP8 dtype: numpy itself has none,
    ml_dtypes adds it).

    Raises:
        ValueError: the header does not describe `name` as an F8_E4M3 tensor of its byte size.
    """
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length)).get(name, {})
    start, stop = entry.get("data_offsets", (0, -1))
    shape = tuple(entry.get("shape", ()))
    if entry.get("dtype") != STORED_DTYPES["fp8"] or stop - start != math.prod(shape):
        raise ValueError(f"{file}: tensor {name!r} is not an F8_E4M3 tensor of shape {shape}")
    raw = np.memmap(file, np.uint8, mode="r", offset=8 + length + start, shape=(stop - start,))
    return np.array(raw).view(ml_dtypes.float8_e4m3fn).reshape(shape)


def _scale_in_layout(
    part: ParamPart, scale: np.ndarray, hf_shape: tuple[int, ...], input_axes: tuple[int, ...]
) -> np.ndarray:
    """A stored scale in the param's output-axes layout: the per-row scale broadcast over the
    HF tensor's [out, in] (a view, no copy), converted as the weight is (rows cut, transposed,
    split into heads), then one element along the converted tensor's `input_axes`."""
    rows = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (hf_shape[0],))
    full = part.convert(np.broadcast_to(rows[:, None], hf_shape))
    index = tuple(0 if i in input_axes else slice(None) for i in range(full.ndim))
    return np.ascontiguousarray(full[index], dtype=np.float32)
