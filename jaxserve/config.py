"""Frozen, validated configuration dataclasses (host side, no jax).

Each config validates itself in ``__post_init__`` with messages that name the field, the value and
the limit (docs/architecture.md). ``EngineConfig`` composes them; ``EngineConfig.from_kwargs`` maps
the flat keyword arguments of ``LLM(...)`` onto them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache storage: "auto" keeps the model dtype; the others are vLLM's names of an FP8 KV
# cache ("fp8" is "fp8_e4m3"), stored as the jnp dtype named here (kv_cache_storage_dtype).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_STORAGE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# 8-bit linear weights (vLLM's `quantization`): None keeps the checkpoint's (a quantized
# checkpoint's own quantization_config applies); "int8" / "fp8" quantize a float checkpoint while
# loading. Must match jaxserve.models.quant.QUANTIZATIONS (a test checks; no jax here).
QUANTIZATIONS = (None, "int8", "fp8")
# Must list jaxserve.pallas_kernels.ragged_paged_attention.BACKENDS (a test checks) plus "auto";
# this module stays free of jax, so it cannot import them.
ATTENTION_BACKENDS = (
    "auto",
    "reference",
    "xla",
    "cpu",
    "pallas_mosaic_gpu",
    "pallas_triton",
    "pallas_tpu",
    "pallas_gpu",
    "pallas",
)
SCHEDULING_POLICIES = ("fcfs", "priority")
# What a preempted request's KV becomes: dropped and recomputed, kept in the host KV tier, or
# whichever of the two costs less for that request (core/sched/preemption.py).
PREEMPTION_MODES = ("recompute", "swap", "auto")
# vLLM's names for settings that have another name here: LLM(gpu_memory_utilization=0.8) is
# LLM(memory_utilization=0.8). Giving both, with different values, is an error.
ARGUMENT_ALIASES = {"gpu_memory_utilization": "memory_utilization"}

# The built-in demo model's engine defaults, sized for a demo (a few prompts, a notebook, a
# local server) instead of for a device's memory: a pool of 1024 blocks (16k tokens), 32
# sequences and a 512-token step budget, so that its warm-up compiles few shapes and its pool
# is allocated at once. An argument given (or, for the pool, a memory setting) wins.
DEMO_MODEL = "tiny-random-llama"
DEMO_ENGINE_DEFAULTS = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "num_kv_blocks": 1025}
_POOL_SETTINGS = ("num_kv_blocks", "memory_utilization", "cpu_memory_bytes")


def _positive_int(owner: str, name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


def _choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def _optional_name(owner: str, name: str, value: object, what: str) -> None:
    """None, or a non-empty str (a folder, a revision)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"{owner}.{name} must be {what} (str) or None, got {value!r}")


