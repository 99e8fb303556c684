"""SamplingParams: how one prompt is sampled. Validated at construction (docs/architecture.md)."""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any

from jaxserve.kv_transfer_config import check_kv_transfer_params
from jaxserve.sampling_constraints import (
    StructuredOutputsParams,
    check_allowed_token_ids,
    check_bad_words,
    check_logit_bias,
    check_structured_outputs,
)

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20  # top-N logprobs cap, as in vLLM's default max_logprobs
# Stop token ids a request with min_tokens > 0 may name: each is banned until min_tokens
# outputs, and the sampler's ban list has one fixed width (this cap plus the model's EOS ids),
# so that warm-up compiles it and no request compiles a wider one mid-run.
MAX_BANNED_STOP_TOKEN_IDS = 64


def _check_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"SamplingParams.{name} must be an int, got {value!r} ({type(value).__name__})"
        )


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"SamplingParams.{name} must be a number, got {value!r} ({type(value).__name__})"
        )


class RequestOutputKind(enum.Enum):
    """What each streamed RequestOutput of a request holds (vLLM's names): everything so far,
    only what is new since the previous one, or only the final output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling settings of one request, with vLLM's names and meanings.

    ``temperature == 0`` means greedy. Penalties follow vLLM: presence and frequency penalties act
    on the request's output tokens, the repetition penalty on prompt and output tokens. A seeded
    request draws token ``i`` from a key derived from ``(seed, i)``, so it gives the same tokens
    in any batch and after preemption.

    Raises:
        ValueError / TypeError at construction, naming the field, the value and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Streaming (AsyncLLM.generate, LLM.stream); LLM.generate returns final outputs whatever
    # this says, as vLLM's LLM does.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # What may be sampled (sampling_constraints.py): a grammar, a bias per token id, the only
    # ids allowed, words never produced. Token ids are checked against the vocabulary, and a
    # grammar compiled, when the request is queued.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # The KV connector's per-request settings (vLLM's kv_transfer_params, which vLLM carries
    # in extra_args): kv_transfer_config.check_kv_transfer_params gives the keys.
    kv_transfer_params: dict[str, Any] | None = None
    # Normalised views filled by __post_init__.
    stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)
    all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_logprobs_and_penalties()
        self.stop_strings = self._normalise_stop(self.stop)
        self.all_stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.min_tokens > 0 and len(self.all_stop_token_ids) > MAX_BANNED_STOP_TOKEN_IDS:
            raise ValueError(
                f"SamplingParams.stop_token_ids: at most {MAX_BANNED_STOP_TOKEN_IDS} distinct ids "
                f"with min_tokens > 0 (each is banned until min_tokens outputs), got "
                f"{len(self.all_stop_token_ids)} with min_tokens={self.min_tokens}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {value!r}")
        self.structured_outputs = check_structured_outputs(self.structured_outputs)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.allowed_token_ids = check_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = check_bad_words(self.bad_words)
        self.kv_transfer_params = check_kv_transfer_params(self.kv_transfer_params)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                "SamplingParams.output_kind must be a RequestOutputKind "
                f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}"
            )

    def _check_sampling(self) -> None:
        """n, the sampling knobs, the seed and the length bounds (each field named)."""
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        _check_number("temperature", self.temperature)
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(
                f"SamplingParams.top_k must be -1 (disabled) or >= 1, got {self.top_k}"
            )
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )

    def _check_logprobs_and_penalties(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(
                    f"SamplingParams.{name} must be in [0, {MAX_LOGPROBS}], got {value}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                "SamplingParams.repetition_penalty must be in (0, 10], got "
                f"{self.repetition_penalty}"
            )

    def __setattr__(self, name: str, value: object) -> None:
        """Refuse a name that is no field: a misspelled ``sp.temprature = 0`` would otherwise
        sample at temperature 1 without a word. (Unpickling and copying restore ``__dict__``
        directly and ``replace`` goes through __init__, so neither passes here with a stray
        name.)

        Raises:
            AttributeError: ``name`` is not a field, naming the closest field when there is one.
        """
        if name not in _FIELD_NAMES:
            close = difflib.get_close_matches(name, _FIELD_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(
                f"SamplingParams has no field {name!r}{hint} (fields: {', '.join(_FIELD_NAMES)})"
            )
        super().__setattr__(name, value)

    def clone(self) -> SamplingParams:
        """A validated copy of the current field values, sharing no list with this one.

        SamplingParams stays mutable, as vLLM's is; the engine clones the params of every
        request it queues, so a field set after construction is checked (and honoured) then,
        and changing the object later never reaches a request already queued.

        Raises:
            ValueError / TypeError: a field set after construction is invalid (named).
        """
        return replace(
            self,
            stop=list(self.stop) if isinstance(self.stop, (list, tuple)) else self.stop,
            stop_token_ids=(
                list(self.stop_token_ids)
                if isinstance(self.stop_token_ids, (list, tuple, set, frozenset))
                else self.stop_token_ids
            ),
            logit_bias=dict(self.logit_bias)
            if isinstance(self.logit_bias, dict)
            else self.logit_bias,
            allowed_token_ids=_copy_list(self.allowed_token_ids),
            bad_words=_copy_list(self.bad_words),
            kv_transfer_params=(
                dict(self.kv_transfer_params)
                if isinstance(self.kv_transfer_params, dict)
                else self.kv_transfer_params
            ),
        )

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"SamplingParams.stop must be a str or a list of str, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError(f"SamplingParams.stop must not contain an empty string, got {stop!r}")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of int, got {ids!r}")
        if any(i < 0 for i in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {sorted(ids)}")
        return frozenset(ids)

    @property
    def has_constraints(self) -> bool:
        """Whether a grammar, a bias, an allowed list or bad words restrict the sampling."""
        return (
            self.structured_outputs is not None
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_logprobs(self) -> int:
        """Top-N logprobs asked for per sampled token (0 when only the sampled one or none)."""
        return self.logprobs or 0


def _copy_list(value: object) -> object:
    return list(value) if isinstance(value, (list, tuple)) else value


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
