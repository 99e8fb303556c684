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


def lazy_subcommand(module: str) -> AddParser:
    """A subcommand whose module is imported only when the parser is built."""
    return lambda subparsers: importlib.import_module(module).add_parser(subparsers)


# One entry per subcommand, in --help order.
SUBCOMMANDS: list[AddParser] = [
    lazy_subcommand("jaxserve.cli.generate"),
    lazy_subcommand("jaxserve.cli.convert"),
    lazy_subcommand("jaxserve.cli.plan"),
    lazy_subcommand("jaxserve.cli.compile"),
    lazy_subcommand("jaxserve.cli.serve"),
    lazy_subcommand("jaxserve.cli.router"),
    lazy_subcommand("jaxserve.cli.run_batch"),
    lazy_subcommand("jaxserve.cli.score"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="jaxserve: LLM inference on JAX/XLA"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxserve`` script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        with sigint_guard():
            return args.run(args)
    except KeyboardInterrupt:  # a job's results are durable; one line says how to go on
        from jaxserve.cli.flags import EXIT_INTERRUPTED
        from jaxserve.cli.jobs import interrupted_message

        print(interrupted_message(args), file=sys.stderr)
        return EXIT_INTERRUPTED
