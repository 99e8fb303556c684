"""SpecDecoder: what EngineCore calls to speculate: after each step, the next step's drafts.

It owns the proposer (one per method) and the policy, and decides which running requests may
carry drafts: decodes (every known token but the last computed) whose sampling the target can
verify position by position exactly. Requests with presence, frequency or repetition penalties
are verified without drafts: their penalty counts would have to include the drafts before each
position, which the sampler's per-request penalty lists do not. They are served exactly, one
token per step, while the others speculate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.ngram_proposer import NgramProposer
from jaxserve.spec_decode.policy import SpecPolicy
from jaxserve.spec_decode.suffix_proposer import SuffixProposer
from jaxserve.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, requests: Iterable[Request], k: int) -> dict[str, list[int]]:
        """Up to k drafts for each of the given running decodes (none where it has no guess)."""
        ...

    # Optional: ``samples_drafts(request) -> bool``, whether the request's drafts are drawn
    # from a distribution (a draft model's, verified by the general-q rule) rather than
    # one-hot guesses; a proposer without it proposes one-hot drafts only.


def host_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a host-side method ("ngram", "suffix"); a draft model's is the
    runner's (runner/draft_model.py)."""
    if config.method == "suffix":
        return SuffixProposer(
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    return NgramProposer(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )


def decode_share(num_scheduled: dict[str, int], drafts: dict[str, list[int]]) -> float:
    """The share of a step's scheduled tokens that decodes (1 + their drafts each) took; prefill
    chunks took the rest."""
    total = sum(num_scheduled.values())
    decode = sum(n for rid, n in num_scheduled.items() if n == 1 + len(drafts.get(rid, ())))
    return decode / total if total else 0.0


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request with these parameters may carry drafts (module docstring)."""
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
    )


class SpecDecoder:
    """Proposes drafts for the running decodes, as the policy allows.

    Args:
        config: the validated speculative_config.
        proposer: what proposes the drafts (``propose(requests, k) -> {req_id: drafts}``);
            default: the one config.method names.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer or host_proposer(config)
        self.policy = SpecPolicy(config)
        self.proposer_seconds = 0.0  # host time in the proposer, all calls (get_stats)

    def propose(self, running: Iterable[Request]) -> dict[str, list[int]]:
        """The next step's drafts by request id (requests without a proposal left out)."""
        running = list(running)
        k = self.policy.num_drafts(len(running))
        if not k:
            return {}
        eligible = [
            r
            for r in running
            if r.num_computed_tokens == len(r.all_token_ids) - 1
            and can_speculate(r.sampling_params)
        ]
        start = time.perf_counter()
        drafts = self.proposer.propose(eligible, k)
        self.proposer_seconds += time.perf_counter() - start
        return drafts

    def drafts_sampled(self, request: Request) -> bool:
        """Whether ``request``'s drafts are sampled (not one-hot): constraints never cut those
        (structured/draft_checks.py)."""
        samples = getattr(self.proposer, "samples_drafts", None)
        return bool(samples is not None and samples(request))

    def observe_step(
        self, num_emitted: int, seconds: float, num_scheduled: dict[str, int],
        drafts: dict[str, list[int]],
    ) -> None:  # fmt: skip
        """A step's output tokens and wall time (the policy's measured throughput), weighed by
        the share of its scheduled tokens (``num_scheduled``, by request) that decodes and
        their ``drafts`` took."""
        self.policy.observe_step(num_emitted, seconds, decode_share(num_scheduled, drafts))
