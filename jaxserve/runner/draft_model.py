"""DraftModel: the "draft_model" method of speculative decoding: a smaller model that proposes
k tokens greedily for each running decode.

Its KV cache is its own page arrays, indexed by the target's block ids: block b of the target
and block b of the draft hold the same positions of the same request, so the draft needs no
block tables, allocation or prefix cache of its own. It keeps them current by computing, inside
the target's one jitted step, the same ragged batch (step.py: the "mirror" forward, KV writes
only); every block the target computes, prefix-cache hits included, the draft has computed too.

After the step, ``propose(requests, k)`` (the Proposer of spec_decode) runs k greedy one-token
steps of every requesting decode in one jitted call (a fori_loop): from its last known token at
its position, writing its draft KV as it goes. Drafts are only guesses: stale draft KV (pages
restored from the host KV tier, which keeps the target's pages only; positions past the
request's table, which the step after allocates) lowers acceptance and never changes a token,
since the target verifies every draft.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.models import AttentionMetadata, CausalLM
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.kv_cache import allocate_kv_caches
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step import COPY_ARGS, jit_copy
from jaxserve.runner.step_compiles import StepCompiles

PROPOSE_ARGS = ("params", "kv_caches", "tokens", "positions", "block_tables", "num_blocks")


@dataclass(frozen=True)
class DraftSpec:
    """What the factory hands the runner to build its DraftModel: the loaded draft model."""

    model: CausalLM
    params: Any
    num_speculative_tokens: int
    sharding: ShardingPlan | None = None  # its own on the target's mesh; None: one device


class DraftModel:
    """The draft model's params and KV pages, and its proposal loop.

    Args:
        model: the draft CausalLM (same vocabulary as the target).
        params: its parameters, on device.
        num_kv_blocks, block_size: the target's pool (the draft's pages mirror it).
        num_speculative_tokens: k, the drafts proposed per request.
        input_batch: the target runner's rows (block tables, tokens); read, never written.
        row_buckets: the padded row counts a proposal may run at (the runner's R buckets).
        sharding: the draft's own ShardingPlan on the target's mesh (tensor parallelism splits
            it as it splits the target: heads, MLP columns, vocabulary, and its KV pages where
            tp divides its KV heads), or None: the default device. Every argument and result of
            the proposal and the block copy has an explicit sharding.
    """

    def __init__(
        self,
        model: CausalLM,
        params: Any,
        *,
        num_kv_blocks: int,
        block_size: int,
        num_speculative_tokens: int,
        input_batch: InputBatch,
        row_buckets: tuple[int, ...],
        sharding: ShardingPlan | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.input_batch = input_batch
        self.row_buckets = row_buckets
        self.sharding = sharding
        self.kv_caches = self.allocate_kv_caches()
        self.compiles = compiles = StepCompiles("the draft model's proposal")
        # Explicit placements: the pages keep one sharding through the step and the proposal,
        # so neither sees a new argument sharding (a recompilation) after warm-up.
        shardings = {}
        if sharding is not None:
            kv, rep = sharding.kv_shardings(model.arch.num_layers), sharding.replicated
            shardings = dict(
                in_shardings=(sharding.param_shardings(), kv, rep, rep, rep, rep),
                out_shardings=(kv, rep),
            )
        self.jitted_propose = propose = jax.jit(
            functools.partial(_propose_fn, model, self.k),
            donate_argnames=("kv_caches",),
            **shardings,
        )
        self._propose = lambda *args: compiles(propose, args, PROPOSE_ARGS)
        # Its own block copy: the pages have the draft's layers, not the target's.
        self.copy_compiles = copies = StepCompiles("the draft model's block copy")
        self.jitted_copy = copy = jit_copy(sharding, model.arch.num_layers)
        self._copy = lambda *args: copies(copy, args, COPY_ARGS)

    @staticmethod
    def step_args(draft: DraftModel | None) -> tuple[Any, Any]:
        """The target step's (draft_params, draft_kv_caches): a draft's, or (None, None)."""
        return (None, None) if draft is None else (draft.params, draft.kv_caches)

    @classmethod
    def create(
        cls, spec: DraftSpec, input_batch: InputBatch, num_kv_blocks: int, block_size: int,
        row_buckets: tuple[int, ...],
    ) -> DraftModel:  # fmt: skip
        """The DraftModel of a loaded draft (``spec``) for a runner's pool and rows."""
        return cls(
            spec.model, spec.params, num_kv_blocks=num_kv_blocks, block_size=block_size,
            num_speculative_tokens=spec.num_speculative_tokens, input_batch=input_batch,
            row_buckets=row_buckets, sharding=spec.sharding,
        )  # fmt: skip

    def reset(self, input_batch: InputBatch, pages_ok: bool) -> None:
        """After a failed step: the runner's new rows, and fresh pages unless ``pages_ok``."""
        self.input_batch = input_batch
        if not pages_ok:
            self.kv_caches = None  # release the dead buffers before allocating new ones
            self.kv_caches = self.allocate_kv_caches()

    def allocate_kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        model = self.model
        return allocate_kv_caches(
            model.arch.num_layers,
            model.kv_cache_shape(self.num_kv_blocks, self.block_size),
            model.dtype,
            None if self.sharding is None else self.sharding.kv_sharding,
        )

    def propose(self, requests, k: int) -> dict[str, list[int]]:
        """Up to ``k`` greedy drafts for each given running decode (the Proposer protocol);
        the requests must be rows of the runner (scheduled in the step just run)."""
        ib = self.input_batch
        req_ids = [r.request_id for r in requests if r.request_id in ib.slot_of]
        if not req_ids or k < 1:
            return {}
        drafts = np.zeros((0, self.k), np.int32)
        for start in range(0, len(req_ids), self.row_buckets[-1]):
            chunk = req_ids[start : start + self.row_buckets[-1]]
            drafts = np.concatenate([drafts, self._propose_rows(chunk)[: len(chunk)]])
        return {rid: drafts[i, :k].tolist() for i, rid in enumerate(req_ids)}

    def _propose_rows(self, req_ids: list[str]) -> np.ndarray:
        """i32[R, k] drafts of these requests (R: their padded count)."""
        rows = next(r for r in self.row_buckets if r >= len(req_ids))
        args = self.padded_inputs(rows, req_ids)
        self.kv_caches, drafts = self._propose(self.params, self.kv_caches, *args)
        return np.asarray(drafts)

    def padded_inputs(self, rows: int, req_ids: list[str] = ()) -> tuple[np.ndarray, ...]:
        """(tokens, positions, block_tables, num_blocks) of a proposal for ``rows`` padded
        rows: each request's last known token at its position, its table (entries past its
        blocks zeroed: the null block); padding rows: token 0 at position 0 in the null block."""
        ib = self.input_batch
        slots = np.fromiter((ib.slot_of[r] for r in req_ids), np.int64, len(req_ids))
        n = len(slots)
        width = ib.max_blocks_per_seq
        tokens, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        tables, num_blocks = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
        last = ib.num_tokens[slots] - 1
        tokens[:n] = ib.token_ids[slots, last]
        positions[:n] = last
        num_blocks[:n] = ib.num_blocks[slots]
        live = np.arange(width)[None, :] < num_blocks[:n, None]
        tables[:n] = np.where(live, ib.block_table[slots], 0)
        return tokens, positions, tables, num_blocks

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write of the draft's pages, as the target's (the same block pairs)."""
        self.kv_caches = self._copy(self.kv_caches, src, dst)


def _propose_fn(
    model: CausalLM,
    k: int,
    params: Any,
    kv_caches: list[tuple[jax.Array, jax.Array]],
    tokens: jax.Array,  # i32[R] each row's last known token
    positions: jax.Array,  # i32[R] its position
    block_tables: jax.Array,  # i32[R, B]
    num_blocks: jax.Array,  # i32[R] blocks in each row's table (0: a padding row)
):
    """k greedy one-token steps per row: returns (kv_caches, i32[R, k] drafts). A position past
    a row's table writes the null block (its KV is lost: later drafts of that row may miss)."""
    num_rows = tokens.shape[0]
    page = kv_caches[0][0].shape[2]  # P: pages are [K, S, P, H]
    rows = jnp.arange(num_rows)
    live = num_blocks > 0

    def one_token(j, carry):
        kv, tok, pos, drafts = carry
        blk = pos // page
        in_table = live & (blk < num_blocks)
        block = block_tables[rows, jnp.minimum(blk, block_tables.shape[1] - 1)]
        md = AttentionMetadata(
            positions=jnp.where(live, pos, 0),
            slot_mapping=jnp.where(in_table, block * page + pos % page, 0),
            block_tables=block_tables,
            kv_lens=jnp.where(live, pos + 1, 1),
            cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32),
            num_seqs=jnp.array([num_rows], jnp.int32),
        )
        kv, hidden = model.forward(params, kv, tok, md)
        nxt = jnp.argmax(model.compute_logits(params, hidden), axis=-1).astype(jnp.int32)
        return kv, nxt, pos + 1, drafts.at[:, j].set(nxt)

    init = (kv_caches, tokens, positions, jnp.zeros((num_rows, k), jnp.int32))
    kv_caches, _, _, drafts = lax.fori_loop(0, k, one_token, init)
    return kv_caches, drafts
