"""Speculative decoding: proposers that guess a running request's next tokens, and the policy
that decides when guessing pays (host side, no jax).

The target verifies the guesses in its ordinary step (runner/rejection_sampler.py); the
scheduler only counts them as tokens (core/sched/spec_tokens.py). EngineCore asks the
SpecDecoder for the next step's drafts after each step.
"""

from jaxserve.spec_decode.ngram_proposer import NgramProposer
from jaxserve.spec_decode.policy import SpecPolicy
from jaxserve.spec_decode.spec_decoder import SpecDecoder
from jaxserve.spec_decode.suffix_proposer import SuffixProposer

__all__ = ["NgramProposer", "SpecDecoder", "SpecPolicy", "SuffixProposer"]
