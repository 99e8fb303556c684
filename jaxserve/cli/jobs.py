"""What the resumable JSONL jobs (generate --output, run-batch, score) share on the command line:
reading the input (jobs/jsonl.py: a bad byte or a too-deep line is named by its file and line),
the job's identity for its results file (jobs/job_spec.py), and the interrupt message.

Imports no jax: the input and the results file are checked before the engine loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from jaxserve.jobs.jsonl import InputError, read_lines, source_name

# Engine flags that change what a job writes (not only how fast): a resume must keep them.
_OUTPUT_FLAGS = (
    "dtype",
    "quantization",
    "max_model_len",
    "kv_cache_dtype",
    "tokenizer",
    "revision",
    "engine_seed",
)


def read_input(path: str) -> tuple[str, list[str]]:
    """``--input``'s name for messages and its lines.

    Raises:
        InputError: unreadable, or a line that is not UTF-8 (file and line named).
    """
    try:
        return source_name(path), read_lines(path)
    except InputError as e:
        raise InputError(f"--input: {e}") from None


def job_settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What a resume must keep: the model, the engine flags that change outputs, and ``extra``
    (e.g. the sampling defaults); absent flags are None."""
    settings = {"model": args.model}
    settings.update({name: getattr(args, name, None) for name in _OUTPUT_FLAGS})
    settings.update(extra)
    return settings


def open_results(
    args: argparse.Namespace,
    kind: str,
    key: Callable[[dict[str, Any]], Hashable],
    input_hashes: Mapping[Hashable, str],
    *,
    record_fields: frozenset[str],
    settings: dict[str, Any],
    expected: Callable[[Hashable], int] | None = None,
):
    """The job's ResultsFile at ``args.output``, checked against this job before anything in it
    changes.

    Raises:
        ValueError: the input and output are one file; the output is not this job's
            (NotAResultsFileError) or of another input or settings (JobMismatchError).
        OSError: the output cannot be read or written.
    """
    from jaxserve.jobs.job_spec import JobSpec, check_distinct_paths
    from jaxserve.jobs.results import ResultsFile

    check_distinct_paths(getattr(args, "input", None), args.output)
    job = JobSpec(kind, settings, input_hashes, record_fields)
    return ResultsFile(args.output, key, expected=expected, job=job, overwrite=args.overwrite)


def interrupted_message(args: argparse.Namespace) -> str:
    """The one line a Ctrl-C prints: what was kept and how to go on."""
    name = f"jaxserve {args.command}"
    output = getattr(args, "output", None)
    if output is None:
        return f"{name}: interrupted"
    return (
        f"{name}: interrupted; the results so far are in {output}: rerun the same command to resume"
    )
