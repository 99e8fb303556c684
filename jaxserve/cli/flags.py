"""The flags more than one subcommand takes, each declared once: the model, the engine (the LLM
constructor arguments, read back by ``engine_kwargs``), the sampling defaults (read back by
``sampling_defaults``) and a resumable job's input and output; the argparse value types and the
one way a subcommand reports bad input.

Imports no jax: ``jaxserve --help`` and a bad flag stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
)

EXIT_BAD_INPUT = 2  # argparse's own code for a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
DEFAULT_MODEL = "tiny-random-llama"
MODEL_HELP = (
    "a built-in model name, an HF or Orbax checkpoint folder, or a Hugging Face Hub model ID "
    "(org/name; HF_HOME and HF_HUB_OFFLINE apply)"
)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: ``parser.add_argument(*options, **kwargs)``."""

    options: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest", self.options[0].lstrip("-").replace("-", "_"))

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(*self.options, **self.kwargs)


def _flag(*options: str, **kwargs: Any) -> Flag:
    return Flag(options, kwargs)


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (its keys are checked where it is used)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# The LLM constructor arguments, in --help order. A flag whose dest is an LLM argument is passed
# as it is when given; those in _MAPPED are mapped by engine_kwargs.
ENGINE_FLAGS: tuple[Flag, ...] = (
    _flag("--dtype", choices=list(DTYPES), help="the model's dtype (default: auto)"),
    _flag(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q is not None],
        help="8-bit linear weights, quantized while loading: int8 (weight-only) or fp8 (e4m3); "
        "default: the checkpoint's own (an FP8 / int8 checkpoint loads as it is)",
    ),
    _flag("--max-model-len", type=int, help="default: the model's max_position_embeddings"),
    _flag("--block-size", type=int),
    _flag("--num-kv-blocks", type=int, help="the KV pool's size, the null block included"),
    _flag(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        help="KV cache storage: auto (the model dtype) or FP8 (fp8 = fp8_e4m3, fp8_e5m2)",
    ),
    _flag(
        "--no-calculate-kv-scales",
        action="store_true",
        help="an FP8 KV cache whose checkpoint has no scales uses 1.0 instead of scales "
        "computed from a calibration pass at start-up",
    ),
    _flag(
        "--kv-offloading-size",
        type=float,
        metavar="GIB",
        help="GiB of host memory for a host KV tier (default 0: none)",
    ),
    _flag(
        "--preemption-mode",
        choices=list(PREEMPTION_MODES),
        help="a preempted request's KV: recompute (default), swap to the host tier, or auto "
        "(the cheaper of the two); swap and auto need --kv-offloading-size",
    ),
    _flag("--memory-utilization", type=float),
    _flag(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM's name of --memory-utilization (giving both with different values is an error)",
    ),
    _flag("--max-num-seqs", type=int, help="sequences in one step"),
    _flag("--max-num-batched-tokens", type=int, help="tokens in one step"),
    _flag(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="schedule and prepare the next step while the device runs this one (default: "
        "the execution plan's choice for the platform)",
    ),
    _flag("--attention-backend", choices=list(ATTENTION_BACKENDS)),
    _flag("--tensor-parallel-size", type=int),
    _flag("--revision", help="branch, tag or commit of a Hub model ID (default: main)"),
    _flag("--download-dir", help="Hugging Face cache folder for a Hub model ID"),
    _flag("--tokenizer", help="a folder whose tokenizer.json to use instead"),
    _flag(
        "--compilation-cache-dir",
        help="the persistent compilation cache's folder (default ~/.cache/jaxserve/xla; '' off)",
    ),
    _flag(
        "--precompiled",
        metavar="DIR",
        help="load the step executables `jaxserve compile --output DIR` wrote for this engine "
        "(refused, naming the field, when they were compiled for another)",
    ),
    _flag(
        "--seed",
        dest="engine_seed",
        metavar="SEED",
        type=int,
        help="the engine's seed (LLM(seed=...)); a request's own \"seed\" (a JSONL line's, an "
        "API body's) seeds that request",
    ),
    _flag("--no-prefix-caching", action="store_true"),
    _flag(
        "--no-warmup",
        action="store_true",
        help="compile each batch shape when it first runs instead of all at start-up",
    ),
    _flag(
        "--enable-background-warmup",
        action=argparse.BooleanOptionalAction,
        help="serve once the smallest batch shapes are compiled, the rest compiling in the "
        "background, each step capped at the largest ready meanwhile (default: on for "
        "`jaxserve serve`; refused offline)",
    ),
    _flag(
        "--speculative-config",
        type=json_object,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (greedy and seeded outputs do not change)',
    ),
    _flag(
        "--kv-transfer-config",
        type=json_object,
        metavar="JSON",
        help="share KV blocks with other engines, vLLM's keys, e.g. '{\"kv_connector\": "
        '"SharedStorageConnector", "kv_role": "kv_producer"}\' (disaggregated prefill: '
        "producers save their prompts' blocks, consumers load them; kv_connector "
        "SharedStorageConnector, RayStoreConnector or JaxTransferConnector: device to device)",
    ),
)
_MAPPED = {"engine_seed", "no_prefix_caching", "no_warmup", "no_calculate_kv_scales"}

