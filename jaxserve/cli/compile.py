"""``jaxserve compile``: compile every step the engine would warm up, for a chip that is not here.

    jaxserve compile --model M --target v6e-1 [--tensor-parallel-size N] [engine flags]
                     [--token-buckets T,...] [--decode-context N] [--json PATH]

Reads the model's config.json only (no weights: abstract arrays in their shardings), makes the
execution plan and the memory plan the engine would make on the target (jaxserve/aot/), and
compiles each step bucket in both sampler variants and each block copy (and the host KV tier's
copies, with --kv-offloading-size; a draft model's proposal and block copy, with
--speculative-config) with the target's real
compiler (XLA:TPU and Mosaic through libtpu, deviceless). Prints one line per compilation and
the totals: the compiled memory against the memory plan and the target, whether the donated KV
pages alias, and a roofline prediction of decode and prefill tokens per second. --json PATH
also writes the whole report as JSON ('-': to stdout, instead of the table).

Exit status: 0 everything compiled and fits, 1 a compilation failed, the compiled memory does
not fit the target or the KV pages do not alias, 2 bad input (an unknown target, with the
known ones listed; a bad flag; a model that cannot be read) or a target whose compiler is not
installed (with what to install).

A compiler error is a failed row of the table. A compiler that ends the whole process instead
cannot be caught in it: XLA's fatal errors (e.g. "LLVM Fatal Error while compiling Triton
kernel", which exits with status 1) leave no report, only the compiler's message on stderr. So
each compilation is announced on stderr as it starts ("compiling step T=64 R=64 B=512"): the
last announcement names the culprit, and --token-buckets compiles the other buckets, or that
one alone. On a fatal signal (SIGSEGV, SIGABRT) faulthandler adds the Python stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from typing import Any

from jaxserve.cli.flags import add_engine_flags, add_model_flag, engine_kwargs, fail, positive_int
from jaxserve.cli.plan import PLAN_ENGINE_FLAGS

EXIT_OK = 0
EXIT_FAILED = 1

# The engine flags that shape what is compiled: the ones a memory plan reads, the attention
# implementation, the host KV tier (its copies) and speculative decoding (a draft model's
# steps) (flags.ENGINE_FLAGS).
COMPILE_ENGINE_FLAGS = (
    *PLAN_ENGINE_FLAGS,
    "attention_backend",
    "kv_offloading_size",
    "speculative_config",
)


def token_list(text: str) -> list[int]:
    """argparse type: comma-separated token counts, each >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be ints separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be token counts >= 1, got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve compile``."""
    p = subparsers.add_parser(
        "compile",
        help="compile every engine step for a GPU or TPU that is not here (config.json only)",
        description="Compile every step bucket and block copy the engine would warm up on "
        "--target, with that target's compiler, from the model's config.json alone. Exit "
        "status: 0 compiled and fits, 1 a failure or does not fit, 2 bad input or no compiler.",
    )
    p.set_defaults(run=run)
    add_model_flag(p, required=True, help="a built-in model name, a checkpoint folder or a "
                   "Hugging Face Hub model ID (config.json only is read)")  # fmt: skip
    p.add_argument("--target", required=True, help="h100, h200, a100-80g, l4, v5e-1, v5e-4, "
                   "v5e-8, v6e-1, v6e-4 or v6e-8")  # fmt: skip
    p.add_argument("--token-buckets", type=token_list, metavar="T,...",
                   help="only the step buckets of these token counts (default: all)")  # fmt: skip
    p.add_argument("--decode-context", type=positive_int, default=1024, metavar="N",
                   help="context length of the decode prediction (default 1024)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument("--output", metavar="DIR", help="also write the executables there, for "
                   "LLM(precompiled=DIR) / --precompiled DIR on the target")  # fmt: skip
    add_engine_flags(p, only=COMPILE_ENGINE_FLAGS)


def run(args: argparse.Namespace) -> int:
    """Run ``jaxserve compile``: 0 compiled and fits, 1 not, 2 bad input or no compiler."""
    from jaxserve.aot.targets import get_target

    try:
        target = get_target(args.target)
    except ValueError as e:
        return fail("compile", str(e))
    _compile_only_process()
    from jaxserve.aot.compile_engine import compile_engine
    from jaxserve.aot.devices import CompilerMissing
    from jaxserve.aot.table import bucket_line
    from jaxserve.config import EngineConfig
    from jaxserve.runner.memory_plan import DoesNotFit

    to_stdout = args.json == "-"
    progress = None if to_stdout else lambda r: print(bucket_line(r.as_dict()), flush=True)
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__)  # a crash in a compiler shows the stack
    try:
        config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
        report = compile_engine(
            config,
            target,
            token_buckets=args.token_buckets,
            decode_context=args.decode_context,
            on_result=progress,
            output=args.output,
            on_start=_announce,
        )
    except DoesNotFit as e:  # the engine would refuse it there: a finding, not bad input
        print(f"jaxserve compile: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (CompilerMissing, OSError, TypeError, ValueError) as e:
        return fail("compile", str(e))
    _emit(report.as_dict(), args.json)
    return EXIT_OK if report.ok else EXIT_FAILED


def _announce(label: str) -> None:
    """Name each compilation on stderr before it starts (see the module docstring)."""
    print(f"compiling {label}", file=sys.stderr, flush=True)


def _compile_only_process() -> None:
    """Nothing runs on a device here: when jax is not loaded yet, keep it to the CPU (so a
    machine with a GPU or TPU attached is not claimed) and the CUDA plugin from looking for a
    GPU; keep libtpu from querying the GCE metadata server for the host's own TPU."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def _emit(report: dict[str, Any], path: str | None) -> None:
    """The summary after the streamed bucket lines (or the JSON on stdout), and the file."""
    from jaxserve.aot.table import header_lines, summary_lines

    if path == "-":
        print(json.dumps(report))
        return
    print("\n".join(["", *header_lines(report), *summary_lines(report)]))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"report: {path}")
