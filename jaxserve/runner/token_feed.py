"""TokenFeed: a step's samples fed to the next step on the device, for async scheduling.

With async scheduling (docs/engine_step.md) step N + 1 is dispatched before step N's sampled ids
reach the host, so a request that decodes in both has, in step N + 1, an input token the host
does not know yet: a placeholder. The runner keeps one device array, ``last_sampled`` (i32[S],
S = max_num_seqs), holding per slot of the persistent batch the last token its request sampled.
Every step's sample half records its samples there (``record``), and a step's token rows whose
input is a placeholder read it from there in the forward half (``inputs``): the ids never
travel to the host and back between the two steps, and no step waits for the other. The same
array serves the synchronous engine, whose steps simply have no placeholder, so both run the
same executables.

Slots are stable for a request's life in the batch (InputBatch), and a slot freed and reused
between two steps is written by the later step before it is read, so a slot always holds the
sample of its current request when a placeholder reads it (the device runs steps in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# sample_slot of a logits row that records nothing (padding, mid-prefill chunks, the drafts'
# rows): past every slot, so the scatter drops it (a negative index would wrap).
NO_SLOT = np.iinfo(np.int32).max


def initial_last_sampled(num_slots: int, sharding: Any, like: Any) -> Any:
    """``last_sampled`` before any step: zeros on the device (``sharding``: the runner's
    ShardingPlan or None), or its jax.ShapeDtypeStruct when the KV pages ``like`` are abstract
    (jaxserve/aot compiles for devices that are not attached: nothing may be allocated)."""
    replicated = None if sharding is None else sharding.replicated
    if isinstance(jax.tree.leaves(like)[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((num_slots,), jnp.int32, sharding=replicated)
    return jax.device_put(np.zeros(num_slots, np.int32), replicated)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenFeed:
    """The forward half's view of the samples in flight.

    last_sampled: i32[S] per slot, the last token its request sampled (device-resident: the
        previous step's output).
    from_slot: i32[T] per token row, the slot whose last sample is its input token (a
        placeholder), or -1 where the host's input id stands.
    """

    last_sampled: jax.Array
    from_slot: jax.Array

    def inputs(self, input_ids: jax.Array) -> jax.Array:
        """i32[T]: the host's input ids with each placeholder replaced by its sample."""
        fed = self.last_sampled[jnp.maximum(self.from_slot, 0)]
        return jnp.where(self.from_slot >= 0, fed, input_ids)

    def pending_outputs(self, input_ids: jax.Array, logits_indices: jax.Array) -> jax.Array:
        """i32[R]: per logits row, the output token its request sampled in the step before
        whose id the host's penalty counts do not have yet (the row's input token, when that
        was a placeholder), or -1. ``input_ids`` are ``inputs``' result."""
        fed = self.from_slot[logits_indices] >= 0
        return jnp.where(fed, input_ids[logits_indices], -1)


def record(last_sampled: jax.Array, sample_slot: jax.Array, token_ids: jax.Array) -> jax.Array:
    """i32[S]: ``last_sampled`` with each recording row's sample (``token_ids`` i32[R]) written
    to its slot (``sample_slot`` i32[R]: the slot, or NO_SLOT for a row that records nothing);
    the sample half's."""
    return last_sampled.at[sample_slot].set(token_ids, mode="drop")


def feed_arrays(
    slots: np.ndarray,
    num_scheduled: np.ndarray,
    token_positions: np.ndarray,
    num_known: np.ndarray,
    num_pending: np.ndarray,
    sampling_rows: np.ndarray,
    last_logits_rows: np.ndarray,
    padded_tokens: int,
    padded_rows: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The host half of a step's TokenFeed: (from_slot i32[T], sample_slot i32[R]).

    Args:
        slots: i32[n] slot of each request of the step, in batch order.
        num_scheduled: i32[n] its tokens this step.
        token_positions: i32[total] position of each real token row.
        num_known: i32[n] tokens of each request whose ids the host has.
        num_pending: i32[n] its samples still in flight, the tokens at the positions after
            the known ones (past those come speculative drafts, whose ids the host has).
        sampling_rows: bool[n] the requests that sample this step.
        last_logits_rows: i32[n] each request's last logits row (the one that samples its next
            token; without drafts, its batch row).
    """
    total = int(num_scheduled.sum())
    from_slot = np.full(padded_tokens, -1, np.int32)
    row_slots = np.repeat(slots, num_scheduled)
    known = np.repeat(num_known, num_scheduled)
    placeholder = (token_positions >= known) & (
        token_positions < known + np.repeat(num_pending, num_scheduled)
    )
    from_slot[:total] = np.where(placeholder, row_slots, -1)
    sample_slot = np.full(padded_rows, NO_SLOT, np.int32)
    sample_slot[last_logits_rows[sampling_rows]] = slots[sampling_rows]
    return from_slot, sample_slot


def empty_feed_arrays(padded_tokens: int, padded_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(from_slot, sample_slot) of a batch that feeds and records nothing (warm-up)."""
    return np.full(padded_tokens, -1, np.int32), np.full(padded_rows, NO_SLOT, np.int32)
