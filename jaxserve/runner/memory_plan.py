"""The memory plan: will a model fit on a device, and how many KV blocks will the engine get?

One piece of arithmetic, used by ``jaxserve plan`` (cli/plan.py, from config.json alone) and
by build_runner (factory.py, before any weight is read), so that the two always agree. Every
figure is per device: under tensor parallelism each of the N devices holds the same share.

    weights          the parameter shapes (CausalLM.param_shapes: eval_shape, allocates
                     nothing) x each parameter's own itemsize (the model dtype; 1 byte for an
                     8-bit linear weight plus 4 per f32 scale under a quantization); a
                     parameter sharded by the model's param_partition_specs(tp) counts 1/tp,
                     a replicated one whole
    KV per token     2 (K and V) x layers x KV heads x head_dim x itemsize of the KV cache
                     dtype (1 byte for FP8), / tp when tp divides the KV heads (the pages are
                     sharded on K then, sharding.py)
    KV scales        an FP8 KV cache's f32 k_scale and v_scale per layer (8 bytes a layer)
    workspace        a reserve for the step's live buffers besides weights and KV pages
                     (memory_sizes.workspace_bytes): the larger of the step's two halves,
                     the forward's (activations of max_num_batched_tokens tokens, f32 logits
                     of max_num_seqs rows or of one chunk of prompt logprobs, whichever is
                     more) and the sample's (f32 [max_num_seqs, V] buffers, as many as the
                     platform's compiler was measured to keep: 17 on TPU, 8 on GPU)
    budget           memory_utilization x the device's memory (the allocator's bytes_limit
                     on GPU / TPU, CacheConfig.cpu_memory_bytes on the CPU); with an explicit
                     num_kv_blocks, which overrides memory_utilization, the whole of it
    KV blocks        (budget - weights - workspace) // bytes per block, block 0 (the engine's
                     reserved null block) among them; max_kv_tokens = the others x block_size
                     (the tokens requests can use: get_stats()["num_usable_kv_blocks"] x block_size)
    held offers      a JaxTransferConnector producer's gathered copies awaiting their pulls,
                     capped at max_held_offers_fraction of the pool (offer_reserve.py): the
                     pool is the most blocks that fit in the KV budget with that cap beside

It fits when the weights and the workspace leave room for at least one sequence of
max_model_len tokens (ceil(max_model_len / block_size) blocks besides the null block), or,
with an explicit num_kv_blocks, when weights + workspace + that pool fit in the device. The
engine's pool (MemoryPlan.num_kv_blocks) is the blocks that fit, capped at what it can ever
use (max_num_seqs sequences of max_model_len, plus the null block), or the explicit size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.models import TP_AXIS, CausalLM, ModelArchConfig, get_model
from jaxserve.runner.memory_plan_checks import check_arguments
from jaxserve.runner.memory_sizes import (
    kv_bytes_per_token,
    kv_scales_bytes,
    weights_bytes,
    workspace_bytes,
)
from jaxserve.runner.offer_reserve import OfferReserve, held_offers_fraction_of, offer_reserve

GIB = 1 << 30


class DoesNotFit(ValueError):
    """The model does not fit in the device's memory (MemoryPlan.check)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where one device's memory goes for one model and engine configuration (all bytes are
    per device; see the module docstring for each figure)."""

    architecture: str
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_params: int
    weights_bytes: int  # per device
    weights_bytes_total: int  # every parameter once (the checkpoint in this dtype)
    kv_bytes_per_token: int  # per device
    kv_cache_sharded: bool  # the KV pages split over the tp devices (tp | KV heads)
    kv_scales_bytes: int  # an FP8 KV cache's f32 (k_scale, v_scale) per layer; else 0
    workspace_bytes: int
    device_memory_bytes: int
    memory_utilization: float
    budget_bytes: int  # what weights + workspace + KV may take
    num_kv_blocks_requested: int | None  # an explicit pool size (CacheConfig.num_kv_blocks)
    quantization: str | None = None  # 8-bit linear weights ("int8" / "fp8"), or None
    held_offers: OfferReserve | None = None  # a KV producer's held offers; None: not one

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of max_model_len tokens takes."""
        return -(-self.max_model_len // self.block_size)

    @property
    def kv_budget_bytes(self) -> int:
        """Bytes left for the KV cache (negative when weights + workspace exceed the budget)."""
        return self.budget_bytes - self._fixed_bytes

    @property
    def num_kv_blocks_fit(self) -> int:
        """KV blocks, the null block among them, that fit in kv_budget_bytes (0 when none)."""
        if self.num_kv_blocks_requested is not None:
            return self.num_kv_blocks_requested
        return self._blocks(max_useful_blocks=None)

    @property
    def max_kv_tokens(self) -> int:
        """Tokens the KV cache holds for requests: the blocks that fit, less the null block,
        x block_size (an uncapped pool's get_stats()["num_usable_kv_blocks"] x block_size)."""
        return max(self.num_kv_blocks_fit - 1, 0) * self.block_size

    @property
    def max_num_seqs_at_max_model_len(self) -> int:
        """Sequences of max_model_len tokens that fit in the KV cache at once."""
        return max(self.num_kv_blocks_fit - 1, 0) // self.blocks_per_seq

    @property
    def num_kv_blocks(self) -> int:
        """The pool the engine allocates, null block included: the explicit size, else the
        blocks that fit capped at max_num_seqs sequences of max_model_len (+ the null block)."""
        if self.num_kv_blocks_requested is not None:
            return self.num_kv_blocks_requested
        return self._blocks(max_useful_blocks=self.max_num_seqs * self.blocks_per_seq + 1)

    @property
    def held_offers_bytes(self) -> int:
        """The most a producer's held offers take beside the engine's pool (0: not one)."""
        reserve = self.held_offers
        return 0 if reserve is None else reserve.bytes(self.num_kv_blocks)

    def _blocks(self, max_useful_blocks: int | None) -> int:
        return blocks_for_budget(
            budget_bytes=self.budget_bytes,
            used_bytes=self._fixed_bytes,
            bytes_per_block=self.kv_bytes_per_block,
            max_useful_blocks=max_useful_blocks,
            reserve=self.held_offers,
        )

    @property
    def _fixed_bytes(self) -> int:
        """Everything but the KV pages: weights, workspace and the KV scales."""
        return self.weights_bytes + self.workspace_bytes + self.kv_scales_bytes

    @property
    def fits(self) -> bool:
        return self.shortfall() is None

    def shortfall(self) -> str | None:
        """Why the model does not fit (with the numbers), or None when it does."""
        used = f"{self.weights_bytes} bytes of weights + {self.workspace_bytes} bytes of workspace"
        if self.kv_scales_bytes:
            used += f" + {self.kv_scales_bytes} bytes of KV scales"
        if self.num_kv_blocks_requested is not None:
            pool = self.num_kv_blocks_requested * self.kv_bytes_per_block + self.held_offers_bytes
            if self._fixed_bytes + pool <= self.budget_bytes:
                return None
            held = f" + {self.held_offers_bytes} of held KV offers" if self.held_offers else ""
            return (
                f"{used} + num_kv_blocks={self.num_kv_blocks_requested} x "
                f"{self.kv_bytes_per_block} bytes{held} = "
                f"{self._fixed_bytes + pool} bytes exceed the device's "
                f"{self.budget_bytes} bytes"
            )
        if self.kv_budget_bytes <= 0:
            return f"{used} exceed the budget of {self.budget_bytes} bytes{self._budget_note()}"
        if self.num_kv_blocks_fit - 1 >= self.blocks_per_seq:
            return None
        needed = (self.blocks_per_seq + 1) * self.kv_bytes_per_block
        return (
            f"{used} leave {self.kv_budget_bytes} bytes of the {self.budget_bytes} bytes budget"
            f"{self._budget_note()} for the KV cache, room for {self.max_kv_tokens} tokens "
            f"({self.kv_bytes_per_token} bytes each); one sequence of max_model_len="
            f"{self.max_model_len} needs {self.blocks_per_seq} blocks of {self.block_size} "
            f"tokens plus the null block: {needed} bytes"
        )

    def _budget_note(self) -> str:
        return f" ({self.memory_utilization} x {self.device_memory_bytes} bytes of device memory)"

    def check(self, model: str) -> None:
        """Raise when the model does not fit (before anything is loaded).

        Raises:
            DoesNotFit (a ValueError): naming the model, the numbers, and what to change.
        """
        reason = self.shortfall()
        if reason is None:
            return
        remedy = (
            "lower num_kv_blocks"
            if self.num_kv_blocks_requested is not None
            else "lower max_model_len, max_num_batched_tokens or max_num_seqs, raise "
            "memory_utilization"
        )
        if self.held_offers is not None:
            remedy += " or lower max_held_offers_fraction"
        raise DoesNotFit(
            f"model {model!r} does not fit in device memory (per device, dtype {self.dtype}, "
            f"quantization={self.quantization!r}, tensor_parallel_size="
            f"{self.tensor_parallel_size}): {reason}; {remedy}, use more devices "
            "(tensor_parallel_size), a smaller dtype or 8-bit weights (quantization)"
        )

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived figure as plain values (`jaxserve plan --json`)."""
        out = dataclasses.asdict(self)
        for name in (
            "kv_bytes_per_block",
            "blocks_per_seq",
            "kv_budget_bytes",
            "num_kv_blocks_fit",
            "max_kv_tokens",
            "max_num_seqs_at_max_model_len",
            "num_kv_blocks",
            "held_offers_bytes",
            "fits",
        ):
            out[name] = getattr(self, name)
        out["reason"] = self.shortfall()
        return out


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    """The model's max_position_embeddings when None, else `requested` within it.

    Raises:
        ValueError: requested beyond max_position_embeddings.
    """
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested


# plan_memory's arguments that its caller has resolved already, or that offer_reserve checks;
# check_arguments (memory_plan_checks.py) checks the rest.
_RESOLVED_ARGUMENTS = ("arch", "quantization", "draft_arch", "held_offers_fraction")


def plan_memory(
    arch: ModelArchConfig,
    *,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    device_memory_bytes: int,
    memory_utilization: float,
    num_kv_blocks: int | None = None,
    quantization: str | None = None,
    draft_arch: ModelArchConfig | None = None,
    platform: str | None = None,
    held_offers_fraction: float | None = None,
) -> MemoryPlan:
    """The MemoryPlan of `arch` in `dtype` (already resolved: not "auto") on devices of
    `device_memory_bytes` each. Reads no weights and allocates nothing; a bad argument raises
    TypeError / ValueError, named with its value and limit.

    Args:
        num_kv_blocks: an explicit pool size (null block included), or None to size it.
        quantization: None, "int8" or "fp8" (resolved: the checkpoint's own or the requested).
        draft_arch: speculative decoding's draft model, whose weights (in `dtype`) and KV pages
            (in `dtype`, one block for each of the target's) count with the target's.
        platform: "cpu", "gpu" or "tpu" (the ExecutionPlan's), whose compiler's sampler
            temporaries the workspace reserves (memory_sizes.sample_workspace_bytes); None:
            the largest measured.
        held_offers_fraction: a JaxTransferConnector producer's max_held_offers_fraction,
            whose cap of held offers the pool leaves room for; None: not a producer.
    """
    check_arguments(**{k: v for k, v in locals().items() if k not in _RESOLVED_ARGUMENTS})
    model = get_model(arch, dtype=dtype, quantization=quantization)
    per_device, total, kv_per_token = _footprint(
        model, draft_arch, dtype, kv_cache_dtype, tensor_parallel_size
    )
    # An explicit pool overrides memory_utilization (CacheConfig): it must fit in the device.
    utilization = 1.0 if num_kv_blocks is not None else memory_utilization
    workspace = workspace_bytes(arch, dtype, max_num_batched_tokens=max_num_batched_tokens,
                                max_num_seqs=max_num_seqs, platform=platform)  # fmt: skip
    return MemoryPlan(
        architecture=arch.architecture,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_params=model.num_params(),
        weights_bytes=per_device,
        weights_bytes_total=total,
        kv_bytes_per_token=kv_per_token,
        kv_cache_sharded=model.kv_cache_partition_spec(tensor_parallel_size)[0] == TP_AXIS,
        kv_scales_bytes=kv_scales_bytes(arch, kv_cache_dtype),
        workspace_bytes=workspace,
        device_memory_bytes=device_memory_bytes,
        memory_utilization=float(memory_utilization),
        budget_bytes=int(device_memory_bytes * utilization),
        num_kv_blocks_requested=num_kv_blocks,
        quantization=quantization,
        held_offers=offer_reserve(
            model,
            held_offers_fraction,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
        ),  # fmt: skip
    )


def _footprint(
    model: CausalLM,
    draft_arch: ModelArchConfig | None,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
) -> tuple[int, int, int]:
    """(weights bytes per device, weights bytes in all, KV bytes per token) of the model and
    of speculative decoding's draft model, if any (its KV pages in ``dtype``)."""
    per_device, total = weights_bytes(model, tensor_parallel_size)
    kv_per_token = kv_bytes_per_token(model, tensor_parallel_size, kv_cache_dtype)
    if draft_arch is not None:
        draft = get_model(draft_arch, dtype=dtype)
        draft_device, draft_total = weights_bytes(draft, tensor_parallel_size)
        per_device, total = per_device + draft_device, total + draft_total
        kv_per_token += kv_bytes_per_token(draft, tensor_parallel_size, dtype)
    return per_device, total, kv_per_token


def memory_plan_for(
    config: EngineConfig,
    arch: ModelArchConfig,
    *,
    dtype: str,
    kv_cache_dtype: str,
    max_model_len: int,
    device_memory_bytes: int,
    quantization: str | None = None,
    draft_arch: ModelArchConfig | None = None,
    platform: str | None = None,
) -> MemoryPlan:
    """The MemoryPlan of this engine configuration (tensor parallelism, block size, step
    budget, memory share, explicit pool) for `arch` in the resolved dtypes: what build_runner
    checks and sizes the pool with, and what `jaxserve plan` prints."""
    cache, scheduler = config.cache, config.scheduler
    return plan_memory(
        arch,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=config.runner.tensor_parallel_size,
        block_size=cache.block_size,
        max_model_len=max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        device_memory_bytes=device_memory_bytes,
        memory_utilization=cache.memory_utilization,
        num_kv_blocks=cache.num_kv_blocks,
        quantization=quantization,
        draft_arch=draft_arch,
        platform=platform,
        held_offers_fraction=held_offers_fraction_of(config),
    )


def blocks_for_budget(
    *,
    budget_bytes: int,
    used_bytes: int,
    bytes_per_block: int,
    max_useful_blocks: int | None,
    reserve: OfferReserve | None = None,
) -> int:
    """Blocks of `bytes_per_block` that fit in budget - used (0 when none), with a producer's
    ``reserve`` of held offers beside them, capped at max_useful_blocks (None: no cap): the
    pool-sizing rule, on plain numbers."""
    free = budget_bytes - used_bytes
    if reserve is not None:
        blocks = reserve.pool_blocks(free, bytes_per_block)
    else:
        blocks = free // bytes_per_block if free > 0 else 0
    return blocks if max_useful_blocks is None else min(blocks, max_useful_blocks)


def gib(num_bytes: int) -> float:
    """Bytes in GiB (2^30 bytes)."""
    return num_bytes / GIB