def check_memory_share(name: str, value: object) -> None:
    """A share of device memory: a number in (0, 1].

    Args:
        name: the name the caller gave it ("CacheConfig.memory_utilization",
            "gpu_memory_utilization"), used in the message.

    Raises:
        ValueError: not a number (bools included), or outside (0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which precision.

    model: a built-in name such as "tiny-random-llama", an HF checkpoint folder or Orbax
        folder, or a Hugging Face Hub model ID ("org/name"), tried in that order.
    max_model_len: longest prompt + output in tokens; None = the model's max_position_embeddings.
    revision: the Hub branch, tag or commit of a Hub model ID (None: "main"); refused for a
        built-in model or a folder, where it could not apply.
    download_dir: the Hugging Face cache folder for a Hub model ID (vLLM's name; None: the
        HF_HUB_CACHE / HF_HOME cache); refused for a built-in model or a folder.
    quantization: QUANTIZATIONS. "int8" (weight-only, per output channel) or "fp8" (e4m3, per
        output channel) store the decoder layers' linear weights in 8 bits, quantized tensor by
        tensor while loading (the LM head and embeddings stay in `dtype`); a checkpoint that is
        already FP8 / int8 (config.json's quantization_config) loads as it is, and a different
        value than its own is refused. None: the checkpoint's own precision.
    """

    model: str = "tiny-random-llama"
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None  # a folder with tokenizer.json; None: the model's own
    revision: str | None = None
    download_dir: str | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"ModelConfig.model must be a non-empty str, got {self.model!r}")
        _choice("ModelConfig", "dtype", self.dtype, DTYPES)
        _positive_int("ModelConfig", "max_model_len", self.max_model_len, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"ModelConfig.seed must be an int, got {self.seed!r}")
        _optional_name("ModelConfig", "tokenizer", self.tokenizer, "a folder path")
        _optional_name("ModelConfig", "revision", self.revision, "a branch, tag or commit")
        _optional_name("ModelConfig", "download_dir", self.download_dir, "a folder path")
        _choice("ModelConfig", "quantization", self.quantization, QUANTIZATIONS)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    block_size: tokens per KV block (P).
    num_kv_blocks: exact pool size including the reserved null block 0; overrides
        memory_utilization.
    memory_utilization: share of device memory for weights, the step's workspace and the KV
        cache (on CPU: of cpu_memory_bytes); vLLM's name, gpu_memory_utilization, is accepted
        by EngineConfig.from_kwargs. runner/memory_plan.py does the arithmetic.
    cpu_memory_bytes: the memory budget used on CPU, where there is no device memory to query.
    kv_cache_dtype: "auto" (the model dtype) or an FP8 KV cache, KV_CACHE_DTYPES: pages of one
        byte per value, quantized with one K and one V scale per layer (the checkpoint's
        k_scale / v_scale tensors when it ships them, else calculate_kv_scales decides).
    calculate_kv_scales: an FP8 KV cache's scales, when the checkpoint has none, computed from
        one calibration pass when the engine is built (runner/kv_calibration.py); False: 1.0
        (vLLM's default, whose own calculate_kv_scales uses the first prefill instead).
    kv_offloading_size: GiB of host memory for the host KV tier (0: none). Cached blocks
        evicted from the device pool are kept there and restored on a prefix hit.
    preemption_mode: "recompute" (drop a preempted request's KV), "swap" (move it to the host
        tier; recompute when the tier is full) or "auto" (per request, the cheaper of the two
        by the measured rates); "swap" and "auto" need kv_offloading_size > 0.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cpu_memory_bytes: int = 4 << 30
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = True
    kv_offloading_size: float = 0.0
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        _positive_int("CacheConfig", "block_size", self.block_size)
        _positive_int("CacheConfig", "num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"CacheConfig.num_kv_blocks must be >= 2 (block 0 is the reserved null block), "
                f"got {self.num_kv_blocks}"
            )
        check_memory_share("CacheConfig.memory_utilization", self.memory_utilization)
        _positive_int("CacheConfig", "cpu_memory_bytes", self.cpu_memory_bytes)
        _choice("CacheConfig", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        for name in ("enable_prefix_caching", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CacheConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)):
            raise TypeError(f"CacheConfig.kv_offloading_size must be a number (GiB), got {size!r}")
        if not 0.0 <= size < float("inf"):
            raise ValueError(
                f"CacheConfig.kv_offloading_size must be a finite number of GiB >= 0, got {size!r}"
            )
        _choice("CacheConfig", "preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode != "recompute" and size == 0:
            raise ValueError(
                f"CacheConfig.preemption_mode={self.preemption_mode!r} needs a host KV tier: "
                f"kv_offloading_size must be > 0 GiB, got {size!r}"
            )
        if size > 0 and self.preemption_mode == "recompute" and not self.enable_prefix_caching:
            raise ValueError(
                f"CacheConfig.kv_offloading_size={size!r} GiB would never be used: the host KV "
                "tier keeps evicted prefix-cache blocks (enable_prefix_caching=False) and "
                "swapped-out requests (preemption_mode='recompute'); turn one of them on"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler.

    max_num_batched_tokens: token budget of one step (T before padding).
    max_num_seqs: requests in one step (R before padding).
    max_model_len: filled in by the engine once the model is known.
    async_scheduling: schedule and prepare the next step while the device runs this one
        (docs/engine_step.md); None: the execution plan's choice for the platform.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _positive_int("SchedulerConfig", "max_num_seqs", self.max_num_seqs)
        _positive_int("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("SchedulerConfig", "max_model_len", self.max_model_len)
        _choice("SchedulerConfig", "policy", self.policy, SCHEDULING_POLICIES)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(
                "SchedulerConfig.async_scheduling must be True, False or None (the plan's "
                f"choice), got {self.async_scheduling!r}"
            )


@dataclass(frozen=True)
class RunnerConfig:
    """The device side: attention backend, parallelism, compilation."""

    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # True: compile every step shape at start-up (a server); "job": before each offline job
    # (LLM.generate / stream), the shapes its requests can reach (runner/job_shapes.py),
    # LLM's default; False: on first use.
    warmup: bool | str = True
    # With warmup=True: compile only the smallest token buckets at construction and the rest
    # in a background thread while the engine serves, each step's tokens capped at the
    # largest bucket ready meanwhile (engine/background_warmup.py). AsyncLLM and `jaxserve
    # serve` turn it on unless told otherwise; an offline LLM refuses it (its jobs warm up
    # before they start).
    enable_background_warmup: bool = False
    # The plan checks its attention kernel once per process against the reference; on a
    # mismatch it takes the next implementation with a warning, or, when strict, raises.
    strict_kernels: bool = False
    # jax's persistent compilation cache (runner/compile_cache.py): None = the environment's
    # JAXSERVE_COMPILATION_CACHE_DIR, else ~/.cache/jaxserve/xla; "" = off.
    compilation_cache_dir: str | None = None
    # A folder of `jaxserve compile --output` (runner/executable_store.py): its executables are
    # loaded instead of compiled; a folder compiled for another engine is refused.
    precompiled: str | None = None

    def __post_init__(self) -> None:
        _choice("RunnerConfig", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive_int("RunnerConfig", "tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.strict_kernels, bool):
            raise TypeError(
                f"RunnerConfig.strict_kernels must be a bool, got {self.strict_kernels!r}"
            )
        if not isinstance(self.warmup, bool) and self.warmup != "job":
            raise TypeError(
                f"RunnerConfig.warmup must be True, False or 'job', got {self.warmup!r}"
            )
        if not isinstance(self.enable_background_warmup, bool):
            raise TypeError(
                "RunnerConfig.enable_background_warmup must be a bool, got "
                f"{self.enable_background_warmup!r}"
            )
        if self.enable_background_warmup and self.warmup is not True:
            raise ValueError(
                "RunnerConfig.enable_background_warmup=True needs warmup=True (the warm-up it "
                f"finishes in the background), got warmup={self.warmup!r}"
            )
        if self.precompiled is not None and not isinstance(self.precompiled, str):
            raise TypeError(
                f"RunnerConfig.precompiled must be a folder path (str) or None, got "
                f"{self.precompiled!r}"
            )
        cache_dir = self.compilation_cache_dir
        if cache_dir is not None and not isinstance(cache_dir, str):
            raise TypeError(
                "RunnerConfig.compilation_cache_dir must be a folder path (str), '' (off) or "
                f"None, got {cache_dir!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig | None = None  # LLM(speculative_config=...); None: off
    kv_transfer: KVTransferConfig | None = None  # LLM(kv_transfer_config=...); None: off

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from ``LLM(...)``'s flat keyword arguments (vLLM's names of ARGUMENT_ALIASES
        included).

        Raises:
            TypeError: an unknown argument (the known ones are listed), or a bad value's type.
            ValueError: a bad value; an alias and its name given with different values.
        """
        kwargs = _resolve_aliases(kwargs)
        if kwargs.get("model", ModelConfig.model) == DEMO_MODEL:
            kwargs = _with_demo_defaults(kwargs)
        speculative = SpeculativeConfig.from_value(kwargs.pop("speculative_config", None))
        kv_transfer = KVTransferConfig.from_value(kwargs.pop("kv_transfer_config", None))
        parts: dict[str, dict[str, object]] = {}
        owners = {"model": ModelConfig, "cache": CacheConfig, "runner": RunnerConfig}
        owners["scheduler"] = SchedulerConfig
        by_field = {f.name: part for part, c in owners.items() for f in fields(c)}
        # max_model_len lives on ModelConfig (None = from the checkpoint); the engine copies the
        # resolved value into SchedulerConfig.
        by_field["max_model_len"] = "model"
        for key, value in kwargs.items():
            part = by_field.get(key)
            if part is None:
                extra = ("speculative_config", "kv_transfer_config")
                known = sorted([*by_field, *ARGUMENT_ALIASES, *extra])
                raise TypeError(f"unknown engine argument {key!r}; known: {known}")
            parts.setdefault(part, {})[key] = value
        configs = {part: owners[part](**vals) for part, vals in parts.items()}
        return cls(**configs, speculative=speculative, kv_transfer=kv_transfer)


def kv_cache_storage_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The dtype name the KV pages are stored in: the model's `dtype` (resolved, not "auto")
    for "auto", else the FP8 dtype of FP8_STORAGE_DTYPES.

    Raises:
        ValueError: kv_cache_dtype not in KV_CACHE_DTYPES (the choices named).
    """
    _choice("CacheConfig", "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    return dtype if kv_cache_dtype == "auto" else FP8_STORAGE_DTYPES[kv_cache_dtype]


def _with_demo_defaults(kwargs: dict[str, object]) -> dict[str, object]:
    """kwargs with DEMO_ENGINE_DEFAULTS for the settings not given (the pool's size only when
    no pool setting is given)."""
    out = dict(kwargs)
    for key, value in DEMO_ENGINE_DEFAULTS.items():
        pool = _POOL_SETTINGS if key == "num_kv_blocks" else (key,)
        if not any(k in kwargs for k in pool):
            out[key] = value
    return out


def _resolve_aliases(kwargs: dict[str, object]) -> dict[str, object]:
    """kwargs with each vLLM alias (ARGUMENT_ALIASES) renamed to this project's name.

    Raises:
        ValueError: an alias and its name with different values (both named), or a bad value
            of gpu_memory_utilization (named as given).
    """
    out = dict(kwargs)
    for alias, name in ARGUMENT_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise ValueError(
                f"{alias}={value!r} and {name}={out[name]!r} are two names of one setting "
                "with different values; give one of them"
            )
        if name == "memory_utilization":
            check_memory_share(alias, value)
        out[name] = value
    return out
