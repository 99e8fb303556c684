"""DraftModel: the "draft_model" method of speculative decoding: a smaller model that proposes
k tokens for each running decode, greedily, or sampled for random requests without a seed.

Its KV cache is its own page arrays, indexed by the target's block ids: block b of the target
and block b of the draft hold the same positions of the same request, so the draft needs no
block tables, allocation or prefix cache of its own. It keeps them current by computing, inside
the target's one jitted step, the same ragged batch (step.py: the "mirror" forward, KV writes
only); every block the target computes, prefix-cache hits included, the draft has computed too.

After the step, ``propose(requests, k)`` (the Proposer of spec_decode) runs k one-token steps of
every requesting decode in one jitted call (a fori_loop): from its last known token at its
position, writing its draft KV as it goes. A sampled draft is drawn from the draft's
distribution at the request's temperature over its top DRAFT_TOP_Q tokens, and that q is kept on
device (the q buffers) for the next step's rejection sampler (rejection_sampler.py: the
general-q rule; ``step_args`` and ``q_rows_of`` hand it over). Drafts are only guesses: stale
draft KV (pages restored from the host KV tier, which keeps the target's pages only; positions
past the request's table, which the step after allocates) lowers acceptance and never changes a
token, since the target verifies every draft.
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
from jaxserve.runner.kv_cache import KVAllocator, allocate_kv_caches
from jaxserve.runner.rejection_sampler import (
    DRAFT_STREAM,
    draw_top_q,
    row_keys,
    stream_uniforms,
)
from jaxserve.runner.sampling_metadata import GREEDY_TEMPERATURE_EPS
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step import COPY_ARGS, jit_copy
from jaxserve.runner.step_compiles import StepCompiles

PROPOSE_ARGS = (
    "params", "kv_caches", "q_ids", "q_probs", "q_offset", "num_steps",
    "tokens", "positions", "block_tables", "num_blocks", "sampling",
)  # fmt: skip
DRAFT_TOP_Q = 64  # a sampled draft's q: the draft model's distribution over its top Q tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftSampling:
    """Per proposal row: 1 / temperature (0: a greedy draft), the request's seed (u32[2]) and
    the output position of its first draft, for the row keys of rejection_sampler."""

    inv_t: Any  # f32[R]
    seeds: Any  # u32[R, 2]
    output_pos: Any  # i32[R]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftQ:
    """The step's view of the last proposal's sampled drafts: logits row r verifies a draft
    drawn from q row q_rows[r] (-1: a one-hot draft, or none) of the q buffers."""

    q_rows: Any  # i32[R]
    q_ids: Any  # i32[S, Q]
    q_probs: Any  # f32[S, Q]


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
        kv_allocator: makes its KV pages (kv_cache.abstract_kv_caches: compile, never run;
            the q buffers are then abstract too).
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
        kv_allocator: KVAllocator = allocate_kv_caches,
    ) -> None:
        self.model = model
        self._kv_allocator = kv_allocator
        self.params = params
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.input_batch = input_batch
        self.row_buckets = row_buckets
        self.sharding = sharding
        self.kv_caches = self.allocate_kv_caches()
        # The q of the last proposal's sampled drafts, DRAFT_TOP_Q entries per draft: row
        # k * i + j is draft j of the proposal's request i (q_base maps a request to k * i).
        self.num_q = min(DRAFT_TOP_Q, model.arch.vocab_size)
        max_rows = row_buckets[-1] * -(-input_batch.token_ids.shape[0] // row_buckets[-1])
        self.q_ids, self.q_probs = self._q_buffers(self.k * max_rows)
        self.q_base: dict[str, int] = {}
        self.compiles = compiles = StepCompiles("the draft model's proposal")
        # Explicit placements: the pages keep one sharding through the step and the proposal,
        # so neither sees a new argument sharding (a recompilation) after warm-up.
        shardings = {}
        if sharding is not None:
            kv, rep = sharding.kv_shardings(model.arch.num_layers), sharding.replicated
            shardings = dict(
                in_shardings=(sharding.param_shardings(), kv, *(rep,) * 9),
                out_shardings=(kv, rep, rep, rep),
            )
        self.jitted_propose = propose = jax.jit(
            functools.partial(_propose_fn, model, self.k, self.num_q),
            donate_argnames=("kv_caches", "q_ids", "q_probs"),
            **shardings,
        )
        self._propose = lambda *args: compiles(propose, args, PROPOSE_ARGS)
        # Its own block copy: the pages have the draft's layers, not the target's.
        self.copy_compiles = copies = StepCompiles("the draft model's block copy")
        self.jitted_copy = copy = jit_copy(sharding, model.arch.num_layers)
        self._copy = lambda *args: copies(copy, args, COPY_ARGS)

    @staticmethod
    def step_args(draft: DraftModel | None, q_rows: np.ndarray) -> tuple:
        """The target step's (draft_params, draft_kv_caches, draft_q): a draft's, with
        ``q_rows`` (i32[R]: q_rows_of's) as its DraftQ; or (None, None, None)."""
        if draft is None:
            return None, None, None
        return draft.params, draft.kv_caches, DraftQ(q_rows, draft.q_ids, draft.q_probs)

    def took_step(self, kv_caches: list[tuple[jax.Array, jax.Array]]) -> None:
        """The pages the target's step returned (it wrote them, donated: the old ones are
        gone)."""
        self.kv_caches = kv_caches

    def q_rows_of(self, req_ids: list[str], num_drafts: np.ndarray, padded_rows: int):
        """i32[padded_rows]: for each logits row of a step (request i owns 1 + num_drafts[i]
        rows, spec_rows.py), the q row of the sampled draft it verifies, else -1."""
        out = np.full(padded_rows, -1, np.int32)
        if not self.q_base or not num_drafts.any():
            return out
        start = np.cumsum(num_drafts + 1) - num_drafts - 1
        for i, req_id in enumerate(req_ids):
            base = self.q_base.get(req_id)
            if base is not None and num_drafts[i]:
                out[start[i] : start[i] + num_drafts[i]] = base + np.arange(num_drafts[i])
        return out

    def _q_buffers(self, num_rows: int) -> tuple[jax.Array, jax.Array]:
        shapes = ((num_rows, self.num_q), jnp.int32), ((num_rows, self.num_q), jnp.float32)
        placement = None if self.sharding is None else self.sharding.replicated
        if isinstance(self.kv_caches[0][0], jax.ShapeDtypeStruct):  # abstract pages (aot)
            return tuple(jax.ShapeDtypeStruct(*s, sharding=placement) for s in shapes)
        return tuple(jax.device_put(jnp.zeros(*s), placement) for s in shapes)

    @classmethod
    def create(
        cls, spec: DraftSpec, input_batch: InputBatch, num_kv_blocks: int, block_size: int,
        row_buckets: tuple[int, ...], kv_allocator: KVAllocator = allocate_kv_caches,
    ) -> DraftModel:  # fmt: skip
        """The DraftModel of a loaded draft (``spec``) for a runner's pool and rows."""
        return cls(
            spec.model, spec.params, num_kv_blocks=num_kv_blocks, block_size=block_size,
            num_speculative_tokens=spec.num_speculative_tokens, input_batch=input_batch,
            row_buckets=row_buckets, sharding=spec.sharding, kv_allocator=kv_allocator,
        )  # fmt: skip

    def reset(self, input_batch: InputBatch, pages_ok: bool) -> None:
        """After a failed step: the runner's new rows, and fresh pages unless ``pages_ok``."""
        self.input_batch = input_batch
        self.q_base = {}  # the drafts they described are dropped
        if not pages_ok:
            self.kv_caches = None  # release the dead buffers before allocating new ones
            self.kv_caches = self.allocate_kv_caches()
        # Small, and maybe donated to (or produced by) the failed call: always fresh.
        self.q_ids, self.q_probs = self._q_buffers(self.q_ids.shape[0])

    def allocate_kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        model = self.model
        return self._kv_allocator(
            model.arch.num_layers,
            model.kv_cache_shape(self.num_kv_blocks, self.block_size),
            model.dtype,
            None if self.sharding is None else self.sharding.kv_sharding,
        )

    def propose(self, requests, k: int) -> dict[str, list[int]]:
        """Up to ``k`` drafts for each given running decode (the Proposer protocol): sampled
        for a random request without a seed (sampled_draft), greedy otherwise. The requests
        must be rows of the runner (scheduled in the step just run)."""
        ib = self.input_batch
        requests = [r for r in requests if r.request_id in ib.slot_of]
        self.q_base = {}
        if not requests or k < 1:
            return {}
        k = min(k, self.k)
        drafts = np.zeros((0, self.k), np.int32)
        for start in range(0, len(requests), self.row_buckets[-1]):
            chunk = requests[start : start + self.row_buckets[-1]]
            drafts = np.concatenate([drafts, self._propose_rows(chunk, start, k)[: len(chunk)]])
        self.q_base = {r.request_id: self.k * i for i, r in enumerate(requests) if sampled_draft(r)}
        return {r.request_id: drafts[i, :k].tolist() for i, r in enumerate(requests)}

    def samples_drafts(self, request) -> bool:
        """Whether ``request``'s drafts are sampled, with their q (the Proposer protocol)."""
        return sampled_draft(request)

    def _propose_rows(self, requests: list, first: int, num_steps: int) -> np.ndarray:
        """i32[R, k] drafts of these requests (R: their padded count), the ``first``-th of
        the proposal onwards (their q rows start at k * first); only the first ``num_steps``
        columns are drafted (the draft model runs that many steps, not k)."""
        rows = next(r for r in self.row_buckets if r >= len(requests))
        args = self.propose_args(rows, requests, first, num_steps)
        self.kv_caches, drafts, self.q_ids, self.q_probs = self._propose(self.params, *args)
        return np.asarray(drafts)

    def propose_args(
        self, rows: int, requests: list = (), first: int = 0, num_steps: int | None = None
    ) -> tuple:
        """PROPOSE_ARGS after params for ``rows`` padded rows: the pages, the q buffers and the
        offset of this chunk's rows in them; the steps to run (k unless fewer drafts are
        wanted: the policy's "fit" arm); each request's last known token at its position,
        its table (entries past its blocks zeroed: the null block) and DraftSampling; padding
        rows: token 0 at position 0 in the null block, greedy."""
        ib = self.input_batch
        req_ids = [r.request_id for r in requests]
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
        sampling = DraftSampling(np.zeros(rows, np.float32), np.zeros((rows, 2), np.uint32),
                                 np.zeros(rows, np.int32))  # fmt: skip
        for i, req in enumerate(requests):
            if sampled_draft(req):
                sampling.inv_t[i] = 1.0 / req.sampling_params.temperature
                sampling.seeds[i] = (req.seed >> 32, req.seed & 0xFFFFFFFF)
                sampling.output_pos[i] = len(req.all_token_ids) - req.num_prompt_tokens
        q_offset = np.int32(self.k * first)
        steps = np.int32(self.k if num_steps is None else num_steps)
        tables_etc = (tokens, positions, tables, num_blocks, sampling)
        return (self.kv_caches, self.q_ids, self.q_probs, q_offset, steps, *tables_etc)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write of the draft's pages, as the target's (the same block pairs)."""
        self.kv_caches = self._copy(self.kv_caches, src, dst)


def sampled_draft(req) -> bool:
    """Whether a request's drafts are sampled from the draft model (a random request without
    a seed) rather than greedy: a seeded request's tokens stay those without speculation only
    with one-hot drafts (rejection_sampler.py)."""
    params = req.sampling_params
    return params.temperature >= GREEDY_TEMPERATURE_EPS and params.seed is None


def _propose_fn(
    model: CausalLM,
    k: int,
    num_q: int,
    params: Any,
    kv_caches: list[tuple[jax.Array, jax.Array]],
    q_ids: jax.Array,  # i32[S, Q] (donated)
    q_probs: jax.Array,  # f32[S, Q] (donated)
    q_offset: jax.Array,  # i32 this call's first q row: k * (its first request's index)
    num_steps: jax.Array,  # i32 <= k: the drafts wanted; later columns stay 0
    tokens: jax.Array,  # i32[R] each row's last known token
    positions: jax.Array,  # i32[R] its position
    block_tables: jax.Array,  # i32[R, B]
    num_blocks: jax.Array,  # i32[R] blocks in each row's table (0: a padding row)
    sampling: DraftSampling,
):
    """``num_steps`` (<= k, traced: one executable for every draft length) one-token steps per
    row, greedy or sampled (DraftSampling): returns (kv_caches, i32[R, k] drafts, q_ids,
    q_probs), rows k * i + j of the q buffers from q_offset on holding row i's draft j's q;
    columns from ``num_steps`` on stay 0. A position past a row's table writes the null block
    (its KV is lost: later drafts of that row may miss)."""
    num_rows = tokens.shape[0]
    page = kv_caches[0][0].shape[2]  # P: pages are [K, S, P, H]
    rows = jnp.arange(num_rows)
    live = num_blocks > 0

    def one_token(j, carry):
        kv, tok, pos, drafts, qs = carry
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
        logits = model.compute_logits(params, hidden)
        nxt, ids, probs = _next_tokens(logits, sampling, j, num_q)
        qi, qp = qs
        qs = qi.at[:, j].set(ids), qp.at[:, j].set(probs)
        return kv, nxt, pos + 1, drafts.at[:, j].set(nxt), qs

    qs = jnp.zeros((num_rows, k, num_q), jnp.int32), jnp.zeros((num_rows, k, num_q), jnp.float32)
    init = (kv_caches, tokens, positions, jnp.zeros((num_rows, k), jnp.int32), qs)
    kv_caches, _, _, drafts, (new_ids, new_probs) = lax.fori_loop(
        0, jnp.minimum(num_steps, k), one_token, init
    )
    start = (q_offset, jnp.int32(0))
    q_ids = lax.dynamic_update_slice(q_ids, new_ids.reshape(num_rows * k, num_q), start)
    q_probs = lax.dynamic_update_slice(q_probs, new_probs.reshape(num_rows * k, num_q), start)
    return kv_caches, drafts, q_ids, q_probs


def _next_tokens(logits: jax.Array, sampling: DraftSampling, j: jax.Array, num_q: int):
    """Each row's next draft: greedy, or drawn from its top-Q q (rows with inv_t > 0; only
    computed when some row is), with the q it was drawn from (zeros on greedy rows)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    num_rows = logits.shape[0]
    zeros = jnp.zeros((num_rows, num_q), jnp.int32), jnp.zeros((num_rows, num_q), jnp.float32)
    sampled = sampling.inv_t > 0

    def draw():
        keys = row_keys(sampling.seeds, sampling.output_pos + j)
        uniform = stream_uniforms(keys, DRAFT_STREAM)
        inv_t = jnp.where(sampled, sampling.inv_t, 1.0)
        draft, ids, probs = draw_top_q(logits, inv_t, uniform, num_q)
        return jnp.where(sampled, draft, greedy), ids, probs

    return lax.cond(jnp.any(sampled), draw, lambda: (greedy, *zeros))
