"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated (host side, no jax).

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` turns on
speculative decoding: a proposer guesses up to k next tokens of a running request, the target
model scores all 1 + k positions in the same ragged batch as every other request, and the
rejection sampler keeps the longest prefix the target agrees with plus one token of its own
(jaxserve/spec_decode/). Every key is checked before anything loads; an unknown key, a method
jaxserve lacks, or a value out of range is a ValueError naming the key, the value and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Methods jaxserve implements. vLLM also has "eagle", "eagle3", "mtp" and "medusa": named here
# so that their refusal says what is missing, not "unknown".
SPEC_METHODS = ("ngram", "suffix", "draft_model")
NOT_IMPLEMENTED_METHODS = ("eagle", "eagle3", "mtp", "medusa")
# "suffix" settings (vLLM's names) and their defaults: tree depth, finished requests whose
# outputs stay in the engine-wide tree (vLLM: 10000; a Python tree of 24-token paths costs
# about 0.1 kB a node, so the default here is lower), draft length per matched token, and the
# least running probability of a drafted continuation.
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 1000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
MAX_SPECULATIVE_TOKENS = 32  # k: drafts per request per step
# The automatic policy's modes: "auto" speculates only while the measured cost model says it
# gains (spec_decode/policy.py); "always" speculates at every batch size.
SPEC_POLICIES = ("auto", "always")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's names).

    method: SPEC_METHODS. "ngram" is prompt lookup: the longest suffix of the request's tokens
        (prompt and outputs) of prompt_lookup_max down to prompt_lookup_min tokens that occurred
        earlier proposes the tokens that followed it. "suffix": suffix decoding, the most
        frequent continuations of the longest matching suffix in the request's own tokens and
        in the engine's earlier outputs (spec_decode/suffix_proposer.py). "draft_model": a
        smaller model (``model``) proposes k tokens (runner/draft_model.py).
    model: the draft model of "draft_model" (any checkpoint jaxserve loads, with the target's
        vocabulary); refused with "ngram".
    num_speculative_tokens: k, the most drafts a request verifies per step, 1..32.
    prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first.
    disable_by_batch_size: vLLM's switch: no speculation while more requests than this are
        running (None: no such cap).
    policy: SPEC_POLICIES; "auto" also stops speculating where the measured throughput with
        drafts is lower than without, and resumes when the batch shrinks.
    suffix_decoding_*: "suffix" only (SUFFIX_DEFAULTS): max_tree_depth 1..1024,
        max_cached_requests >= 0, max_spec_factor > 0, min_token_prob in [0, 1].
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    policy: str = "auto"
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None

    def __post_init__(self) -> None:
        owner = "speculative_config"
        if self.method in NOT_IMPLEMENTED_METHODS:
            raise ValueError(
                f"{owner}['method']={self.method!r} is not implemented in jaxserve; "
                f"implemented: {list(SPEC_METHODS)}"
            )
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"{owner}['method'] must be one of {list(SPEC_METHODS)}, got {self.method!r}"
            )
        _int_in(owner, "num_speculative_tokens", self.num_speculative_tokens, 1,
                MAX_SPECULATIVE_TOKENS)  # fmt: skip
        _int_in(owner, "prompt_lookup_min", self.prompt_lookup_min, 1, 1 << 20)
        _int_in(owner, "prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 1 << 20)
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                f"{owner}['model'] must name the draft model (a checkpoint folder, a Hub ID or "
                f"a built-in name) for method 'draft_model', got {self.model!r}"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f"{owner}['model']={self.model!r} is for method 'draft_model', not {self.method!r}"
            )
        if self.disable_by_batch_size is not None:
            _int_in(owner, "disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 30)
        if self.policy not in SPEC_POLICIES:
            raise ValueError(
                f"{owner}['policy'] must be one of {list(SPEC_POLICIES)}, got {self.policy!r}"
            )
        self._check_suffix(owner)

    def _check_suffix(self, owner: str) -> None:
        """The suffix_decoding_* keys: refused for other methods, defaulted and checked for
        "suffix"."""
        for name, default in SUFFIX_DEFAULTS.items():
            value = getattr(self, name)
            if self.method != "suffix":
                if value is not None:
                    raise ValueError(
                        f"{owner}[{name!r}]={value!r} is for method 'suffix', not {self.method!r}"
                    )
                continue
            if value is None:
                object.__setattr__(self, name, value := default)
            if name.endswith(("depth", "requests")):
                low = 1 if name.endswith("depth") else 0
                _int_in(owner, name, value, low, 1024 if low else 1 << 30)
            else:
                _float_in(owner, name, value, name.endswith("prob"))

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """``speculative_config`` as LLM(...) takes it: None (off), a dict of vLLM's keys, or a
        SpeculativeConfig.

        Raises:
            TypeError: not a dict (or SpeculativeConfig, or None).
            ValueError: an unknown key (the known ones listed), a missing "method", a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                f"speculative_config must be a dict such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 4}}, got {type(value).__name__}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {known}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method', one of {list(SPEC_METHODS)}")
        return cls(**value)


def _float_in(owner: str, name: str, value: object, probability: bool) -> None:
    """A probability in [0, 1], or a factor > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}[{name!r}] must be a number, got {value!r}")
    if probability and not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}[{name!r}] must be in [0, 1], got {value}")
    if not probability and not 0.0 < value < float("inf"):
        raise ValueError(f"{owner}[{name!r}] must be a finite number > 0, got {value}")


def _int_in(owner: str, name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}[{name!r}] must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}[{name!r}] must be in [{lo}, {hi}], got {value}")
