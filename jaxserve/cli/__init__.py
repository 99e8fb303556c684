"""The ``jaxserve`` command: one module per subcommand, the flags they share in flags.py.

    generate   offline batch generation (generate.py; the job: jobs/generate.py)
    convert    a Hugging Face checkpoint to an Orbax one (convert.py)
    plan       will a model fit, from config.json alone (plan.py)
    compile    every engine step compiled for a GPU / TPU that is not here (compile.py)
    serve      the OpenAI-compatible HTTP server (serve.py), or N replicas behind one
    router     disaggregated serving: prefill on one server, decode on another (router.py)
    run-batch  a job in OpenAI's batch format (run_batch.py; jobs/run_batch.py)
    score      continuation log-probabilities (score.py; jobs/score_job.py)

Adding a subcommand: write a module here with ``add_parser(subparsers) -> None`` that calls
``subparsers.add_parser(name, ...)``, adds its arguments (flags.py has the shared ones) and
``set_defaults(run=...)`` with ``run(args: argparse.Namespace) -> int`` (the exit code); import
jax and other heavy modules inside ``run``, so that ``jaxserve --help`` stays fast. Then append
``lazy_subcommand("jaxserve.cli.that_module")`` to SUBCOMMANDS below.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from jaxserve.checkpoints_tools.interrupt import sigint_guard

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def lazy_subcommand(module: str, command: str | None = None) -> AddParser:
    """A subcommand whose module is imported only when the parser is built; ``command``, its
    name on the command line, lets a run of it import its own module alone."""

    def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        importlib.import_module(module).add_parser(subparsers)

    add_parser.command = command  # type: ignore[attr-defined]
    return add_parser


# One entry per subcommand, in --help order.
SUBCOMMANDS: list[AddParser] = [
    lazy_subcommand(f"jaxserve.cli.{module}", command)
    for module, command in (
        ("generate", "generate"), ("convert", "convert"), ("plan", "plan"),
        ("compile", "compile"), ("serve", "serve"), ("router", "router"),
        ("run_batch", "run-batch"), ("score", "score"),
    )
]  # fmt: skip


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; or, when ``argv`` starts with one's name, of that one
    alone, so that a run imports only its own module (``jaxserve compile`` and ``plan`` never
    load the server's web stack: on a machine without it they still work)."""
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="jaxserve: LLM inference on JAX/XLA"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    first = argv[0] if argv else None
    chosen = [a for a in SUBCOMMANDS if first and getattr(a, "command", None) == first]
    for add_parser in chosen or SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxserve`` script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        with sigint_guard():
            return args.run(args)
    except KeyboardInterrupt:  # a job's results are durable; one line says how to go on
        from jaxserve.cli.flags import EXIT_INTERRUPTED
        from jaxserve.cli.jobs import interrupted_message

        print(interrupted_message(args), file=sys.stderr)
        return EXIT_INTERRUPTED
