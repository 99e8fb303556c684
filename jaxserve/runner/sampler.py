"""On-device sampling, called inside the runner's one jitted step after compute_logits.

Order of processing (vLLM V1):
    penalties (repetition over prompt + outputs, presence / frequency over outputs)
    -> banned tokens (min_tokens: EOS and stop ids) set to -inf
    -> logit_bias added, then tokens outside the row's bitmask (allowed_token_ids, grammars,
       bad words) set to -inf (token_constraints.py)
    -> greedy rows: argmax
    -> temperature -> min-p -> top-k -> top-p (on the distribution renormalised after the
       previous masks) -> inverse-CDF draw of one uniform from the row's key
       fold_in(key(seed), output_pos)
Logprobs are those of the raw distribution: log_softmax of the unprocessed logits.

Every per-row setting is data, so a new combination of settings never compiles: the random
path, the top-k / top-p masks and the logprobs run under lax.cond, only when some row needs
them, and logprobs always come back MAX_LOGPROBS wide (the host cuts each row to what it
asked). The static arguments are fast_top_k and the draw, and the shapes R, V, W, B (W and B
are 0 for a batch without penalties or bans, else at least their minimum buckets: two compiled
variants per batch shape, both compiled by warm-up).

Cost beyond the [R, V] elementwise passes and two row reductions (argmax, logsumexp):
- penalties and bans: a gather / scatter of R x W and R x B elements (0 when W = B = 0, and
  skipped at run time when no row of the batch has a penalty, or a ban);
- top-k / top-p: skipped at run time (lax.cond) when no row needs them; otherwise lax.top_k of
  the fast_top_k largest logits per row, which settles every row whose top_k <= fast_top_k or
  whose nucleus lies inside those; only a batch with some other row falls back to a full sort of
  R x V (a second lax.cond). Ties at a threshold keep every tied token (as vLLM);
- the draw (draw.py): R uniforms, an R x V exp and two short cumulative sums (two-level
  inverse CDF); on the CPU one C++ kernel (pallas_kernels/sampling/cpu_draw.cc) instead;
- logprobs (when asked): log_softmax, one R x V count for the sampled token's rank, and
  lax.top_k(N) for the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.outputs import TokenLogprobs
from jaxserve.runner.draw import draw_tokens
from jaxserve.runner.rejection_sampler import (
    ACCEPT_STREAM,
    RECOVER_STREAM,
    SampledDrafts,
    row_keys,
    stream_uniforms,
    verify_sampled,
)
from jaxserve.runner.sampling_checks import check_metadata
from jaxserve.runner.sampling_metadata import SamplingMetadata
from jaxserve.runner.token_constraints import apply_token_constraints
from jaxserve.sampling_params import MAX_LOGPROBS

DEFAULT_FAST_TOP_K = 64


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogprobsArrays:
    """Logprobs of X positions (sampled rows or prompt positions) in TokenLogprobs' layout:
    column 0 is the sampled (or prompt) token, columns 1..N the top-N, most likely first."""

    logprobs: jax.Array  # f32[X, 1 + N] log_softmax of the raw logits
    token_ids: jax.Array  # i32[X, 1 + N]
    ranks: jax.Array  # i32[X, 1 + N] 1 = most likely; column 0: 1 + #tokens strictly likelier

    def to_token_logprobs(self, num_logprobs: int | list[int]) -> list[TokenLogprobs]:
        """Host side (numpy fields): one TokenLogprobs per row, cut to 1 + num_logprobs columns
        (one count for all rows, or one per row)."""
        return to_token_logprobs(self.logprobs, self.token_ids, self.ranks, num_logprobs)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """What the step returns to the host. N = logprobs_width(V); the logprob fields hold zeros
    when no row asked for logprobs (the host does not fetch them then)."""

    token_ids: jax.Array  # i32[R] sampled token of each row (padding rows: argmax)
    logprobs: jax.Array  # f32[R, 1 + N] sampled token first, then the top-N
    logprob_token_ids: jax.Array  # i32[R, 1 + N]
    ranks: jax.Array  # i32[R, 1 + N]

    def token_logprobs(self, row: int, num_logprobs: int) -> TokenLogprobs:
        """Host side (numpy fields): row ``row`` as TokenLogprobs with 1 + num_logprobs entries."""
        (out,) = to_token_logprobs(
            self.logprobs[row : row + 1],
            self.logprob_token_ids[row : row + 1],
            self.ranks[row : row + 1],
            num_logprobs,
        )
        return out


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    *,
    fast_top_k: int = DEFAULT_FAST_TOP_K,
    draw: str = "xla",
    drafts: SampledDrafts | None = None,
    pending_outputs: jax.Array | None = None,
) -> SamplerOutput:
    """Sample one token per row. Traced inside the runner's jit; fast_top_k and draw are static.

    Args:
        logits: f32[R, V] (any float dtype; computed in f32) at the rows that sample.
        md: SamplingMetadata with R rows (SamplingInputs.build).
        fast_top_k: width of the lax.top_k that settles top-k / top-p before a full sort.
        draw: "xla", or "cpu" for the C++ draw kernel (the execution plan's choice on the CPU
            where the kernel builds; the same draw up to f32 rounding of the exps).
        drafts: sampled speculative drafts, whose rows keep the general-q rule instead of
            their own draw (rejection_sampler.py; a run-time test skips it when none does).
        pending_outputs: i32[R] per row, an output token of its request that the penalty
            lists do not count yet (a sample of the step before, in flight: token_feed.py),
            or -1; None: none.
    Returns:
        SamplerOutput.
    Raises:
        ValueError: (at trace time) a metadata field whose shape or dtype does not fit logits.
    """
    check_metadata(logits, md)
    raw = logits.astype(jnp.float32)
    x = _apply_bans(apply_penalties(raw, md, pending_outputs), md.banned_token_ids)
    x = apply_token_constraints(x, md.token_bitmask, md.bias_token_ids, md.bias_values)
    greedy = md.temperature <= 0.0

    def some_sampled() -> jax.Array:
        sampled = _sample_random(x, md, fast_top_k, draw)
        # The [R, V] argmax only when some row is greedy (a run-time test, not a compile).
        return lax.cond(
            jnp.any(greedy), lambda: jnp.where(greedy, _argmax(x), sampled), lambda: sampled
        )

    token_ids = lax.cond(jnp.all(greedy), lambda: _argmax(x), some_sampled)
    if drafts is not None:
        token_ids = lax.cond(
            jnp.any(drafts.use_q),
            lambda: _verify_sampled_drafts(x, md, fast_top_k, token_ids, drafts),
            lambda: token_ids,
        )
    num = logprobs_width(raw.shape[1])
    lp = lax.cond(
        jnp.any(md.num_logprobs >= 0),
        lambda: _logprobs(raw, token_ids, num),
        lambda: no_logprobs(raw.shape[0], num),
    )
    return SamplerOutput(token_ids, lp.logprobs, lp.token_ids, lp.ranks)


def _argmax(x: jax.Array) -> jax.Array:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def prompt_logprobs(logits: jax.Array, target_ids: jax.Array, *, num: int) -> LogprobsArrays:
    """Logprobs of prompt tokens given their prefix, in the layout of the sampled ones.

    Args:
        logits: f32[T', V] raw logits at prompt positions.
        target_ids: i32[T'] the prompt token that follows each position; a negative id marks a
            position the caller ignores (its row holds unspecified values, nothing fails).
        num: N top logprobs per position (static; the runner asks MAX_LOGPROBS).
    Returns:
        LogprobsArrays with 1 + num columns.
    """
    if logits.ndim != 2 or target_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"prompt_logprobs: logits must be [T', V] and target_ids [T'], got "
            f"{tuple(logits.shape)} and {tuple(target_ids.shape)}"
        )
    return _logprobs(logits.astype(jnp.float32), target_ids.astype(jnp.int32), num)


def apply_penalties(
    logits: jax.Array, md: SamplingMetadata, pending: jax.Array | None = None
) -> jax.Array:
    """Repetition penalty on prompt + output tokens (positive logits / rp, negative * rp), then
    logit -= frequency * count + presence * (count > 0) over output tokens. f32[R, V] -> same.

    ``pending`` (i32[R], -1: none) is one more output token per row that the lists do not
    count yet: it adds 1 to its count, or joins the row's tokens with a count of 1.

    Reads and writes only the R x W listed tokens (and a pending one); W = 0 returns logits
    untouched.
    """
    ids = md.penalty_token_ids  # i32[R, W]
    if ids.shape[1] == 0:
        return logits
    # A row without penalties gets its values back unchanged (x / 1, x * 1, x - 0): a batch
    # whose lists are there for its bans or token constraints only skips the R x W gather and
    # scatter (a run-time test, nothing compiles per batch).
    penalized = (
        (md.repetition_penalty != 1.0)
        | (md.frequency_penalty != 0.0)
        | (md.presence_penalty != 0.0)
    )
    return lax.cond(jnp.any(penalized), lambda: _penalize(logits, md, pending), lambda: logits)


def _penalize(logits: jax.Array, md: SamplingMetadata, pending: jax.Array | None) -> jax.Array:
    """apply_penalties' work, on every row (W > 0)."""
    num_rows, vocab = logits.shape
    ids = md.penalty_token_ids
    live = ids >= 0
    counts = md.penalty_output_counts
    if pending is not None:
        listed = live & (ids == pending[:, None])  # bool[R, W]
        counts = counts + listed
        new = (pending >= 0) & ~jnp.any(listed, axis=1)  # bool[R]: a token new to the list
        ids = jnp.concatenate([ids, jnp.where(new, pending, -1)[:, None]], axis=1)
        counts = jnp.concatenate([counts, new[:, None].astype(counts.dtype)], axis=1)
        live = ids >= 0
    vals = jnp.take_along_axis(logits, jnp.where(live, ids, 0), axis=1)  # f32[R, W]
    rep = md.repetition_penalty[:, None]
    vals = jnp.where(vals > 0, vals / rep, vals * rep)
    counts = counts.astype(jnp.float32)
    vals = vals - md.frequency_penalty[:, None] * counts
    vals = vals - md.presence_penalty[:, None] * (counts > 0)
    # Padding points past the vocabulary and is dropped (a -1 would wrap to V - 1).
    rows = jnp.arange(num_rows)[:, None]
    return logits.at[rows, jnp.where(live, ids, vocab)].set(vals, mode="drop")


def _apply_bans(x: jax.Array, banned: jax.Array) -> jax.Array:
    num_rows, vocab = x.shape
    if banned.shape[1] == 0:
        return x
    rows = jnp.arange(num_rows)[:, None]
    # Skipped at run time when no row bans anything (the lists' batch of another row's needs).
    return lax.cond(
        jnp.any(banned >= 0),
        lambda: x.at[rows, jnp.where(banned >= 0, banned, vocab)].set(-jnp.inf, mode="drop"),
        lambda: x,
    )


def _sample_random(x: jax.Array, md: SamplingMetadata, fast_top_k: int, draw: str) -> jax.Array:
    """Temperature, min-p, top-k, top-p, then an inverse-CDF draw per row. f32[R, V] -> i32[R].

    Passes over [R, V] are the cost (memory-bound on every platform), so nothing of size
    [R, V] is written besides the draw's exp: for t > 0 every mask is monotone in the logits,
    so min-p, top-k and top-p come down to one threshold per row on the unscaled x, applied
    (with the temperature) inside the draw's exp pass (x / t and a masked copy of x would each
    cost a full pass)."""
    inv_t, min_p_offset, threshold = _masks(x, md, fast_top_k)
    uniform = jax.vmap(jax.random.uniform)(row_keys(md.seeds, md.output_pos))  # f32[R] in [0, 1)
    return draw_tokens(x, uniform, inv_t, min_p_offset, threshold, draw)


def _masks(x: jax.Array, md: SamplingMetadata, fast_top_k: int) -> tuple[jax.Array, ...]:
    """(1 / temperature, the min-p offset, the top-k / top-p threshold), each f32[R]: token i
    survives when x_i >= max(max(x) + offset, threshold), at probability softmax(x * inv_t)."""
    temperature = jnp.where(md.temperature > 0.0, md.temperature, 1.0)  # greedy rows: unused
    inv_t = 1.0 / temperature
    # min-p: p_i >= min_p * p_max  <=>  x_i / t >= x_max / t + log(min_p)
    #        <=>  x_i >= x_max + t * log(min_p); min_p = 0 gives -inf: keeps all.
    min_p_offset = temperature * jnp.log(md.min_p)
    threshold = _top_k_top_p_threshold(x, min_p_offset, md.top_k, md.top_p, fast_top_k, inv_t)
    return inv_t, min_p_offset, threshold


def _verify_sampled_drafts(
    x: jax.Array, md: SamplingMetadata, fast_top_k: int, token_ids: jax.Array,
    drafts: SampledDrafts,
) -> jax.Array:  # fmt: skip
    """The rows with sampled drafts re-decided by the general-q rule against the processed
    distribution the row's own draw used (rejection_sampler.verify_sampled)."""
    inv_t, min_p_offset, threshold = _masks(x, md, fast_top_k)
    row_max = jnp.max(x, axis=-1)
    floor = jnp.maximum(row_max + min_p_offset, threshold)
    z = jnp.where(x >= floor[:, None], (x - row_max[:, None]) * inv_t[:, None], -jnp.inf)
    keys = row_keys(md.seeds, md.output_pos)
    verified = verify_sampled(
        jax.nn.softmax(z, axis=-1), drafts,
        stream_uniforms(keys, ACCEPT_STREAM), stream_uniforms(keys, RECOVER_STREAM),
    )  # fmt: skip
    return jnp.where(drafts.use_q, verified, token_ids)


def _top_k_top_p_threshold(
    x: jax.Array,
    min_p_offset: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    fast_top_k: int,
    inv_t: jax.Array,
) -> jax.Array:
    """Per-row top-k / top-p threshold f32[R] on the unscaled logits x f32[R, V] after the
    min-p mask (x < max(x) + min_p_offset dropped; top-p reads softmax(x * inv_t) of what is
    left); -inf for rows without them, and for every row without computing anything when no
    row sets them (a run-time test)."""
    vocab = x.shape[1]
    k = min(fast_top_k, vocab)

    def compute() -> jax.Array:
        min_p_floor = jnp.max(x, axis=-1) + min_p_offset
        masked = jnp.where(x >= min_p_floor[:, None], x, -jnp.inf)
        threshold, settled = _thresholds(masked, top_k, top_p, k, inv_t)
        if k < vocab:
            threshold = lax.cond(
                jnp.all(settled),
                lambda: threshold,
                lambda: _thresholds(masked, top_k, top_p, vocab, inv_t)[0],
            )
        return threshold

    needed = jnp.any((top_k < vocab) | (top_p < 1.0))
    return lax.cond(needed, compute, lambda: jnp.full(x.shape[:1], -jnp.inf, x.dtype))


def _thresholds(
    x: jax.Array, top_k: jax.Array, top_p: jax.Array, k: int, inv_t: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per-row logit threshold of top-k then top-p, read from the k largest logits of each row
    (x unscaled; top-p's probabilities are those of x * inv_t).

    Returns:
        threshold f32[R]: tokens with x >= threshold survive (-inf: no mask).
        settled bool[R]: the k largest sufficed (always true when k == V).
    """
    vocab = x.shape[1]
    if k < vocab:
        vals = lax.top_k(x, k)[0]  # f32[R, k] descending
    else:
        vals = -jnp.sort(-x, axis=-1)
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, k - 1)[:, None], axis=1)[:, 0]
    k_floor = jnp.where(top_k < vocab, kth, -jnp.inf)  # wrong when top_k > k: not settled
    in_top_k = jnp.arange(k)[None, :] < top_k[:, None]  # bool[R, k]
    # top-p sees the distribution renormalised after min-p and top-k (vLLM's order).
    scale = inv_t[:, None]
    lse = jax.nn.logsumexp(jnp.where(x >= k_floor[:, None], x * scale, -jnp.inf), axis=-1)
    probs = jnp.where(in_top_k, jnp.exp(vals * scale - lse[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: tokens whose exclusive cumsum < top_p.
    num_kept = jnp.sum(((cum - probs) < top_p[:, None]) & in_top_k, axis=-1)  # >= 1
    last_kept = jnp.take_along_axis(vals, (num_kept - 1)[:, None], axis=1)[:, 0]
    p_floor = jnp.where(top_p < 1.0, last_kept, -jnp.inf)
    top_k_off = top_k >= vocab
    settled = (top_k <= k) | (top_k_off & ((top_p >= 1.0) | (cum[:, -1] >= top_p)))
    return jnp.maximum(k_floor, p_floor), settled


def logprobs_width(vocab_size: int) -> int:
    """The top-N logprobs the device computes: MAX_LOGPROBS, or the whole vocabulary when it is
    smaller."""
    return min(MAX_LOGPROBS, vocab_size)


def no_logprobs(num_rows: int, num: int) -> LogprobsArrays:
    """What a batch without logprobs returns in their place: zeros [X, 1 + num]."""
    zeros = jnp.zeros((num_rows, 1 + num), jnp.int32)
    return LogprobsArrays(zeros.astype(jnp.float32), zeros, zeros)


def _logprobs(raw: jax.Array, token_ids: jax.Array, num: int) -> LogprobsArrays:
    """Raw logprobs of token_ids and the top-num, f32[X, V] -> LogprobsArrays [X, 1 + num]."""
    num_rows = raw.shape[0]
    if num < 0:
        raise ValueError(f"the number of top logprobs must be >= 0, got {num}")
    lp = jax.nn.log_softmax(raw, axis=-1)  # f32[X, V]
    token_lp = jnp.take_along_axis(lp, token_ids[:, None], axis=1, mode="clip")  # f32[X, 1]
    token_rank = 1 + jnp.sum(lp > token_lp, axis=-1, dtype=jnp.int32)[:, None]
    top_lp, top_ids = lax.top_k(lp, num)  # [X, N]
    top_ranks = jnp.broadcast_to(jnp.arange(1, num + 1, dtype=jnp.int32), (num_rows, num))
    return LogprobsArrays(
        logprobs=jnp.concatenate([token_lp, top_lp], axis=1),
        token_ids=jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=1),
        ranks=jnp.concatenate([token_rank, top_ranks], axis=1),
    )


def to_token_logprobs(
    logprobs: np.ndarray,
    token_ids: np.ndarray,
    ranks: np.ndarray,
    num_logprobs: int | list[int],
) -> list[TokenLogprobs]:
    """Host side: rows of [X, 1 + N] numpy arrays -> one TokenLogprobs per row, each cut to its
    request's 1 + num_logprobs columns (the device computes MAX_LOGPROBS).

    Raises:
        ValueError: a num_logprobs larger than the N the device computed.
    """
    num_rows, width = np.shape(logprobs)
    nums = [num_logprobs] * num_rows if isinstance(num_logprobs, int) else list(num_logprobs)
    if len(nums) != num_rows or (nums and max(nums) + 1 > width):
        raise ValueError(
            f"to_token_logprobs: num_logprobs={num_logprobs} does not fit {num_rows} rows of "
            f"{width} columns (1 + N)"
        )
    lps, ids = np.asarray(logprobs).tolist(), np.asarray(token_ids).tolist()
    rks = np.asarray(ranks).tolist()
    return [
        TokenLogprobs(token_ids=i[: n + 1], logprobs=lp[: n + 1], ranks=r[: n + 1])
        for lp, i, r, n in zip(lps, ids, rks, nums, strict=True)
    ]
