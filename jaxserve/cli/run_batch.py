"""``jaxserve run-batch``: a job in OpenAI's batch format (jobs/run_batch.py).

    jaxserve run-batch -i IN.jsonl -o OUT.jsonl [--model M] [--served-model-name NAME]
                       [--max-in-flight N] [--no-progress] [engine flags]

Resumable: results are appended as requests finish; after a crash, ``kill -9`` or Ctrl-C the
same command skips every custom_id already in OUT (a torn last line is dropped) and runs the
rest. OUT starts with a job header; a resume whose input lines, model or settings changed is
refused naming the first difference (``--overwrite`` starts again), and a file that is not this
job's output is never modified. Exit status: 0 (every line has its output line, failed requests
included), 2 bad input (a repeated custom_id, an unreadable, non-UTF-8 or too-deep line, OUT
being IN, an OUT that is not this job's, a bad flag or model), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio

from jaxserve.checkpoints_tools.interrupt import sigint_to_asyncio
from jaxserve.cli.flags import add_engine_flags, add_job_flags, engine_kwargs, fail
from jaxserve.cli.serve import TOOL_PARSER_NAMES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve run-batch``."""
    p = subparsers.add_parser(
        "run-batch",
        help="run a batch file in OpenAI's batch format (resumable)",
        description="Run every request of an OpenAI batch file (/v1/completions, "
        "/v1/chat/completions) and write one output line per request as it finishes. Rerun "
        "the same command after an interruption to finish the rest.",
    )
    p.set_defaults(run=run)
    add_job_flags(p, "the batch file")
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name the requests' 'model' field must give (default: --model)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        metavar="N",
        help="requests handed to the engine at once (default: 4 x max_num_seqs)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_NAMES,
        default=None,
        help="the model's tool-call format, read for tool_choice 'auto' (as for serve)",
    )
    add_engine_flags(p)


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli.jobs import job_settings, open_results, read_input
    from jaxserve.jobs.run_batch import RECORD_FIELDS, output_key, parse_batch_lines

    if args.max_in_flight is not None and args.max_in_flight < 1:
        return fail("run-batch", f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    try:
        source, text_lines = read_input(args.input)
        lines = parse_batch_lines(text_lines, source)
        settings = job_settings(args, served_model_name=args.served_model_name or args.model)
        results = open_results(
            args,
            "run-batch",
            output_key,
            {item.key: item.input_hash for item in lines},
            record_fields=RECORD_FIELDS,
            settings=settings,
        )
    except OSError as e:
        return fail("run-batch", f"cannot use {e.filename!r} ({e.strerror})")
    except ValueError as e:  # InputError, the results file's checks
        return fail("run-batch", str(e))
    with results:
        if all(item.key in results.done for item in lines):
            print(f"nothing to do: all {len(lines)} requests are in {args.output}")
            return 0
        from jaxserve.engine.async_llm import AsyncLLM  # jax loads here

        try:
            # The job's requests are known: warm up the shapes they reach (jobs/run_batch.py).
            engine = AsyncLLM(args.model, **{"warmup": "job", **engine_kwargs(args)})
        except (OSError, TypeError, ValueError) as e:
            return fail("run-batch", str(e))
        try:
            with sigint_to_asyncio():  # Ctrl-C cancels _run: its finally flushes the results
                summary = asyncio.run(_run(args, engine, lines, results))
        finally:
            engine.shutdown()
    print(
        f"requests: {summary.total} ({summary.done_before} done before this run, "
        f"{summary.succeeded} succeeded, {summary.failed} failed)\n"
        f"output tokens: {summary.output_tokens} in {summary.elapsed_s:.2f} s "
        f"({summary.output_tokens / max(summary.elapsed_s, 1e-9):.1f} tokens/s)"
    )
    return 0


async def _run(args, engine, lines, results):
    from jaxserve.jobs.run_batch import run_batch

    max_seqs = engine.config.scheduler.max_num_seqs
    return await run_batch(
        engine,
        lines,
        results,
        served_model_name=args.served_model_name or args.model,
        max_in_flight=args.max_in_flight or 4 * max_seqs,
        progress=not args.no_progress,
        tool_call_parser=args.tool_call_parser,
    )
