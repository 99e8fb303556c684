"""The one JSONL reader of every job: generate's prompts, run-batch's requests, score's pairs, and
the results file a job reads back (results.py).

Every job reads its input the same way and reports a bad line the same way, naming the file and
the 1-based line: ``p.jsonl:3: not UTF-8 text (...)``, ``p.jsonl:3: not valid JSON (...)``,
``p.jsonl:3: JSON nested too deeply to read``, ``p.jsonl:3: expected a JSON object, got list``,
``p.jsonl:3: field 'request_id' '0' repeats line 1``. What a job does with a line it cannot read
is its own policy: generate and score stop before anything runs; run-batch writes an error
record for the line (but stops on a line nested too deeply, as it stops on unreadable bytes).

Imports no jax: a job's input is checked before the engine loads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


class InputError(ValueError):
    """Bad input to a job: its message starts with where (``file:line``, a flag) and names the
    field."""


class LineError(InputError):
    """One line is not a JSON object: ``reason`` says why, ``where`` names the line."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class NestedTooDeeplyError(LineError):
    """A line nested past Python's recursion limit (a LineError that run-batch does not record
    as a failed request but stops on)."""


@dataclass(frozen=True)
class JsonlLine:
    number: int  # 1-based, blank lines counted
    where: str  # "p.jsonl:3"
    text: str


def source_name(path: str) -> str:
    """How messages name an input path ("-": stdin)."""
    return "<stdin>" if path == "-" else path


def decode_line(raw: bytes, where: str) -> str:
    """One line's bytes as text.

    Raises:
        LineError: not UTF-8 (the byte is named).
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(
            where, f"not UTF-8 text ({e.reason} at byte {e.start} of the line)"
        ) from None


def read_lines(path: str) -> list[str]:
    """The lines of ``path`` ("-": stdin), each decoded on its own.

    Raises:
        InputError: the file cannot be read, or a line is not UTF-8 (file and line named).
    """
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise InputError(f"cannot read {path!r} ({e.strerror})") from None
    source = source_name(path)
    return [
        decode_line(raw, f"{source}:{number}")
        for number, raw in enumerate(data.splitlines(), start=1)
    ]


def numbered_lines(lines: Iterable[str], source: str) -> Iterator[JsonlLine]:
    """The non-blank lines with their numbers (counting from 1, blank lines included)."""
    for number, text in enumerate(lines, start=1):
        if text.strip():
            yield JsonlLine(number, f"{source}:{number}", text)


def parse_object(text: str, where: str) -> dict[str, Any]:
    """``json.loads`` of one line that must be a JSON object.

    Raises:
        LineError: not JSON, or not an object.
        NestedTooDeeplyError: nested past the recursion limit (an error, not a crash).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(where, f"not valid JSON ({e})") from None
    except RecursionError:
        raise NestedTooDeeplyError(where, "JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise LineError(where, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def check_fields(
    obj: dict[str, Any], allowed: Iterable[str], where: str, allowed_help: str
) -> None:
    """Raises InputError naming the first field of ``obj`` not in ``allowed``."""
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r} (allowed: {allowed_help})")


def line_id(obj: dict[str, Any], field: str, default: int, where: str) -> str:
    """A line's id: ``obj[field]`` (a string or an int), else ``default``, as a string.

    Raises:
        InputError: the field is neither a string nor an int.
    """
    value = obj.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: field {field!r} must be a string or an int, got {value!r}")
    return str(value)


class UniqueIds:
    """The ids seen so far in one input, with the line each came from."""

    def __init__(self, what: str) -> None:
        self.what = what  # how messages name the id ("field 'request_id'", "custom_id")
        self._line_of: dict[Hashable, int] = {}

    def add(self, key: Hashable, line: JsonlLine) -> None:
        """Raises InputError: ``key`` was seen before (both lines named)."""
        if key in self._line_of:
            raise InputError(f"{line.where}: {self.what} {key!r} repeats line {self._line_of[key]}")
        self._line_of[key] = line.number
