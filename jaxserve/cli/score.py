"""``jaxserve score``: the log-probability of continuations given prompts (jobs/score_job.py).

    jaxserve score -i IN.jsonl -o OUT.jsonl [--model M] [--no-progress] [engine flags]

Resumable as run-batch: records are appended as pairs finish, and a rerun skips the ids already
in OUT, after checking the job header and each pair's hash (``--overwrite`` starts again).
Exit status: 0, 2 for bad input (a bad line, flag or model, OUT being IN, an OUT that is not
this job's; nothing runs then), 130 interrupted.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.cli.flags import add_engine_flags, add_job_flags, fail, job_kwargs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve score``."""
    p = subparsers.add_parser(
        "score",
        help="score continuations given prompts (log-probabilities; resumable)",
        description="Write each JSONL line's continuation log-probability given its prompt, "
        "per token and summed. Rerun the same command after an interruption to finish the rest.",
    )
    p.set_defaults(run=run)
    add_job_flags(p, "the pairs")
    add_engine_flags(p)


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli.jobs import job_settings, open_results, read_input
    from jaxserve.jobs.jsonl import InputError
    from jaxserve.jobs.score_job import RECORD_FIELDS, parse_score_lines

    try:
        source, text_lines = read_input(args.input)
        lines = parse_score_lines(text_lines, source)
        results = open_results(
            args,
            "score",
            lambda record: str(record["id"]),
            {item.id: item.input_hash for item in lines},
            record_fields=RECORD_FIELDS,
            settings=job_settings(args),
        )
    except OSError as e:
        return fail("score", f"cannot use {e.filename!r} ({e.strerror})")
    except ValueError as e:  # InputError, the results file's checks
        return fail("score", str(e))
    with results:
        done_before = sum(item.id in results.done for item in lines)
        if done_before == len(lines):
            print(f"nothing to do: all {len(lines)} pairs are in {args.output}")
            return 0
        from tqdm.auto import tqdm

        from jaxserve.engine.llm import LLM  # jax loads here
        from jaxserve.jobs.score_job import job_preview, score_lines

        todo = [item for item in lines if item.id not in results.done]
        try:
            llm = LLM(args.model, **job_kwargs(args, lambda: job_preview(todo)))
        except (OSError, TypeError, ValueError) as e:
            return fail("score", str(e))
        bar = tqdm(total=len(lines), initial=done_before, desc="Pairs", disable=args.no_progress)
        start = time.perf_counter()
        try:
            for _ in score_lines(llm, lines, results):
                bar.update(1)
        except InputError as e:
            return fail("score", str(e))
        finally:
            bar.close()
            llm.shutdown()
    print(
        f"pairs: {len(lines)} ({done_before} done before this run, {len(lines) - done_before} "
        f"scored in {time.perf_counter() - start:.2f} s)"
    )
    return 0
