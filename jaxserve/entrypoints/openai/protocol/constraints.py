"""The request fields that constrain what is sampled: OpenAI's ``response_format`` and
``logit_bias``, and vLLM's extra body fields ``structured_outputs``, ``allowed_token_ids`` and
``bad_words``, turned into SamplingParams fields (each honoured, or refused with a 400 naming
it). Tool calls add their own constraint (tools.py) through ``structured_outputs``.

``json_schema.strict``: OpenAI promises schema adherence only with ``strict: true``; jaxserve
(as vLLM) enforces the schema through the grammar whatever ``strict`` says: ``false`` or absent
gets the same guarantee, which no client relying on ``false`` can be hurt by (a strict-mode
schema rule OpenAI would refuse, e.g. a missing ``additionalProperties: false``, is not refused
here either). ``strict`` must still be a boolean or null."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, short_repr

LOGIT_BIAS_RANGE = 100.0  # OpenAI's: each bias in [-100, 100]
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def constraint_fields(request: Any, tool_constraint: dict[str, Any] | None = None) -> dict:
    """SamplingParams fields of a request's constraints (absent ones left out).

    Args:
        request: a CompletionRequest or ChatCompletionRequest.
        tool_constraint: the structured_outputs a tool_choice forces (tools.py), or None.

    Raises:
        OpenAIError (400): a malformed field, or two fields that each constrain the output.
    """
    sources = {
        "response_format": response_format_constraint(request.response_format),
        "structured_outputs": _structured_outputs(request.structured_outputs),
        "tool_choice": tool_constraint,
    }
    given = [name for name, value in sources.items() if value is not None]
    if len(given) > 1:
        raise OpenAIError(
            f"{' and '.join(given)} each constrain the output; give only one of them",
            param=given[1],
        )
    fields: dict[str, Any] = {}
    if given:
        fields["structured_outputs"] = sources[given[0]]
    if request.logit_bias is not None:
        bias = logit_bias(request.logit_bias)
        if bias:  # {} biases nothing (OpenAI's SDK sends it)
            fields["logit_bias"] = bias
    for name in ("allowed_token_ids", "bad_words"):
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    return fields


def constraint_source(request: Any) -> str:
    """The request field a structured_outputs error should name."""
    for name in ("response_format", "structured_outputs"):
        value = getattr(request, name)
        if value is not None and value != {"type": "text"}:
            return name
    return "tools" if getattr(request, "tools", None) else "structured_outputs"


def response_format_constraint(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format -> structured_outputs (None for text or absent)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": _json_schema(value)}
    if kind == "structural_tag":  # vLLM's; checked by StructuredOutputsParams, by name
        return {"structural_tag": value}
    raise OpenAIError(
        'response_format must be {"type": "text"}, {"type": "json_object"}, {"type": '
        '"json_schema", "json_schema": {"name": ..., "schema": {...}}} or {"type": '
        '"structural_tag", "structures": [...], "triggers": [...]}, got '
        f"{short_repr(value)}",
        param="response_format",
    )


def _json_schema(value: dict[str, Any]) -> dict[str, Any]:
    spec = value.get("json_schema")
    extra = set(value) - {"type", "json_schema"}
    if not isinstance(spec, dict) or extra:
        raise OpenAIError(
            'response_format.json_schema must be an object {"name", "schema", "strict", '
            f'"description"}}, got {short_repr(value)}',
            param="response_format.json_schema",
        )
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise OpenAIError(
            f"response_format.json_schema: unknown field(s) {unknown}; known: "
            f"{sorted(_JSON_SCHEMA_KEYS)}",
            param="response_format.json_schema",
        )
    if not isinstance(spec.get("name"), str):
        raise OpenAIError(
            "response_format.json_schema.name is required (a string)",
            param="response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OpenAIError(
            f"response_format.json_schema.strict must be a boolean, got {short_repr(strict)}",
            param="response_format.json_schema.strict",
        )
    schema = spec.get("schema")  # enforced whatever strict says (module docstring)
    if not isinstance(schema, dict):
        raise OpenAIError(
            "response_format.json_schema.schema must be a JSON schema object, got "
            f"{short_repr(schema)}",
            param="response_format.json_schema.schema",
        )
    return schema


def _structured_outputs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise OpenAIError(
            f"structured_outputs must be an object, got {short_repr(value)}",
            param="structured_outputs",
        )
    return value


def logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}; ids as decimal strings (or ints), biases in
    [-100, 100]. The engine checks the ids against the vocabulary and the size cap."""
    if not isinstance(value, dict):
        raise OpenAIError(
            f'logit_bias must be an object {{"token id": bias}}, got {short_repr(value)}',
            param="logit_bias",
        )
    out = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None:
            raise OpenAIError(
                f"logit_bias: keys must be token ids (decimal strings), got {short_repr(key)}",
                param="logit_bias",
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not math.isfinite(bias)
            or abs(bias) > LOGIT_BIAS_RANGE
        ):
            raise OpenAIError(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {short_repr(bias)}",
                param="logit_bias",
            )
        out[token] = float(bias)
    return out


def _token_id(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isdigit() and len(key) < 12:
        return int(key)
    return None
