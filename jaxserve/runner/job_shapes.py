"""Job-sized warm-up: the step shapes that a known set of requests can reach.

An offline job (``LLM.generate`` with a list, ``jaxserve generate``, ``run-batch``, ``score``)
knows its requests before its first step, so it need not compile every (T, R, B) bucket that
``max_num_batched_tokens`` and ``max_model_len`` allow (a server, which cannot know, does). This
module bounds, from the requests alone, every shape the scheduler can hand the runner while
they run, whatever it decides (chunked prefill, preemption by recomputation or swap, prefix
hits, ``n > 1`` forks, speculative drafts):

- T (padded tokens of a step). A step schedules at most ``max_num_batched_tokens`` tokens and
  no sequence more than it has left to compute. When the KV pool holds every sequence at its
  longest (``ceil((prompt + max_tokens + k) / block_size)`` blocks each, shared blocks counted
  once per holder: more than they take), no allocation fails, so nothing is preempted
  (preemption happens only then, scheduler._preempt_until_fits): a sequence has at most its
  prompt left while it prefills, and one token plus ``k`` speculative drafts a step after, so
  T <= ``sum over sequences of max(prompt, 1 + k)``. Otherwise a preempted sequence
  recomputes what it had, up to ``prompt + max_tokens`` tokens (plus drafts), and T <=
  ``sum over sequences of (prompt + max_tokens + k)``. Every token bucket up to that bound's
  padding can occur (the tail of a job steps down to T = 1).
- R follows T (buckets.py: R = min(T, max_rows)). The step's forward half compiles per
  (T, R, B), its sample half per (R, sampler variant) (WarmupSet.samples).
- B (block-table width). A row's width is ``ceil(seq_len / block_size)`` of its computed and
  scheduled tokens, at most ``prompt + max_tokens + k`` (capped by max_model_len): every width
  bucket up to that of the longest sequence can occur (any subset of sequences may be batched).
- Sampler variants (SamplingInputs.variant_widths): the list variant only when some request
  has a penalty, ``min_tokens``, allowed ids, a logit bias or a per-step mask (a grammar or bad
  words): ``needs_sampling_lists``, kept in step with SamplingInputs._gather_lists (a test
  checks every feature against it).
- Block copies (copy-on-write): only a fork (``n > 1``) shares a partly filled block, and a
  step copies at most one block per sequence it schedules: sizes up to the padded number of
  forked sequences (or max_num_seqs).

Everything else warm-up compiles (host KV tier copies, the KV connector's copies, a draft
model's proposals) is small and compiled in full. A shape outside the set would still compile
when met, with the warning of step_compiles.py; the tests assert that it never happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.runner.buckets import BucketSpec, round_up
from jaxserve.sampling_params import SamplingParams

Shape = tuple[int, int, int]  # (T, R, B)


@dataclass(frozen=True)
class JobRequest:
    """What warm-up needs to know of one request of a job."""

    num_prompt_tokens: int
    max_tokens: int  # SamplingParams.max_tokens
    n: int  # sequences it forks into (SamplingParams.n)
    needs_lists: bool  # the sampler's list variant (needs_sampling_lists)


@dataclass(frozen=True)
class WarmupSet:
    """What one warm-up compiles and runs: the step's forward half at each shape, its sample
    half at each row bucket of those shapes x sampler variants (``samples``), block copies."""

    shapes: tuple[Shape, ...]
    variants: tuple[tuple[int, int], ...]  # (penalty width, ban width) per sampler variant
    copy_sizes: tuple[int, ...]  # padded block-copy counts

    @property
    def samples(self) -> tuple[tuple[int, tuple[int, int]], ...]:
        """(R, sampler widths) of the sample half: every row bucket of ``shapes`` in every
        variant, the smallest R first."""
        rows = sorted({r for _, r, _ in self.shapes})
        return tuple((r, w) for r in rows for w in self.variants)

    @property
    def steps(self) -> tuple[tuple[Shape, tuple[int, int]], ...]:
        """(shape, sampler widths) of the fused step (fused_step.py): every shape in every
        variant."""
        return tuple((shape, w) for shape in self.shapes for w in self.variants)

    def parts(self) -> tuple[WarmupSet, WarmupSet]:
        """(the shapes the CPU's plan runs fused, fused_shape; the others, split), each with
        the variants, the block copies with the second."""
        fused = tuple(s for s in self.shapes if fused_shape(s))
        split = tuple(s for s in self.shapes if not fused_shape(s))
        return WarmupSet(fused, self.variants, ()), WarmupSet(split, self.variants, self.copy_sizes)

    def num_step_compilations(self, fused: bool) -> int:
        """The step's compilations this set causes from nothing (block copies included): a
        forward per shape and a sample per row bucket and variant; with the plan's fused step,
        one fused program per variant of each fused_shape instead."""
        if not fused:
            return len(self.shapes) + len(self.samples) + len(self.copy_sizes)
        together, apart = self.parts()
        return len(together.steps) + apart.num_step_compilations(False)


# The largest token bucket the plan's fused step runs fused (fused_shape).
FUSED_MAX_TOKENS = 64


def fused_shape(shape: Shape) -> bool:
    """Whether the plan's fused step (fused_step.py) runs a (T, R, B) shape as one program:
    the shapes of at most FUSED_MAX_TOKENS tokens with a logits row per token (T == R: the
    decode buckets and the smallest prefills), whose steps are short enough for a second
    launch to weigh (0.2-0.6 ms on the CPU) and whose row bucket is theirs alone, so a job's
    warm-up compiles the sampler as often as split. The others run split: the sampler
    compiles once per row bucket there, not once per shape."""
    return shape[0] == shape[1] <= FUSED_MAX_TOKENS


def needs_sampling_lists(params: SamplingParams, has_step_mask: bool) -> bool:
    """Whether a request's rows can take the sampler's list variant: a penalty, a ban
    (``min_tokens``), allowed ids, a logit bias, or a per-step mask (``has_step_mask``: a
    grammar or bad words, CheckedRequest.constraints)."""
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_tokens > 0
        or params.allowed_token_ids is not None
        or bool(params.logit_bias)
        or has_step_mask
    )


def job_request(num_prompt_tokens: int, params: SamplingParams, has_step_mask: bool) -> JobRequest:
    """The JobRequest of a checked prompt and its params."""
    return JobRequest(
        num_prompt_tokens, params.max_tokens, params.n, needs_sampling_lists(params, has_step_mask)
    )


def job_warmup_set(
    requests: Sequence[JobRequest],
    buckets: BucketSpec,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    variant_widths: Sequence[tuple[int, int]],
    copy_sizes: Sequence[int],
    num_spec_tokens: int = 0,
    num_usable_blocks: int | None = None,
) -> WarmupSet:
    """The shapes, sampler variants and block copies that ``requests`` can reach (the module
    docstring gives the bounds); a subset of the full set of ``buckets``.

    Args:
        variant_widths: the runner's two variants, without lists first.
        copy_sizes: the runner's padded block-copy sizes, ascending.
        num_spec_tokens: speculative drafts per request and step (k), 0 without.
        num_usable_blocks: KV blocks the scheduler can allocate (the null block excluded);
            None: unknown (the bound that allows preemption).

    Raises:
        ValueError: no request.
    """
    if not requests:
        raise ValueError("job_warmup_set: no request")
    longest = total = total_blocks = prefill = 0
    for r in requests:
        seq = min(r.num_prompt_tokens + r.max_tokens, max_model_len) + num_spec_tokens
        longest = max(longest, seq)
        total += r.n * seq
        total_blocks += r.n * -(-seq // block_size)
        prefill += r.n * max(r.num_prompt_tokens, 1 + num_spec_tokens)
    if num_usable_blocks is not None and total_blocks <= num_usable_blocks:
        total = prefill  # no preemption: nothing is recomputed
    max_t = buckets.padded_tokens(min(total, max_num_batched_tokens))
    widths = buckets.width_buckets
    max_b = round_up(min(-(-longest // block_size), widths[-1]), widths)
    shapes = tuple(s for s in buckets.all_shapes() if s[0] <= max_t and s[2] <= max_b)
    lists = any(r.needs_lists for r in requests)
    variants = tuple(variant_widths) if lists else (tuple(variant_widths[0]),)
    forked = sum(r.n for r in requests if r.n > 1)
    copies = tuple(c for c in copy_sizes if c < 2 * forked)  # up to forked, padded
    return WarmupSet(shapes, variants, copies)
