"""SchedulerOutput: the typed hand-off from the Scheduler to the ModelRunner, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.kv_connector.base import KVConnectorMeta
from jaxserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption.

    token_ids: prompt + output tokens so far (a resumed request brings its outputs back).
    num_prompt_tokens: len(prompt); token_ids[num_prompt_tokens:] are outputs.
    block_ids: the whole block table, in logical order.
    num_computed_tokens: tokens whose KV is already in the cache (prefix-cache hits).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    seed: int  # the request's sampling seed (its own, or one drawn from the engine seed)


@dataclass
class CachedRequestData:
    """A request the runner already holds, scheduled again.

    new_block_ids: appended to its block table this step.
    num_computed_tokens: tokens whose KV is in the cache before this step.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """Everything the runner needs to run one step.

    num_scheduled_tokens: req_id -> tokens computed this step (a decode is 1, a prefill chunk is
        its length); iteration order is the batch order (new requests first, then cached).
    finished_req_ids: finished or aborted since the previous step; the runner drops their state.
    preempted_req_ids: preempted this step; the runner drops them (they come back as new).
    block_copies: (src, dst) block pairs to copy before the forward (copy-on-write).
    device_to_host: (device block id, host slot) pairs of the host KV tier: offloads of
        evicted blocks and swap-outs. Copied first: the blocks may be reused in this step.
    host_to_device: (host slot, device block id) pairs: prefix hits on the host tier and
        swap-ins. Copied after device_to_host (a slot may be written and then read in one
        step), and before block_copies and the forward.
    scheduled_spec_decode_tokens: req_id -> the speculative drafts it verifies this step
        (running decodes only; their num_scheduled_tokens is 1 + len(drafts)).
    token_masks: req_id -> u32[ceil(V / 32)] tokens its sampling row may draw (bit t % 32 of
        word t // 32), or u32[1 + k, ceil(V / 32)] one per verification row with k drafts,
        for constrained requests that sample this step (structured outputs, bad words:
        jaxserve/structured/step_masks.py); the others are unmasked.
    kv_connector: the KV connector's loads (before the forward) and saves (after it), or None
        (core/kv_connector/base.py).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    device_to_host: list[tuple[int, int]] = field(default_factory=list)
    host_to_device: list[tuple[int, int]] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    token_masks: dict[str, np.ndarray] = field(default_factory=dict)
    kv_connector: KVConnectorMeta | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
