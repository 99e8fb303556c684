"""A structural tag (vLLM's ``structural_tag``, OpenAI-style tool calling in running text):
checked and put in canonical form. Plain data, no jax.

The shape is vLLM's (its ``response_format`` ``{"type": "structural_tag", ...}`` and
``StructuredOutputsParams.structural_tag``, a JSON text or a dict)::

    {"structures": [{"begin": "<function=get>", "schema": {...}, "end": "</function>"}, ...],
     "triggers": ["<function="]}

The output is free text until a trigger appears; from there the structure whose ``begin``
starts with that trigger is forced: the rest of its ``begin``, a JSON value valid under its
``schema``, its ``end``; then free text again. xgrammar's newer form (``{"type":
"structural_tag", "format": {...}}``) has no llguidance equivalent and is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

MAX_STRUCTURES = 128  # as many structures as a request may have tools (MAX_TOOLS)
MAX_TRIGGERS = 128
_KEYS = {"type", "structures", "triggers"}
_STRUCTURE_KEYS = {"begin", "schema", "end"}
NAME = "StructuredOutputsParams.structural_tag"


def check_structural_tag(value: object) -> str:
    """``value`` (a dict or its JSON text) checked; returns its canonical JSON text
    ``{"structures": [...], "triggers": [...]}`` (key order of the schemas kept: it is the
    order of the output's keys).

    Raises:
        TypeError / ValueError naming the field (``structural_tag.structures[1].begin`` ...),
        the value and the limit.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{NAME}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TypeError(
            f"{NAME} must be an object {{structures, triggers}}, got {type(value).__name__}"
        )
    if "format" in value:
        raise ValueError(
            f"{NAME}.format: xgrammar's structural tag format is not supported (the llguidance "
            'backend takes vLLM\'s {"structures": [{"begin", "schema", "end"}], "triggers"})'
        )
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"{NAME}: unknown field(s) {unknown}; known: {sorted(_KEYS)}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{NAME}.type must be 'structural_tag', got {value['type']!r}")
    triggers = _triggers(value.get("triggers"))
    structures = _list(value.get("structures"), "structures", MAX_STRUCTURES)
    canonical = {
        "structures": [_structure(i, s, triggers) for i, s in enumerate(structures)],
        "triggers": triggers,
    }
    try:
        return json.dumps(canonical)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{NAME}: not JSON-serialisable ({e})") from None


def _list(value: object, name: str, cap: int) -> list:
    if not isinstance(value, list) or not value:
        raise TypeError(f"{NAME}.{name} must be a non-empty list, got {value!r:.80}")
    if len(value) > cap:
        raise ValueError(f"{NAME}.{name}: {len(value)} items exceed the cap of {cap}")
    return value


def _triggers(value: object) -> list[str]:
    triggers = _list(value, "triggers", MAX_TRIGGERS)
    for i, trigger in enumerate(triggers):
        if not isinstance(trigger, str) or not trigger:
            raise ValueError(f"{NAME}.triggers[{i}] must be a non-empty str, got {trigger!r:.80}")
    return list(triggers)


def _structure(i: int, value: object, triggers: list[str]) -> dict[str, Any]:
    where = f"{NAME}.structures[{i}]"
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be an object {{begin, schema, end}}, got {value!r:.80}")
    unknown = sorted(set(value) - _STRUCTURE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(_STRUCTURE_KEYS)}")
    begin, schema, end = value.get("begin"), value.get("schema"), value.get("end")
    if not isinstance(begin, str) or not begin:
        raise ValueError(f"{where}.begin must be a non-empty str, got {begin!r:.80}")
    if not isinstance(end, str):
        raise TypeError(f"{where}.end must be a str, got {end!r:.80}")
    if not isinstance(schema, dict):
        raise TypeError(f"{where}.schema must be a JSON schema object, got {schema!r:.80}")
    if not any(begin.startswith(t) for t in triggers):
        raise ValueError(
            f"{where}.begin {begin!r:.80} starts with none of the triggers {triggers!r:.200}"
        )
    return {"begin": begin, "schema": schema, "end": end}


def parse_structural_tag(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(structures, triggers) of a canonical text made by check_structural_tag."""
    value = json.loads(text)
    return value["structures"], value["triggers"]
