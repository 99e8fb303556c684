"""``jaxserve plan``: will a model fit, and how much KV cache will it get? From config.json alone.

    jaxserve plan --model meta-llama/Meta-Llama-3-8B --device-memory-gb 141 [--json]

Reads the model's config.json (a folder's, a Hub model's, fetching nothing else; the built-in
model's architecture) and prints, per device: the weight bytes, the KV bytes per token, the
step's workspace reserve, max_kv_tokens (the tokens the KV cache holds once the weights and the
workspace are placed within --gpu-memory-utilization of the device's memory), how many
sequences of max_model_len fit at once, and whether the model fits. The arithmetic is
runner/memory_plan.py's, the same the engine checks and sizes its pool with when LLM(...) is
built with the same settings, so the two agree.

The device memory is --device-memory-gb GiB (2^30 bytes) on a --platform (default gpu) that is
not consulted; without it the local device's (its allocator's bytes_limit; on the CPU the
engine's CPU budget, CacheConfig.cpu_memory_bytes). dtype "auto" resolves as the engine's plan
does on that platform (float32 checkpoints run in bfloat16 on GPU and TPU).

Exit status: 0 the model fits, 1 it does not (--json prints the object either way), 2 bad input
(a flag, a model that cannot be found or read).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from jaxserve.cli.flags import add_engine_flags, add_model_flag, engine_kwargs, fail
from jaxserve.config import EngineConfig, kv_cache_storage_dtype

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
MAX_DEVICE_GIB = 2**20  # 1 PiB: far above any one device, far below a float's overflow
PLATFORMS = ("cpu", "gpu", "tpu")
GIB = 1 << 30


class PlanInputError(ValueError):
    """Bad input to ``jaxserve plan``; the message names the flag and value."""


# The engine flags a plan reads (flags.ENGINE_FLAGS; EngineConfig.from_kwargs checks them).
PLAN_ENGINE_FLAGS = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "max_model_len",
    "block_size",
    "memory_utilization",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_kv_blocks",
    "revision",
    "download_dir",
    "kv_transfer_config",  # a JaxTransferConnector producer's pool leaves room for its offers
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve plan``."""
    p = subparsers.add_parser(
        "plan",
        help="will a model fit on a device, and how many KV tokens will it get (no weights read)",
        description="Plan a model's memory from its config.json alone: weights and KV bytes per "
        "device, the step's workspace, the KV tokens that fit, and whether it fits. Exit "
        "status: 0 fits, 1 does not fit, 2 bad input.",
    )
    p.set_defaults(run=run)
    add_model_flag(
        p,
        required=True,
        help="a built-in model name, a checkpoint folder or a Hugging Face Hub model ID "
        "(org/name: config.json only is fetched)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        metavar="GIB",
        help="memory of one device in GiB (2^30 bytes); default: the local device's (on the "
        "CPU, the engine's CPU budget, 4 GiB)",
    )
    p.add_argument(
        "--platform",
        choices=PLATFORMS,
        help="the platform dtype=auto resolves for, whose sampler the workspace reserves for "
        "(default: gpu with --device-memory-gb, else the local device's)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p, only=PLAN_ENGINE_FLAGS)


def run(args: argparse.Namespace) -> int:
    """Run ``jaxserve plan``: 0 fits, 1 does not fit, 2 bad input."""
    try:
        report = plan_report(args)
    except (OSError, TypeError, ValueError, RuntimeError) as e:
        return fail("plan", str(e))
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags (absent flags: the engine's defaults).

    Raises:
        TypeError / ValueError: a bad flag value (the field named).
    """
    return EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """The plan of the flags as one JSON-ready dict (MemoryPlan.as_dict() plus the model,
    platform, dtypes and where the device memory came from).

    Raises:
        PlanInputError / ValueError / TypeError: a bad flag value.
        OSError: the model cannot be found (FileNotFoundError naming what was tried).
        RuntimeError: the local device reports no memory limit (pass --device-memory-gb).
    """
    config = engine_config(args)
    device_bytes = _flag_device_bytes(args.device_memory_gb)
    from jaxserve.checkpoints_tools.hub import CONFIG_FILES
    from jaxserve.checkpoints_tools.load import (
        declared_dtype,
        declared_quantization,
        load_arch,
        resolve_model,
    )
    from jaxserve.checkpoints_tools.quantization import resolve_quantization
    from jaxserve.runner.memory_plan import memory_plan_for, resolve_max_model_len
    from jaxserve.runner.plan import resolve_dtype

    source = resolve_model(
        config.model.model,
        revision=config.model.revision,
        download_dir=config.model.download_dir,
        files=CONFIG_FILES,
    )
    arch = load_arch(source)
    declared = declared_dtype(source)
    if device_bytes is None:
        platform, device_bytes, memory_source = _local_device(args.platform, config)
    else:
        platform, memory_source = args.platform or "gpu", "--device-memory-gb"
    dtype = resolve_dtype(config.model.dtype, declared, platform)
    kv_cache_dtype = kv_cache_storage_dtype(config.cache.kv_cache_dtype, dtype)
    memory = memory_plan_for(
        config,
        arch,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=resolve_max_model_len(config.model.max_model_len, arch),
        device_memory_bytes=device_bytes,
        quantization=resolve_quantization(
            config.model.quantization, declared_quantization(source), config.model.model
        ),
        platform=platform,
    )
    return {
        "model": config.model.model,
        "revision": config.model.revision,
        "platform": platform,
        "requested_dtype": config.model.dtype,
        "declared_dtype": declared,
        "device_memory_source": memory_source,
        "device_memory_gib": device_bytes / GIB,
        **memory.as_dict(),
    }


def _flag_device_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if not math.isfinite(gib) or gib <= 0:
        raise PlanInputError(f"--device-memory-gb must be a number > 0, got {gib}")
    if gib > MAX_DEVICE_GIB:  # (1e300 GiB is no device, and int(gib * GIB) overflows)
        raise PlanInputError(f"--device-memory-gb must be at most {MAX_DEVICE_GIB}, got {gib}")
    device_bytes = int(gib * GIB)
    if device_bytes < 1:
        raise PlanInputError(f"--device-memory-gb {gib} is under one byte")
    return device_bytes


def _local_device(platform: str | None, config: EngineConfig) -> tuple[str, int, str]:
    """(platform, memory bytes, where they came from) of the first local device.

    Raises:
        PlanInputError: --platform names another platform than the local device's.
        RuntimeError: a GPU / TPU that reports no memory limit.
    """
    import jax

    from jaxserve.pallas_kernels.ragged_paged_attention import device_facts
    from jaxserve.runner.kv_cache import device_memory_bytes

    device = jax.devices()[0]
    local = str(device_facts(device)["platform"])
    if platform is not None and platform != local:
        raise PlanInputError(
            f"--platform {platform}: the local device is {local} ({device.device_kind}); give "
            "--device-memory-gb to plan for another platform"
        )
    try:
        memory = device_memory_bytes(device, config.cache.cpu_memory_bytes)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; or pass --device-memory-gb") from None
    if local == "cpu":
        return local, memory, "cpu_memory_bytes (the engine's CPU budget)"
    return local, memory, f"bytes_limit of the local {device.device_kind}"


def _bytes(n: int) -> str:
    human = f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"
    return f"{n:,} bytes ({human})"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable plan (one line a figure, then the verdict)."""
    r = report
    lines = [
        ("model", f"{r['model']} ({r['architecture']}, {r['num_params']:,} parameters)"),
        (
            "dtype",
            f"{r['dtype']} (requested {r['requested_dtype']}, declared {r['declared_dtype']}); "
            f"KV cache {r['kv_cache_dtype']}; platform {r['platform']}",
        ),
        ("quantization", f"{r['quantization'] or 'none'} (8-bit decoder linear weights)"),
        ("tensor_parallel_size", _tp_line(r)),
        (
            "device memory",
            f"{_bytes(r['device_memory_bytes'])} from {r['device_memory_source']}",
        ),
        ("budget", _budget_line(r)),
        ("weights per device", _bytes(r["weights_bytes"])),
        ("step workspace", _bytes(r["workspace_bytes"])),
        ("KV bytes per token", f"{r['kv_bytes_per_token']:,} per device"),
        (
            "max_kv_tokens",
            f"{r['max_kv_tokens']:,} ({r['num_kv_blocks_fit'] - 1:,} blocks of "
            f"{r['block_size']} tokens, besides the reserved null block)",
        ),
        ("engine's KV pool", _pool_line(r)),
        *_held_offers_lines(r),
        (
            "sequences at once",
            f"{r['max_num_seqs_at_max_model_len']:,} of max_model_len={r['max_model_len']:,}",
        ),
        ("fits", "yes" if r["fits"] else f"no: {r['reason']}"),
    ]
    width = max(len(name) for name, _ in lines) + 2
    return "\n".join(f"{name + ':':<{width}}{value}" for name, value in lines)


def _pool_line(r: dict[str, Any]) -> str:
    pool = f"{r['num_kv_blocks']:,} blocks, the null block included"
    if r["num_kv_blocks_requested"] is not None:
        return f"{pool} (num_kv_blocks given)"
    if r["num_kv_blocks"] < r["num_kv_blocks_fit"]:
        return (
            f"{pool} (capped at what it can use: max_num_seqs={r['max_num_seqs']} sequences "
            f"of {r['blocks_per_seq']} blocks, plus the null block)"
        )
    return pool


def _held_offers_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    """A KV producer's held offers (kv_transfer_config), beside the pool; none otherwise."""
    if not r["held_offers_bytes"]:
        return []
    return [("held KV offers", f"up to {_bytes(r['held_offers_bytes'])} beside the pool")]


def _tp_line(r: dict[str, Any]) -> str:
    tp = r["tensor_parallel_size"]
    if tp == 1:
        return "1"
    how = "split by KV head" if r["kv_cache_sharded"] else "whole on each (tp does not divide K)"
    return f"{tp} (per-device figures; KV cache {how})"


def _budget_line(r: dict[str, Any]) -> str:
    if r["num_kv_blocks_requested"] is not None:
        return (
            f"{_bytes(r['budget_bytes'])}: the whole device (num_kv_blocks="
            f"{r['num_kv_blocks_requested']} given, memory_utilization does not apply)"
        )
    return f"{_bytes(r['budget_bytes'])} ({r['memory_utilization']} of the device memory)"
