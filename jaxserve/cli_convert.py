"""``jaxserve convert``: a Hugging Face checkpoint folder to a jaxserve Orbax checkpoint folder.

The work is checkpoints_tools/convert.py's (also ``python -m
jaxserve.checkpoints_tools.convert``); this module only registers the subcommand. Its flags are
declared here, not imported, because importing checkpoints_tools loads jax, and ``jaxserve
--help`` must stay fast.
"""

from __future__ import annotations

import argparse

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve convert``."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to an Orbax checkpoint",
        description="Write an Orbax checkpoint folder (params, config.json, tokenizer files) "
        "that LLM(model=ORBAX_DIR) loads straight into its shardings. The folder appears "
        "complete or not at all.",
    )
    p.add_argument("--model", required=True, metavar="HF_DIR", help="HF checkpoint folder")
    p.add_argument("--output", required=True, metavar="ORBAX_DIR", help="folder to write")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="stored params dtype")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jaxserve.checkpoints_tools.convert import run_convert  # loads jax

    return run_convert(args)
