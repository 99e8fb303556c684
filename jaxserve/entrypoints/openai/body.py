"""A request body from bytes to JSON, with the limits a public endpoint needs.

Every refusal is a 400 naming what is wrong, before any handler sees the body: JSON nested
deeper than ``max_depth`` (Python's parser recurses a level at a time: a RecursionError, once a
500), numbers that are not finite (``Infinity``, ``NaN``, or ``1e400``, which Python reads as
inf), and strings or field names holding a lone surrogate (``"\\ud800"``: not Unicode text, and
not even encodable to echo back) anywhere in it, named by their path (``temperature``,
``messages[0].x``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from jaxserve.entrypoints.openai.protocol import OpenAIError, loc_path

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any prompt max_model_len allows
DEFAULT_MAX_DEPTH = 64  # OpenAI bodies nest a few levels (tools' JSON schemas: a few more)


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may be."""

    max_bytes: int = DEFAULT_MAX_BODY_BYTES  # bytes of the raw body; past it 413
    max_depth: int = DEFAULT_MAX_DEPTH  # nesting of JSON arrays and objects; past it 400

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BodyLimits.{name} must be an int >= 1, got {value!r}")


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value of ``raw``.

    Raises:
        OpenAIError (400): not JSON, nested deeper than ``max_depth``, or a number that is not
            finite (param: its path).
    """
    try:
        body = json.loads(raw)  # Infinity / NaN parse to floats, which _check_values names
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the C parser recurses once a level
        raise OpenAIError(_too_deep(max_depth)) from None
    _check_values(body, max_depth)
    return body


def _too_deep(max_depth: int) -> str:
    return f"the request body nests JSON arrays and objects deeper than {max_depth} levels"


def _check_values(body: Any, max_depth: int) -> None:
    # Iterative: a recursive walk would fail on the depth it is there to refuse.
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > max_depth:
            raise OpenAIError(_too_deep(max_depth))
        if isinstance(value, float) and not math.isfinite(value):
            param = loc_path(list(path)) or None
            raise OpenAIError(
                f"{param or 'the request body'}: {value} is not a finite number", param=param
            )
        if isinstance(value, str) and _has_lone_surrogate(value):
            raise _lone_surrogate(path, "a string")
        if isinstance(value, dict):
            for key in value:
                if _has_lone_surrogate(key):
                    raise _lone_surrogate((*path, key), "a field name")
            stack.extend((v, (*path, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" escapes decode to lone surrogates
        return True
    return False


def _lone_surrogate(path: tuple, what: str) -> OpenAIError:
    """The error for a string that is not Unicode text; the path escaped (it must be JSON)."""
    param = loc_path(
        [p.encode("utf-8", "backslashreplace").decode() if isinstance(p, str) else p for p in path]
    )
    return OpenAIError(
        f"{param or 'the request body'}: {what} with a lone surrogate (a \\ud800-\\udfff escape "
        "not part of a pair) is not Unicode text",
        param=param or None,
    )
