"""JobSpec: what identifies a resumable job, so that its results file is recognised and a resume
after the input or the settings changed is refused instead of mixing two jobs' outputs.

A results file written with a JobSpec starts with a header record::

    {"jaxserve_job": {"kind": "run-batch", "version": 1, "settings": {"model": ..., ...}}}

and every record carries ``"input_hash"``: a hash of the request it answers (request_hash). A
resume compares the header's kind and settings field by field, and each record's key and hash
with the current input; the first difference is named (JobMismatchError). A file with no header
is recognised as an older jaxserve's output of this job only when every line is a record of this
job (``record_fields``) whose key is in the current input; anything else is not touched
(NotAResultsFileError).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

HEADER_KEY = "jaxserve_job"
HASH_FIELD = "input_hash"
VERSION = 1


class NotAResultsFileError(ValueError):
    """The output file exists and is not recognisably this job's output: it is left as it was."""


class JobMismatchError(ValueError):
    """The output file is this kind of job's, but of another input or other settings."""


def request_hash(request: Any) -> str:
    """A stable hash (16 hex digits) of a JSON-like request: equal requests, equal hashes, in any
    process (key order does not matter)."""
    text = json.dumps(
        request, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class JobSpec:
    """What a job is: compared with a results file before it is appended to.

    kind: the job ("run-batch", "score", "generate").
    settings: what changes the outputs (model, sampling defaults, dtype, ...), JSON values.
    input_hashes: each input request's key -> request_hash of that request.
    record_fields: fields every record of this job has (recognises a header-less file).
    """

    kind: str
    settings: Mapping[str, Any]
    input_hashes: Mapping[Hashable, str] = field(repr=False)
    record_fields: frozenset[str] = frozenset()

    def header(self) -> dict[str, Any]:
        """The results file's first record."""
        return {
            HEADER_KEY: {"kind": self.kind, "version": VERSION, "settings": dict(self.settings)}
        }

    def check_header(self, header: dict[str, Any], path: os.PathLike | str) -> None:
        """Raises JobMismatchError naming the first field of ``header`` that differs."""
        body = header.get(HEADER_KEY)
        if not isinstance(body, dict):
            raise NotAResultsFileError(f"{path}:1: a {HEADER_KEY!r} header that is not an object")
        ours = self.header()[HEADER_KEY]
        for name in ("kind", "version"):
            if body.get(name) != ours[name]:
                raise JobMismatchError(
                    f"{path}: written by a job with {name} {body.get(name)!r}, this one has "
                    f"{ours[name]!r}; pass --overwrite to start again, or choose another output"
                )
        theirs = body.get("settings") or {}
        for name in sorted(set(theirs) | set(ours["settings"])):
            old, new = theirs.get(name), ours["settings"].get(name)
            if _canonical(old) != _canonical(new):
                raise JobMismatchError(
                    f"{path}: written with {name} = {old!r}, this run has {name} = {new!r}; "
                    f"a resume must use the same settings (or pass --overwrite to start again)"
                )

    def check_record(self, key: Hashable, record: dict[str, Any], where: str) -> None:
        """Raises JobMismatchError: the record's request is gone from the input or changed."""
        if key not in self.input_hashes:
            raise JobMismatchError(
                f"{where}: the results hold id {_show(key)}, which the input no longer has; "
                f"pass --overwrite to start again, or restore the input"
            )
        if record.get(HASH_FIELD) != self.input_hashes[key]:
            raise JobMismatchError(
                f"{where}: the request of id {_show(key)} changed since its result was written; "
                f"pass --overwrite to start again, or restore the input"
            )

    def is_record(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` has the shape of one of this job's records."""
        return self.record_fields <= set(record)


def is_header(record: dict[str, Any]) -> bool:
    return HEADER_KEY in record


def _canonical(value: Any) -> str:
    # JSON round trip: a tuple read back is a list; compare the values, not their Python types.
    return json.dumps(value, sort_keys=True, default=repr)


def _show(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "line":
        return f"(line {key[1]}, no custom_id)"
    return repr(key)


def check_distinct_paths(input_path: str | None, output_path: str) -> None:
    """Raises ValueError when the input and output name the same file (by resolved path, or by
    inode: a hard link or a bind mount), before anything reads or writes either."""
    if input_path is None or input_path == "-":
        return
    same = os.path.realpath(input_path) == os.path.realpath(output_path)
    if not same and os.path.exists(input_path) and os.path.exists(output_path):
        same = os.path.samefile(input_path, output_path)
    if same:
        raise ValueError(
            f"the input {input_path!r} and the output {output_path!r} are the same file; the "
            f"results must go to another file"
        )
