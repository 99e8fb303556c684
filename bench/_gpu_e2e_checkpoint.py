"""bench/gpu_e2e.py's checkpoint: random bf16 weights in Hugging Face layout (config.json, sharded
safetensors + index), written directly with numpy once into the cache and reused while its marker
matches the config.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
from _gpu_e2e_presets import Preset

MARKER = "bench_checkpoint.json"  # written last: the checkpoint is complete


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint with this config, HF names and [out, in] layouts."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    n, k = cfg["num_attention_heads"] * h, cfg["num_key_value_heads"] * h
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (n, d)),
            (p + "self_attn.k_proj.weight", (k, d)),
            (p + "self_attn.v_proj.weight", (k, d)),
            (p + "self_attn.o_proj.weight", (d, n)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
        ]
    out.append(("model.norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, d)))
    return out


def bf16_pool(num: int, std: float, seed: int) -> np.ndarray:
    """``num`` normal(0, std) values as bfloat16 bit patterns (uint16): the top half of each
    float32, rounded to nearest even."""
    x = np.random.default_rng(seed).standard_normal(num, dtype=np.float32) * np.float32(std)
    bits = x.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


_BF16_ONE = 0x3F80


class _TensorSource:
    """The bytes of each tensor: norms all ones, the rest a window of one random pool (an odd
    length, so rows never repeat in step), starting at a per-tensor offset."""

    def __init__(self, std: float, seed: int, pool_size: int) -> None:
        self.pool = bf16_pool(pool_size | 1, std, seed)
        self.rng = np.random.default_rng(seed + 1)

    def write(self, f, name: str, numel: int) -> None:
        if name.endswith("norm.weight"):
            f.write(np.full(numel, _BF16_ONE, np.uint16).tobytes())
            return
        size = len(self.pool)
        pos = int(self.rng.integers(size))
        left = numel
        while left:
            n = min(left, size - pos)
            f.write(memoryview(self.pool[pos : pos + n]))
            left -= n
            pos = 0


def _shards(tensors: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    return shards


def _write_safetensors(path: Path, tensors: list, source: _TensorSource) -> int:
    """One safetensors file of bf16 tensors (header, then the data in header order)."""
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors:
            source.write(f, name, math.prod(shape))
    return offset


def checkpoint_folder(cache: Path, preset: Preset, cfg: dict) -> Path:
    return cache / f"{preset.name}-L{cfg['num_hidden_layers']}"


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(folder: Path) -> None:
    """Free the disk before writing: a checkpoint of another config in ``folder``, and staging
    folders left by writers that were killed."""
    if folder.exists():
        shutil.rmtree(folder)
    for staging in folder.parent.glob(f".{folder.name}.partial-*"):
        pid = staging.name.rsplit("-", 1)[1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def ensure_checkpoint(folder: Path, cfg: dict, preset: Preset, seed: int = 0) -> dict:
    """The checkpoint in ``folder``: reused when its marker matches ``cfg``, else written
    (staged in a sibling folder, renamed when complete). Returns what the JSON records."""
    marker = read_marker(folder)
    if marker is not None and marker.get("config") == cfg:
        return dict(marker.get("written", {}), reused=True, path=str(folder))
    tensors = tensor_shapes(cfg)
    total = sum(2 * math.prod(s) for _, s in tensors)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    free = shutil.disk_usage(folder.parent).free
    if free < total * 1.05 + (64 << 20):
        raise RuntimeError(
            f"not enough disk space for the checkpoint in {folder.parent}: {total / 1e9:.1f} GB "
            f"needed, {free / 1e9:.1f} GB free (set --cache elsewhere)"
        )
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    t0 = time.perf_counter()
    largest = max(math.prod(s) for _, s in tensors)
    source = _TensorSource(cfg.get("initializer_range", 0.02), seed, min(largest, 1 << 25))
    pool_s = time.perf_counter() - t0
    shards = _shards(tensors, preset.shard_bytes)
    if len(shards) == 1:
        _write_safetensors(staging / "model.safetensors", shards[0], source)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(staging / name, shard, source)
            weight_map.update({t: name for t, _ in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (staging / "config.json").write_text(json.dumps(cfg, indent=1))
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=1))
    write_s = time.perf_counter() - t0
    written = dict(
        write_s=write_s,
        random_pool_s=pool_s,
        bytes=total,
        write_Bps=total / write_s,
        num_files=len(shards),
        num_params=total // 2,
    )
    (staging / MARKER).write_text(json.dumps({"config": cfg, "written": written}, indent=1))
    staging.rename(folder)
    return dict(written, reused=False, path=str(folder))
