"""``jaxserve generate``: offline batch generation (the job is jobs/generate.py).

    jaxserve generate (--prompt P ... | --input PROMPTS.jsonl) [--output OUT.jsonl] [--model M]
                      [sampling flags] [engine flags]

Reads prompts (``--prompt``, repeatable, or ``--input`` JSONL), runs ``LLM.generate`` and writes
one JSON object per completion (``--output``) or prints them, then a summary. With ``--output``
records are appended as requests finish (ResultsFile: crash-safe), and a rerun of the same
command skips the requests already in the file. Bad input exits with code 2 and a message naming
the line and the field: a bad line or flag, a prompt the engine refuses (too long, a token outside
the vocabulary; the line and its request_id are named), a missing or malformed model folder (the
file is named).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from jaxserve.cli.flags import (
    add_engine_flags,
    add_model_flag,
    add_overwrite_flag,
    add_sampling_flags,
    fail,
    job_kwargs,
    sampling_defaults,
)
from jaxserve.jobs import generate as job
from jaxserve.jobs.generate import PromptRequest, make_sampling_params, read_prompt_lines
from jaxserve.jobs.jsonl import InputError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve generate``."""
    p = subparsers.add_parser(
        "generate",
        help="generate completions for prompts (offline batch)",
        description="Generate completions with jaxserve's LLM. Sampling flags are defaults; a "
        "JSONL line's own SamplingParams fields override them.",
    )
    p.set_defaults(run=run)
    add_model_flag(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        metavar="PROMPTS.jsonl",
        help='one JSON object a line: "prompt" or "prompt_token_ids", optional "request_id" and '
        'SamplingParams fields ("-": stdin)',
    )
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument(
        "--output",
        metavar="OUT.jsonl",
        help="write one JSON object per completion, after a job header (resumable)",
    )
    add_overwrite_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_flags(p)
    add_engine_flags(p)


def collect_requests(args: argparse.Namespace) -> list[PromptRequest]:
    """The prompts of ``--prompt`` flags or of the ``--input`` file ("-": stdin).

    Raises:
        InputError: unreadable file, bad line, or bad sampling flags.
    """
    defaults = sampling_defaults(args)
    if args.prompt:
        params = make_sampling_params(defaults, "command line")
        return [
            PromptRequest(str(i), p, None, params, f"--prompt {i + 1}")
            for i, p in enumerate(args.prompt)
        ]
    from jaxserve.cli.jobs import read_input

    source, lines = read_input(args.input)
    return read_prompt_lines(lines, source, defaults)


def run(args: argparse.Namespace) -> int:
    """``jaxserve generate``: the exit code (0, or 2 for bad input: a bad line or flag, a
    missing or malformed model)."""
    try:
        requests = collect_requests(args)
    except InputError as e:
        return fail("generate", str(e))
    results = None
    if args.output is not None:
        try:
            results = _open_results(args, requests)
        except (OSError, ValueError) as e:
            return fail("generate", f"--output: {e}")
        requests = [r for r in requests if r.request_id not in results.done]
    from jaxserve.engine.llm import LLM  # jax loads here, not for --help or bad input

    try:
        start = time.perf_counter()
        llm = LLM(model=args.model, **job_kwargs(args, lambda: job.job_preview(requests)))
        checked = job.check_requests(llm.engine, requests)
    except (OSError, TypeError, ValueError) as e:  # bad model or input (docs/architecture.md)
        if results is not None:
            results.close()
        return fail("generate", str(e))
    try:
        # The job's shapes (LLM's warmup="job"), counted in the load time: compiled while the
        # weights loaded (warmup_for), so only what the preview missed compiles here.
        llm.warm_up(checked)
        load_s = time.perf_counter() - start
        outputs, elapsed_s = job.generate(llm, requests, results, progress=not args.no_progress)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
        if results is not None:
            results.close()
    if results is None:
        for req, out in zip(requests, outputs, strict=True):
            for record in job.output_records(req, out):
                print(job.format_completion(record))
    else:
        print(f"already done:       {len(results.done)} requests (in {args.output})")
    print(job.format_summary(outputs, stats, elapsed_s, load_s))
    return 0


def _open_results(args: argparse.Namespace, requests: Sequence[PromptRequest]):
    """The --output file, recovered and checked against this job (cli/jobs.open_results): a
    request counts as done once all its n records are in."""
    from jaxserve.cli.jobs import job_settings, open_results

    n_of = {r.request_id: r.params.n for r in requests}
    return open_results(
        args,
        "generate",
        lambda record: str(record["request_id"]),
        {r.request_id: job.request_hash(r) for r in requests},
        record_fields=job.RECORD_FIELDS,
        # one setting per sampling flag, so that a changed flag is named on its own
        settings=job_settings(
            args, **{f"sampling.{k}": v for k, v in sampling_defaults(args).items()}
        ),
        expected=lambda request_id: n_of.get(request_id, 1),
    )
