"""``jaxserve convert``: a Hugging Face checkpoint folder to a jaxserve Orbax checkpoint folder.

The work is checkpoints_tools/convert.py's (also ``python -m
jaxserve.checkpoints_tools.convert``); this module only registers the subcommand, with the
flags convert.py declares. Importing convert.py loads no jax (it imports jax inside the
conversion, after its Ctrl-C guard is in place), so ``jaxserve --help`` stays fast.
"""

from __future__ import annotations

import argparse

from jaxserve.checkpoints_tools.convert import add_convert_arguments, run_convert


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve convert``."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to an Orbax checkpoint",
        description="Write an Orbax checkpoint folder (params, config.json, tokenizer files) "
        "that LLM(model=ORBAX_DIR) loads straight into its shardings. The folder appears "
        "complete or not at all; Ctrl-C leaves nothing behind (exit status 130).",
    )
    add_convert_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``jaxserve convert``; the exit code (0, 2 for bad input, 130 for Ctrl-C)."""
    return run_convert(args)
