"""SamplingMetadata (the per-step device pytree) and SamplingInputs (its host-side builder).

The runner keeps one SamplingInputs for its persistent batch: a row of numpy buffers per slot
(slot = a row of the persistent batch, ``0 <= slot < max_num_seqs``), written when a request
enters a slot and when it gains an output token. Each step ``build`` gathers the rows that sample
into padded host arrays in a handful of vectorised numpy gathers; the runner device_puts them and
passes them to ``sampler.sample`` inside its one jitted step.

Shapes (glossary letters): R rows that sample (padded to the request bucket), V vocab,
W penalty-list width, B banned-list width. W and B are shapes, hence static under jit. Each takes
two values only: 0 when no row of the batch needs the lists (a batch without penalties or
min_tokens pays nothing for them), else one fixed width that every request the engine accepts
fits (``SamplingInputs.variant_widths``), so that warm-up compiles every width there is and no
request compiles mid-run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.runner.neutral_lists import NeutralLists
from jaxserve.runner.penalty_lists import PenaltyLists
from jaxserve.runner.token_constraints import ALL_ALLOWED, ConstraintRows, bitmask_words
from jaxserve.sampling_constraints import MAX_LOGIT_BIAS_TOKENS
from jaxserve.sampling_params import MAX_BANNED_STOP_TOKEN_IDS, SamplingParams

# vLLM's _SAMPLING_EPS: a temperature below it is greedy (dividing by it would overflow f32).
GREEDY_TEMPERATURE_EPS = 1e-5


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings of one step. All fields are data (traced): a new combination
    of settings never compiles; only the widths W and B (shapes) select a compiled variant, and
    a batch has either both 0 (no row with a penalty or a ban) or both at their one fixed width
    (SamplingInputs.variant_widths), so that warm-up compiles both variants of every batch shape.

    Padding rows carry neutral values (greedy, no masks, no penalties, no bans), so they cost
    nothing but their share of the [R, V] arithmetic.
    """

    temperature: jax.Array  # f32[R] 0 = greedy (set by the builder below GREEDY_TEMPERATURE_EPS)
    top_k: jax.Array  # i32[R] in [1, V]; V = disabled
    top_p: jax.Array  # f32[R] in (0, 1]; 1 = disabled
    min_p: jax.Array  # f32[R] in [0, 1]; 0 = disabled
    presence_penalty: jax.Array  # f32[R] subtracted once from each token present in the outputs
    frequency_penalty: jax.Array  # f32[R] subtracted per occurrence in the outputs
    repetition_penalty: jax.Array  # f32[R] over prompt + outputs: positive / rp, negative * rp
    seeds: jax.Array  # u32[R, 2] request seed (63-bit) as (hi, lo) 32-bit words
    output_pos: jax.Array  # i32[R] output index of the token being sampled (0 = the first)
    num_logprobs: jax.Array  # i32[R] top-N logprobs the row asked for; -1: none
    # Distinct token ids of prompt + outputs so far, for rows with a penalty; -1 pads (each
    # row's real ids come first and are unique within the row). Rows without penalties: all -1.
    penalty_token_ids: jax.Array  # i32[R, W]
    penalty_output_counts: jax.Array  # i32[R, W] occurrences among outputs (0: prompt only, pad)
    # Token ids that must not be sampled (EOS and stop ids while output_pos < min_tokens); -1 pads.
    banned_token_ids: jax.Array  # i32[R, B]
    # Token constraints (token_constraints.py), widths 0 or full with the lists above:
    # allowed tokens (allowed_token_ids, grammars, bad words), all ones when unconstrained;
    token_bitmask: jax.Array  # u32[R, M] M = ceil(V / 32); bit t % 32 of word t // 32
    # logit_bias: ids (-1 pads) and the values added to their logits.
    bias_token_ids: jax.Array  # i32[R, NB]
    bias_values: jax.Array  # f32[R, NB]

    @classmethod
    def neutral(
        cls, num_rows: int, vocab_size: int, *, penalty_width: int = 0, ban_width: int = 0
    ) -> SamplingMetadata:
        """Host (numpy) metadata of ``num_rows`` neutral rows: greedy, no masks, no penalties.

        For warm-up: compiling ``sample`` with these shapes compiles the variant a real batch of
        the same R, W and B uses (SamplingInputs.variant_widths: the two every batch can take);
        the token constraints are full width exactly when a list is.
        """
        lists = penalty_width > 0 or ban_width > 0
        words = bitmask_words(vocab_size) if lists else 0
        bias_width = MAX_LOGIT_BIAS_TOKENS if lists else 0
        return cls(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.full(num_rows, vocab_size, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            presence_penalty=np.zeros(num_rows, np.float32),
            frequency_penalty=np.zeros(num_rows, np.float32),
            repetition_penalty=np.ones(num_rows, np.float32),
            seeds=np.zeros((num_rows, 2), np.uint32),
            output_pos=np.zeros(num_rows, np.int32),
            num_logprobs=np.full(num_rows, -1, np.int32),
            penalty_token_ids=np.full((num_rows, penalty_width), -1, np.int32),
            penalty_output_counts=np.zeros((num_rows, penalty_width), np.int32),
            banned_token_ids=np.full((num_rows, ban_width), -1, np.int32),
            token_bitmask=np.full((num_rows, words), ALL_ALLOWED, np.uint32),
            bias_token_ids=np.full((num_rows, bias_width), -1, np.int32),
            bias_values=np.zeros((num_rows, bias_width), np.float32),
        )


def _widen(lists: np.ndarray, width: int, pad: int) -> np.ndarray:
    """i32[R, w] -> i32[R, max(w, width)], padded with ``pad`` (a fill and a copy: faster
    than np.pad at the widths of long contexts)."""
    if lists.shape[1] >= width:
        return lists
    out = np.full((lists.shape[0], width), pad, lists.dtype)
    out[:, : lists.shape[1]] = lists
    return out


class SamplingInputs:
    """Persistent per-slot numpy buffers of sampling settings, and the per-step builder.

    Penalty lists (penalty_lists.py): for a slot whose request has a penalty, the distinct ids of
    prompt + outputs with their output counts. Slots without penalties track nothing.
    Ban lists: for a slot whose request has ``min_tokens > 0``, EOS (unless ignore_eos) and the
    stop token ids; ``build`` emits them only for rows with ``output_pos < min_tokens``.

    Compiled variants (``variant_widths``): a batch with no penalty row and no banned row uses
    W = B = 0, any other W = penalty_capacity = min(max_model_len + 1, V) (every distinct token a
    request can hold) and B = ban_width = MAX_BANNED_STOP_TOKEN_IDS + the number of EOS ids
    (SamplingParams refuses more stop ids with min_tokens). Fixed widths cost a wider host gather
    and transfer in batches with penalties, i32[R, W] twice, but no compilation mid-run.
    Token constraints (token_constraints.py: allowed ids, logit_bias, the step's grammar and
    bad-word masks) ride in the same variant: a batch with a constrained row takes the full
    widths of every list, and the lists' batches carry an all-ones bitmask u32[R, ceil(V / 32)]
    and empty biases i32 / f32[R, MAX_LOGIT_BIAS_TOKENS].

    Row ``max_num_seqs`` is a hidden neutral slot: padding rows gather from it.
    """

    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("vocab_size", vocab_size),
            ("max_model_len", max_model_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SamplingInputs.{name} must be an int >= 1, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        # Prompt + outputs hold at most max_model_len + 1 tokens (a prompt of max_model_len
        # tokens samples one more), hence at most that many distinct ones.
        self.penalty_capacity = min(max_model_len + 1, vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        # The banned ids of a row: its stop ids (SamplingParams caps them) and EOS, deduplicated.
        self.ban_width = MAX_BANNED_STOP_TOKEN_IDS + len(self.eos_token_ids)
        # The (W, B) list widths of the sampler's two compiled variants per batch shape.
        self.variant_widths = ((0, 0), (self.penalty_capacity, self.ban_width))
        n = max_num_seqs + 1  # + the neutral slot
        self._temperature = np.zeros(n, np.float32)
        self._top_k = np.full(n, vocab_size, np.int32)
        self._top_p = np.ones(n, np.float32)
        self._min_p = np.zeros(n, np.float32)
        self._presence = np.zeros(n, np.float32)
        self._frequency = np.zeros(n, np.float32)
        self._repetition = np.ones(n, np.float32)
        self._seeds = np.zeros((n, 2), np.uint32)
        self._num_logprobs = np.full(n, -1, np.int32)  # -1 = logprobs not asked
        self._min_tokens = np.zeros(n, np.int32)
        self._penalties = PenaltyLists(n, self.penalty_capacity)
        self._num_banned = np.zeros(n, np.int32)
        self._banned = np.zeros((n, self.ban_width), np.int32)
        # The list variant's neutral lists, made once per row count (neutral_lists.py; the
        # runner swaps them for their device copies: NeutralLists.on_device).
        self.neutral = NeutralLists(self.penalty_capacity, self.ban_width)
        self._constraints = ConstraintRows(vocab_size, self.neutral)
        self.num_mask_words = self._constraints.num_words  # M of a token bitmask row

    # ----- per-request updates (host, once per request or per token) -----

    def set_request(
        self,
        slot: int,
        params: SamplingParams,
        seed: int,
        prompt_token_ids: Sequence[int] | np.ndarray,
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Put a request in ``slot``, replacing whatever was there.

        Args:
            seed: the request's sampling seed in [0, 2**63): ``params.seed`` when set, else one the
                runner drew for the request (kept across preemption, so tokens do not change).
            output_token_ids: tokens already generated (a preempted request coming back).
        Raises:
            ValueError: slot or seed out of range, a token id outside [0, vocab_size), more
                distinct tokens than the penalty capacity, or more banned ids than ban_width.
        """
        self._check_slot(slot)
        banned = self._ban_list(params)  # checked before anything changes
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"SamplingInputs.set_request: seed must be an int, got {seed!r}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"SamplingInputs.set_request: seed must be in [0, 2**63), got {seed}")
        prompt = self._check_tokens("prompt_token_ids", prompt_token_ids)
        outputs = self._check_tokens("output_token_ids", output_token_ids)
        has_penalty = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        if has_penalty:  # first: the one step that can still raise
            self._penalties.set(slot, prompt, outputs)
        else:
            self._penalties.reset(slot)
        greedy = params.temperature < GREEDY_TEMPERATURE_EPS
        self._temperature[slot] = 0.0 if greedy else params.temperature
        # A greedy row ignores the masks; neutral values keep it from switching on the top-k /
        # top-p path of the batch (sampler.sample skips that path when no row needs it).
        top_k = -1 if greedy else params.top_k
        self._top_k[slot] = self.vocab_size if top_k == -1 else min(top_k, self.vocab_size)
        self._top_p[slot] = 1.0 if greedy else params.top_p
        self._min_p[slot] = 0.0 if greedy else params.min_p
        self._presence[slot] = params.presence_penalty
        self._frequency[slot] = params.frequency_penalty
        self._repetition[slot] = params.repetition_penalty
        self._seeds[slot] = (int(seed) >> 32, int(seed) & 0xFFFFFFFF)
        self._num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._min_tokens[slot] = params.min_tokens
        self._banned[slot, : len(banned)] = banned
        self._num_banned[slot] = len(banned)
        self._constraints.set(slot, params)

    def append_output_token(self, slot: int, token: int) -> None:
        """Record a sampled token of the request in ``slot`` (only penalty slots keep them)."""
        self._check_slot(slot)
        if self._penalties.tracked[slot]:
            self._penalties.append([slot], [token])

    def append_output_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Batched ``append_output_token`` (the per-step path): a vectorised filter, then a dict
        look-up per token of a penalty slot only (usually none)."""
        slots, tokens = np.asarray(slots), np.asarray(tokens)
        tracked = self._penalties.tracked[slots]
        if tracked.any():
            self._penalties.append(slots[tracked].tolist(), tokens[tracked].tolist())

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (the request finished or was preempted): back to neutral settings."""
        self._check_slot(slot)
        neutral = self.max_num_seqs
        for buf in (
            self._temperature, self._top_k, self._top_p, self._min_p, self._presence,
            self._frequency, self._repetition, self._seeds, self._num_logprobs, self._min_tokens,
        ):  # fmt: skip
            buf[slot] = buf[neutral]
        self._penalties.reset(slot)
        self._num_banned[slot] = 0
        self._constraints.reset(slot)

    # ----- per step -----

    def build(
        self,
        slot_indices: np.ndarray,
        padded_rows: int,
        output_positions: np.ndarray,
        step_masks: Mapping[int, np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """Gather the rows that sample this step into fresh host arrays (the runner device_puts
        them; fresh so that a zero-copy device_put never aliases a buffer we later mutate).

        Args:
            slot_indices: i32[num_rows] the slot of each sampling row, in batch order.
            padded_rows: R, the request bucket (>= num_rows); rows past num_rows are neutral.
            output_positions: i32[num_rows] output index of the token each row samples.
            step_masks: slot -> u32[M] this step's allowed tokens of a constrained request
                (grammars, bad words: SchedulerOutput.token_masks); None: none.
        Returns:
            SamplingMetadata of numpy arrays, R rows.
        Raises:
            ValueError: mismatched lengths, padded_rows < num_rows, a slot out of range.
        """
        slots, pos = self._check_rows(slot_indices, padded_rows, output_positions)
        num_rows = slots.shape[0]
        idx = np.full(padded_rows, self.max_num_seqs, np.int64)
        idx[:num_rows] = slots
        padded_pos = np.zeros(padded_rows, np.int32)
        padded_pos[:num_rows] = pos
        lists = self._gather_lists(idx, padded_pos, slots, step_masks or {})
        ids, counts, banned, bitmask, bias_ids, bias_values = lists
        return SamplingMetadata(
            temperature=self._temperature[idx],
            top_k=self._top_k[idx],
            top_p=self._top_p[idx],
            min_p=self._min_p[idx],
            presence_penalty=self._presence[idx],
            frequency_penalty=self._frequency[idx],
            repetition_penalty=self._repetition[idx],
            seeds=self._seeds[idx],
            output_pos=padded_pos,
            num_logprobs=self._num_logprobs[idx],
            penalty_token_ids=ids,
            penalty_output_counts=counts,
            banned_token_ids=banned,
            token_bitmask=bitmask,
            bias_token_ids=bias_ids,
            bias_values=bias_values,
        )

    # ----- helpers -----

    def _check_rows(
        self, slot_indices: np.ndarray, padded_rows: int, output_positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """build's arguments checked: (slots i64[num_rows], positions i32[num_rows])."""
        slots = np.asarray(slot_indices, np.int64)
        pos = np.asarray(output_positions, np.int32)
        num_rows = slots.shape[0]
        if slots.ndim != 1 or pos.shape != slots.shape:
            raise ValueError(
                f"SamplingInputs.build: slot_indices {slots.shape} and output_positions "
                f"{pos.shape} must be 1-D of the same length"
            )
        if padded_rows < num_rows:
            raise ValueError(
                f"SamplingInputs.build: padded_rows={padded_rows} < num_rows={num_rows}"
            )
        if num_rows and not (0 <= slots.min() and slots.max() < self.max_num_seqs):
            raise ValueError(
                f"SamplingInputs.build: slot_indices must be in [0, {self.max_num_seqs}), "
                f"got [{slots.min()}, {slots.max()}]"
            )
        return slots, pos

    def _gather_lists(
        self,
        idx: np.ndarray,
        pos: np.ndarray,
        slots: np.ndarray,
        step_masks: Mapping[int, np.ndarray],
    ) -> tuple[np.ndarray, ...]:
        """The rows' penalty lists, ban lists and token constraints: every list at its fixed
        width when some row has one, all at width 0 otherwise (the sampler's two variants)."""
        padded_rows = idx.shape[0]
        ids, counts = self._penalties.gather(idx)
        banned = self._gather_ban_lists(idx, pos)
        constrained = bool(step_masks) or self._constraints.any_in(slots)
        if not (ids.shape[1] or banned.shape[1] or constrained):
            bitmask = np.full((padded_rows, 0), ALL_ALLOWED, np.uint32)
            bias_ids = np.full((padded_rows, 0), -1, np.int32)
            bias_values = np.zeros((padded_rows, 0), np.float32)
            return ids, counts, banned, bitmask, bias_ids, bias_values
        if ids.shape[1]:
            width = self.penalty_capacity
            ids, counts = _widen(ids, width, -1), _widen(counts, width, 0)
        else:  # no penalty row: the batch's lists are there for another row's needs
            neutral = self.neutral.host(padded_rows)
            ids, counts = neutral.penalty_token_ids, neutral.penalty_output_counts
        if banned.shape[1]:
            banned = _widen(banned, self.ban_width, -1)
        else:
            banned = self.neutral.host(padded_rows).banned_token_ids
        return (ids, counts, banned, *self._constraints.gather(idx, step_masks))

    def _gather_ban_lists(self, idx: np.ndarray, pos: np.ndarray) -> np.ndarray:
        num = np.where(pos < self._min_tokens[idx], self._num_banned[idx], 0)  # i32[R]
        width = self.ban_width if num.max() else 0
        live = np.arange(width) < num[:, None]  # bool[R, B]
        return np.where(live, self._banned[idx, :width], -1).astype(np.int32, copy=False)

    def _ban_list(self, params: SamplingParams) -> list[int]:
        """The ids a request bans while output_pos < min_tokens (none without min_tokens)."""
        if params.min_tokens == 0:
            return []
        banned = set(params.all_stop_token_ids)
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        # An id outside the vocabulary can never be sampled, so banning it is vacuous.
        ids = sorted(t for t in banned if t < self.vocab_size)
        if len(ids) > self.ban_width:  # SamplingParams caps the stop ids; a mutated copy
            raise ValueError(
                f"SamplingInputs.set_request: {len(ids)} banned ids (stop_token_ids and EOS with "
                f"min_tokens > 0) exceed ban_width={self.ban_width}"
            )
        return ids

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(
                f"SamplingInputs: slot must be in [0, {self.max_num_seqs}), got {slot}"
            )

    def _check_tokens(self, name: str, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(tokens, np.int64).reshape(-1)
        if arr.size and not (0 <= arr.min() and arr.max() < self.vocab_size):
            raise ValueError(
                f"SamplingInputs.set_request: {name} must be in [0, {self.vocab_size}), "
                f"got [{arr.min()}, {arr.max()}]"
            )
        return arr