# SamplingParams fields with a command-line flag (--top-p -> top_p). Not --seed: it seeds the
# engine, and one seed shared by every request would make equal prompts sample equal text.
SAMPLING_FLAGS: tuple[Flag, ...] = (
    _flag("--temperature", type=float),
    _flag("--top-p", type=float),
    _flag("--top-k", type=int),
    _flag("--min-p", type=float),
    _flag("--max-tokens", type=int),
    _flag("--min-tokens", type=int),
    _flag("--n", type=int, help="completions per prompt"),
    _flag("--stop", action="append", help="stop string (repeatable)"),
    _flag("--stop-token-ids", type=int, nargs="+", metavar="ID"),
    _flag("--logprobs", type=int, help="top-N logprobs per generated token"),
    _flag("--ignore-eos", action="store_true", default=None),
    _flag("--presence-penalty", type=float),
    _flag("--frequency-penalty", type=float),
    _flag("--repetition-penalty", type=float),
)


def add_engine_flags(
    parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None
) -> argparse._ArgumentGroup:
    """The engine flags (all, or the dests in ``only``) as one group of ``parser``."""
    group = parser.add_argument_group("engine (LLM arguments)")
    for flag in ENGINE_FLAGS:
        if only is None or flag.dest in only:
            flag.add_to(group)
    return group


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM constructor arguments from the engine flags (absent flags: the LLM's defaults)."""
    kwargs = {
        flag.dest: getattr(args, flag.dest)
        for flag in ENGINE_FLAGS
        if flag.dest not in _MAPPED and getattr(args, flag.dest, None) is not None
    }
    if getattr(args, "engine_seed", None) is not None:
        kwargs["seed"] = args.engine_seed
    if getattr(args, "no_prefix_caching", False):
        kwargs["enable_prefix_caching"] = False
    if getattr(args, "no_warmup", False):
        kwargs["warmup"] = False
    if getattr(args, "no_calculate_kv_scales", False):
        kwargs["calculate_kv_scales"] = False
    return kwargs


def job_kwargs(args: argparse.Namespace, preview: Callable[[], Any]) -> dict[str, Any]:
    """engine_kwargs for an offline job whose requests are known: with the job's warm-up
    (LLM's default, not --no-warmup), ``preview()`` (a JobPreview) as ``warmup_for``, so that
    the job's shapes compile while the weights load (engine/job_preview.py)."""
    kwargs = engine_kwargs(args)
    if kwargs.get("warmup", "job") == "job":
        kwargs["warmup_for"] = preview()
    return kwargs


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given in ``args`` as a command line again (for a child ``jaxserve
    serve``: a data-parallel replica)."""
    argv: list[str] = []
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag.dest, None)
        negatable = flag.kwargs.get("action") is argparse.BooleanOptionalAction
        if value is False and negatable:  # --no-async-scheduling, ... given
            argv.append("--no-" + flag.options[0][2:])
            continue
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag.options[0])
        else:
            argv += [flag.options[0], json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SamplingParams defaults)")
    for flag in SAMPLING_FLAGS:
        flag.add_to(group)


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams fields given on the command line (absent flags are left out, so that
    SamplingParams' own defaults apply).

    Raises:
        InputError: the flags make invalid SamplingParams (the field is named).
    """
    from jaxserve.jobs.generate import make_sampling_params

    names = (flag.dest for flag in SAMPLING_FLAGS)
    defaults = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    make_sampling_params(defaults, "command line")
    return defaults


def add_model_flag(
    parser: argparse.ArgumentParser, *, required: bool = False, help: str = ""
) -> None:
    parser.add_argument(
        "--model",
        required=required,
        default=None if required else DEFAULT_MODEL,
        help=help or MODEL_HELP,
    )


def add_job_flags(parser: argparse.ArgumentParser, input_help: str) -> None:
    """The flags of a resumable JSONL job (run-batch, score): input, output, model, progress."""
    parser.add_argument("-i", "--input", required=True, help=f"{input_help} (JSONL; '-': stdin)")
    parser.add_argument(
        "-o", "--output", required=True, help="the results file (JSONL, appended; resumable)"
    )
    add_model_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_overwrite_flag(parser)


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: start a job again (jobs/results.py replaces only a job's own file)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start the job again: replace the results file (only a file a jaxserve job wrote)",
    )


def fail(command: str, message: str) -> int:
    """Report bad input to ``jaxserve COMMAND`` on stderr; the exit code."""
    print(f"jaxserve {command}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _number(text: str, kind: type, lowest: float, open_below: bool) -> Any:
    bound = f"> {lowest}" if open_below else f">= {lowest}"
    noun = "an int" if kind is int else "a number"
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {noun} {bound}, got {text!r}") from None
    if not (value > lowest if open_below else value >= lowest):
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    return _number(text, int, 1, open_below=False)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (NaN refused)."""
    return _number(text, float, 0, open_below=True)


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 for any free one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {value}")
    return value


def log_to_stderr() -> None:
    """The servers' log lines ("jaxserve" at INFO, timestamped) on stderr, unless the
    embedding program configured the logger already."""
    logger = logging.getLogger("jaxserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s jaxserve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
