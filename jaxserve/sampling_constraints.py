"""What a request may sample: StructuredOutputsParams and the checks of SamplingParams'
``logit_bias``, ``allowed_token_ids`` and ``bad_words`` (vLLM's names).

Plain data, no jax: the fields are checked here for types, sizes and finiteness; what needs the
model (token ids below the vocabulary size) and the grammar library (a schema or grammar that
compiles) is checked by the engine when the request is queued (jaxserve/structured/).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from jaxserve.structural_tag import check_structural_tag

# vLLM's caps: a request may name at most this many allowed ids and biased tokens. The sampler
# takes the biases as a fixed-width list (one compiled shape), so the cap is also its width.
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_BAD_WORDS = 128  # words per request (each becomes 1 or 2 token sequences)
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema (as JSON), regex or grammar: 1 MiB of text at most

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output (vLLM's StructuredOutputsParams); exactly one is set.

    json: a JSON schema (a dict, or its JSON text); the output is a JSON value valid under it.
    regex: the output fully matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: a Lark grammar (llguidance's dialect), or GBNF (recognised by ``::=``).
    json_object: True: the output is some JSON object.
    structural_tag: free text with tagged JSON segments (structural_tag.py: vLLM's
        ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, a dict or its JSON
        text; kept as canonical JSON text).

    Raises:
        ValueError / TypeError at construction, naming the field and the limit.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams: exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag must be set, got {set_kinds or 'none'}"
            )
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            self._check_json(value)
        elif kind == "choice":
            self._check_choice(value)
        elif kind == "structural_tag":
            canonical = check_structural_tag(value)
            _check_text("StructuredOutputsParams.structural_tag", canonical)
            object.__setattr__(self, "structural_tag", canonical)
        elif kind == "json_object":
            if value is not True:
                raise TypeError(f"StructuredOutputsParams.json_object must be True, got {value!r}")
        else:
            _check_text(f"StructuredOutputsParams.{kind}", value)

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec as canonical text): equal constraints compile once."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            # Key order is kept: a schema's property order is the order of the output's keys.
            text = value if isinstance(value, str) else json.dumps(value)
            return kind, text
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        return kind, value

    @staticmethod
    def _check_json(value: object) -> None:
        if isinstance(value, str):
            _check_text("StructuredOutputsParams.json", value)
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"StructuredOutputsParams.json: not valid JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise TypeError(
                "StructuredOutputsParams.json must be a JSON schema (an object), got "
                f"{type(value).__name__}"
            )
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError) as e:
            raise TypeError(f"StructuredOutputsParams.json: not JSON-serialisable ({e})") from None
        if size > MAX_SPEC_CHARS:
            raise ValueError(
                f"StructuredOutputsParams.json: {size} characters exceed the cap of "
                f"MAX_SPEC_CHARS={MAX_SPEC_CHARS}"
            )

    @staticmethod
    def _check_choice(value: object) -> None:
        if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
            raise TypeError(f"StructuredOutputsParams.choice must be a list of str, got {value!r}")
        if not value or any(c == "" for c in value):
            raise ValueError(
                "StructuredOutputsParams.choice must be non-empty strings, at least one, got "
                f"{list(value)!r}"
            )
        if len(value) > MAX_CHOICES:
            raise ValueError(
                f"StructuredOutputsParams.choice: {len(value)} choices exceed the cap of "
                f"MAX_CHOICES={MAX_CHOICES}"
            )

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From a plain dict (a JSON body); an unknown key is refused by name."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {unknown}; supported: {sorted(names)}"
            )
        return cls(**value)


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(
            f"{name}: {len(value)} characters exceed the cap of MAX_SPEC_CHARS={MAX_SPEC_CHARS}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_logit_bias(value: object) -> dict[int, float] | None:
    """SamplingParams.logit_bias: {token id >= 0: finite float}, at most MAX_LOGIT_BIAS_TOKENS
    entries; an id may be a decimal string (a JSON object's key). Returns a normalised copy
    (int ids, float values), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"SamplingParams.logit_bias must be a dict[int, float], got {value!r}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(
            f"SamplingParams.logit_bias: {len(value)} tokens exceed the cap of "
            f"MAX_LOGIT_BIAS_TOKENS={MAX_LOGIT_BIAS_TOKENS}"
        )
    out = {}
    for token, bias in value.items():
        if isinstance(token, str) and token.isdigit():  # JSON objects' keys (batch jobs)
            token = int(token)
        if not _is_int(token) or token < 0:
            raise ValueError(
                f"SamplingParams.logit_bias: token ids must be ints >= 0, got {token!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(
                f"SamplingParams.logit_bias[{token}] must be a finite number, got {bias!r}"
            )
        out[token] = float(bias)
    return out


def check_allowed_token_ids(value: object) -> list[int] | None:
    """SamplingParams.allowed_token_ids: a non-empty list of ids >= 0, at most
    MAX_ALLOWED_TOKEN_IDS. Returns a copy, or None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value):
        raise TypeError(f"SamplingParams.allowed_token_ids must be a list of int, got {value!r}")
    if not value:
        raise ValueError("SamplingParams.allowed_token_ids must not be empty (nothing to sample)")
    if len(value) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(
            f"SamplingParams.allowed_token_ids: {len(value)} ids exceed the cap of "
            f"MAX_ALLOWED_TOKEN_IDS={MAX_ALLOWED_TOKEN_IDS}"
        )
    if min(value) < 0:
        raise ValueError(f"SamplingParams.allowed_token_ids must be >= 0, got {min(value)}")
    return list(value)


def check_bad_words(value: object) -> list[str] | None:
    """SamplingParams.bad_words: a list of non-empty strings, at most MAX_BAD_WORDS."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(w, str) for w in value):
        raise TypeError(f"SamplingParams.bad_words must be a list of str, got {value!r}")
    if any(not w.strip() for w in value):
        raise ValueError(f"SamplingParams.bad_words must not contain blank words, got {value!r}")
    if len(value) > MAX_BAD_WORDS:
        raise ValueError(
            f"SamplingParams.bad_words: {len(value)} words exceed the cap of "
            f"MAX_BAD_WORDS={MAX_BAD_WORDS}"
        )
    return list(value)


def check_structured_outputs(value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        return StructuredOutputsParams.from_dict(value)
    raise TypeError(
        "SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
        f"{type(value).__name__}"
    )
