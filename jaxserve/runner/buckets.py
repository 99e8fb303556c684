"""Padding buckets: the finite set of shapes the jitted step is compiled for.

A step's shapes are (T, R, B): tokens, request rows and block-table width. Each is rounded up
to a power of two (capped at its maximum), on the CPU T also to the midpoints 3 * 2^k between
them (6, 12, ..., 1536) and a single token to T=1, so steady-state serving reuses a small,
known set of compiled executables.
R is tied to T (R = min(T, padded max_num_seqs)): every scheduled request has at least one
token, so R <= T always holds, and tying them removes one bucket dimension (the extra logits
rows cost R x D x V flops, small next to the T-token forward).
"""

from __future__ import annotations

from dataclasses import dataclass

# The smallest T (but for the CPU's T=1, below). A step's dense layers cost about the same from
# 2 to a few tokens (they read every weight once), but not up to 16, and the tail of an offline
# run (a few long requests left) runs hundreds of steps with a handful of real tokens.
# Measurements: docs/benchmarks.md, "Design measurements".
MIN_TOKEN_BUCKET = 4

# On the CPU, T buckets also come at 3 * 2^k, between the powers of two: padding is then under
# 1.5x instead of 2x. There a step's cost follows the padded T at every size (the dense layers'
# GEMMs are compute-bound, and so are the logits rows and the sampler): small steps are mostly
# decodes, and mid-sized ones are common in a server at low load (a few arrivals' prompts
# prefilled together with the decodes: ~320 tokens padded to 512 set the p99 TTFT of
# bench/serve.py's lowest rate). The price is a few more buckets to compile at warm-up (one per
# power of two). On GPU / TPU small steps are bound by reading the weights, whatever T is, and
# large ones are prefill chunks that fill the token budget: no midpoints there.

# On the CPU, T=1 below MIN_TOKEN_BUCKET: a step of one token (a single request decoding, as in
# an interactive session or an offline run's last request) skips the dense layers' GEMMs of
# padding rows. Two or three tokens stay in T=4: XLA:CPU's GEMMs of 2-3 rows are no faster
# than of 4.


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to hi, with hi itself appended if it is not a power of two."""
    if lo < 1 or hi < 1:
        raise ValueError(f"bucket bounds must be >= 1, got lo={lo}, hi={hi}")
    out = []
    b = 1
    while b < lo:
        b *= 2
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def token_bucket_sizes(lo: int, hi: int, *, midpoints: bool = True) -> tuple[int, ...]:
    """pow2_buckets(lo, hi), plus (midpoints) 3 * 2^k for each power of two 2^(k+1) in it whose
    midpoint is below hi."""
    base = pow2_buckets(lo, hi)
    if not midpoints:
        return base
    mids = {b * 3 // 2 for b in base if b % 2 == 0 and b * 3 // 2 < hi}
    return tuple(sorted(set(base) | mids))


def round_up(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"value {value} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BucketSpec:
    """The bucket lists of one engine.

    token_buckets: T choices, MIN_TOKEN_BUCKET .. max_num_batched_tokens (token_bucket_sizes),
        with 1 first where single_token_bucket.
    max_rows: padded R cap (max_num_seqs rounded up to a power of two, >= 8).
    width_buckets: B choices (pages per sequence attention reads), 1 .. max_blocks_per_seq.
    """

    token_buckets: tuple[int, ...]
    max_rows: int
    width_buckets: tuple[int, ...]

    @classmethod
    def of_plan(
        cls,
        plan,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        *,
        length_bounded: bool,
        max_shapes: int | None,
    ) -> BucketSpec:
        """The buckets an ExecutionPlan (plan.py) asks for. An attention implementation whose
        cost stops at the batch's longest context (``length_bounded``) gets full-width tables:
        one compiled shape per token bucket, no width buckets."""
        return cls.create(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            bucket_width=not length_bounded,
            mid_token_buckets=plan.mid_token_buckets,
            single_token_bucket=plan.single_token_bucket,
            max_shapes=max_shapes,
        )

    @classmethod
    def create(
        cls,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        bucket_width: bool = True,
        mid_token_buckets: bool = False,
        single_token_bucket: bool = False,
        max_shapes: int | None = None,
    ) -> BucketSpec:
        """bucket_width=False: one width, the whole table (for attention backends whose cost
        follows the actual context lengths: KernelSpec.length_bounded in kernels.py).
        mid_token_buckets: also the 3 * 2^k token buckets (token_bucket_sizes; the CPU's).
        single_token_bucket: also T=1 below the smallest (the CPU's).
        max_shapes: at most this many (T, R, B) shapes where the widths allow: widths are
            thinned (every other one, the full table always kept) until they fit, down to one
            (the CPU's memory-map budget: map_budget.py)."""
        tokens = token_bucket_sizes(
            min(MIN_TOKEN_BUCKET, max_num_batched_tokens),
            max_num_batched_tokens,
            midpoints=mid_token_buckets,
        )
        if single_token_bucket and tokens[0] > 1:
            tokens = (1, *tokens)
        max_rows = max(8, 1 << (max_num_seqs - 1).bit_length())
        if bucket_width:
            width_buckets = pow2_buckets(1, max_blocks_per_seq)
        else:
            width_buckets = (max_blocks_per_seq,)
        if max_shapes is not None:
            width_buckets = _thin(width_buckets, max(1, max_shapes // len(tokens)))
        return cls(tokens, max_rows, width_buckets)

    def padded_tokens(self, num_tokens: int) -> int:
        return round_up(num_tokens, self.token_buckets)

    def padded_rows(self, padded_tokens: int) -> int:
        return min(padded_tokens, self.max_rows)

    def padded_width(self, num_blocks: int) -> int:
        return round_up(max(num_blocks, 1), self.width_buckets)

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, R, B) the step can be called with: what warm-up compiles."""
        return [(t, self.padded_rows(t), b) for t in self.token_buckets for b in self.width_buckets]


def _thin(widths: tuple[int, ...], most: int) -> tuple[int, ...]:
    """Every other width, counted down from the largest (always kept), until at most
    ``most`` are left (padding then costs up to 4x, 16x, ... instead of 2x)."""
    while len(widths) > most:
        widths = widths[::-1][::2][::-1]
    return widths
