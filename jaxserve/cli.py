"""The ``jaxserve`` command: ``jaxserve generate`` (offline batch generation), ``jaxserve convert``
(cli_convert.py), ``jaxserve plan`` (cli_plan.py: will a model fit) and a hook for more.

Adding a subcommand: write a module with ``add_parser(subparsers) -> None`` that calls
``subparsers.add_parser(name, ...)``, adds its arguments and ``set_defaults(run=...)`` with
``run(args: argparse.Namespace) -> int`` (the exit code); import jax and other heavy modules
inside ``run``, so that ``jaxserve --help`` stays fast. Then append
``lazy_subcommand("that.module")`` to SUBCOMMANDS below.

``jaxserve generate`` reads prompts (``--prompt``, repeatable, or ``--input`` JSONL), runs
``LLM.generate`` and writes one JSON object per completion (``--output``) or prints them, then a
summary. Bad input exits with code 2 and a message naming the line and the field: a bad line
or flag, a prompt the engine refuses (too long, a token outside the vocabulary; the line and
its request_id are named), a missing or malformed model folder (the file is named).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from jaxserve.checkpoints_tools.interrupt import sigint_guard
from jaxserve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATIONS
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.outputs import RequestOutput

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

EXIT_BAD_INPUT = 2  # argparse's own code for a bad command line

# Fields of a JSONL line besides the SamplingParams fields.
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "request_id")
# SamplingParams constructor arguments (excludes the normalised views filled by __post_init__).
# output_kind is for streaming consumers (AsyncLLM); a JSONL job reads final outputs only.
SAMPLING_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"
)
# SamplingParams fields with a command-line flag (--top-p -> top_p). Not --seed: it seeds the
# engine, and one seed shared by every request would make equal prompts sample equal text.
_SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "logprobs",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class InputError(ValueError):
    """Bad user input to the CLI; the message names where (line, flag) and which field."""


@dataclass(frozen=True)
class PromptRequest:
    """One prompt to generate for, parsed and validated.

    Exactly one of prompt / prompt_token_ids is set.
    """

    request_id: str  # the user's id (JSONL "request_id") or the 0-based request index
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    where: str = field(default="", compare=False)  # its input line ("p.jsonl:3", "--prompt 2")

    def engine_prompt(self) -> str | dict[str, list[int]]:
        """The prompt in the form LLM.generate takes."""
        if self.prompt is not None:
            return self.prompt
        assert self.prompt_token_ids is not None
        return {"prompt_token_ids": self.prompt_token_ids}


def make_sampling_params(fields: dict[str, Any], where: str) -> SamplingParams:
    """SamplingParams(**fields), with its TypeError/ValueError prefixed by ``where``."""
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: {e}") from None


def _parse_prompt(obj: dict[str, Any], where: str) -> tuple[str | None, list[int] | None]:
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise InputError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
    if has_text:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise InputError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
        return prompt, None
    ids = obj["prompt_token_ids"]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise InputError(
            f"{where}: field 'prompt_token_ids' must be a non-empty list of ints >= 0, "
            f"got {ids!r:.200}"
        )
    return None, ids


def parse_prompt_line(line: str, where: str, defaults: dict[str, Any], index: int) -> PromptRequest:
    """One JSONL line -> PromptRequest.

    Args:
        line: a JSON object with "prompt" (str) or "prompt_token_ids" (list of int), an optional
            "request_id" (str or int) and optional SamplingParams fields, which override
            ``defaults``.
        where: where the line is, for messages ("prompts.jsonl:3").
        defaults: SamplingParams fields from the command line.
        index: the request's 0-based index, its id when the line gives none.

    Raises:
        InputError: not JSON, not an object, an unknown field, a bad prompt, request id or
            sampling field; the message starts with ``where`` and names the field.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_PROMPT_FIELDS) - set(SAMPLING_FIELDS))
    if unknown:
        raise InputError(
            f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(_PROMPT_FIELDS)} and the "
            f"SamplingParams fields {', '.join(SAMPLING_FIELDS)})"
        )
    prompt, prompt_token_ids = _parse_prompt(obj, where)
    request_id = obj.get("request_id", index)
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise InputError(
            f"{where}: field 'request_id' must be a string or an int, got {request_id!r}"
        )
    sampling = {k: v for k, v in obj.items() if k in SAMPLING_FIELDS}
    params = make_sampling_params({**defaults, **sampling}, where)
    return PromptRequest(str(request_id), prompt, prompt_token_ids, params, where)


def read_prompt_lines(
    lines: Iterable[str], source: str, defaults: dict[str, Any]
) -> list[PromptRequest]:
    """Parse JSONL prompt lines (blank lines are skipped; line numbers count from 1).

    Raises:
        InputError: a bad line (see parse_prompt_line), a duplicate request id, or no prompt.
    """
    requests: list[PromptRequest] = []
    first_line_of: dict[str, int] = {}
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_number}"
        request = parse_prompt_line(line, where, defaults, len(requests))
        if request.request_id in first_line_of:
            raise InputError(
                f"{where}: field 'request_id' {request.request_id!r} repeats line "
                f"{first_line_of[request.request_id]}"
            )
        first_line_of[request.request_id] = line_number
        requests.append(request)
    if not requests:
        raise InputError(f"{source}: no prompts")
    return requests


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams fields given on the command line (absent flags are left out, so that
    SamplingParams' own defaults apply).

    Raises:
        InputError: the flags make invalid SamplingParams (the field is named).
    """
    defaults = {
        name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None
    }
    make_sampling_params(defaults, "command line")
    return defaults


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM constructor arguments from the engine flags (absent flags: the LLM's defaults)."""
    names = (
        "dtype",
        "max_model_len",
        "block_size",
        "num_kv_blocks",
        "memory_utilization",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_num_batched_tokens",
        "attention_backend",
        "tensor_parallel_size",
        "revision",
        "download_dir",
        "tokenizer",
        "compilation_cache_dir",
        "kv_cache_dtype",
        "kv_offloading_size",
        "preemption_mode",
        "quantization",
    )
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.engine_seed is not None:
        kwargs["seed"] = args.engine_seed
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.no_warmup:
        kwargs["warmup"] = False
    return kwargs


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
    from jaxserve.cli_jobs import read_input_lines

    try:
        lines = read_input_lines(args.input)
    except InputError as e:
        raise InputError(f"--input: {e}") from None
    return read_prompt_lines(lines, "<stdin>" if args.input == "-" else args.input, defaults)


def _logprobs_record(completion_logprobs: list[dict[int, Any]]) -> list[list[dict[str, Any]]]:
    # Per generated position, the sampled token first then the top-N, as the engine ordered them.
    # JSON object keys must be strings, so each entry carries its token id instead.
    return [
        [
            {
                "token_id": token_id,
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in position.items()
        ]
        for position in completion_logprobs
    ]


def output_records(request: PromptRequest, output: RequestOutput) -> list[dict[str, Any]]:
    """The JSONL records of one request: one per completion (``SamplingParams.n`` of them)."""
    records = []
    for completion in output.outputs:
        record: dict[str, Any] = {
            "request_id": request.request_id,
            "index": completion.index,
            "prompt": request.prompt,
            "prompt_token_ids": list(output.prompt_token_ids),
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "cumulative_logprob": completion.cumulative_logprob,
        }
        if request.params.logprobs is not None:
            record["logprobs"] = _logprobs_record(completion.logprobs or [])
        if request.params.prompt_logprobs is not None:
            # Per prompt position (the first has none: null), as the generated logprobs.
            record["prompt_logprobs"] = [
                None if position is None else _logprobs_record([position])[0]
                for position in output.prompt_logprobs or []
            ]
        records.append(record)
    return records


def write_jsonl(records: Iterable[dict[str, Any]], out: IO[str]) -> None:
    # ensure_ascii=False keeps generated text readable; json writes -inf logprobs as -Infinity,
    # which Python's json (and most JSONL readers) read back.
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def format_completion(record: dict[str, Any]) -> str:
    """A printed completion: its id, prompt, text (or token ids when the model has no
    tokenizer) and finish reason."""
    prompt = record["prompt"] if record["prompt"] is not None else record["prompt_token_ids"]
    body = repr(record["text"]) if record["text"] else f"token_ids={record['token_ids']}"
    return (
        f"[{record['request_id']}.{record['index']}] {prompt!r} -> {body} "
        f"({len(record['token_ids'])} tokens, finish_reason={record['finish_reason']})"
    )


def format_summary(
    outputs: Sequence[RequestOutput], stats: dict[str, Any], elapsed_s: float, load_s: float
) -> str:
    """The run summary: token counts, throughput and the engine's cache statistics."""
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_completions = sum(len(o.outputs) for o in outputs)
    throughput = num_output_tokens / elapsed_s if elapsed_s > 0 else math.inf
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    hit_rate = f"{hits / queries:.1%}" if queries else "n/a"
    num_used = stats["num_usable_kv_blocks"] - stats["num_free_kv_blocks"]
    return "\n".join(
        [
            f"requests:           {len(outputs)} ({num_completions} completions)",
            f"prompt tokens:      {num_prompt_tokens}",
            f"output tokens:      {num_output_tokens}",
            f"elapsed:            {elapsed_s:.2f} s (model load {load_s:.2f} s not included)",
            f"output throughput:  {throughput:.1f} tokens/s",
            f"KV cache:           {num_used}/{stats['num_usable_kv_blocks']} blocks in use "
            f"({stats['kv_cache_usage']:.1%}), peak slot utilization "
            f"{stats['peak_kv_slot_utilization']:.1%}",
            f"prefix cache hits:  {hit_rate} ({hits}/{queries} tokens)",
            f"engine:             {stats['num_steps']} steps, {stats['num_preemptions']} "
            f"preemptions, {stats['num_compilations']} compilations "
            f"({stats.get('num_compilation_cache_hits', 0)} more loaded from the cache)",
        ]
    )


def check_requests(engine: LLMEngine, requests: Sequence[PromptRequest]) -> None:
    """Run the engine's own checks (vocabulary, tokenization, max_model_len, pool size) on
    every request before any is queued.

    Raises:
        InputError: naming the request's input line and request_id.
    """
    for request in requests:
        try:
            engine.check_request(request.engine_prompt(), request.params)
        except (TypeError, ValueError) as e:
            raise InputError(f"{request.where} (request_id {request.request_id!r}): {e}") from None


def run_generate(args: argparse.Namespace) -> int:
    """``jaxserve generate``: the exit code (0, or 2 for bad input: a bad line or flag, a
    missing or malformed model).

    With ``--output``, records are appended as requests finish (ResultsFile: crash-safe), and
    a rerun of the same command skips the requests already in the file."""
    try:
        requests = collect_requests(args)
    except InputError as e:
        return _fail(str(e))
    results = None
    if args.output is not None:
        try:
            results = _open_results(args, requests)
        except (OSError, ValueError) as e:
            return _fail(f"--output: {e}")
        requests = [r for r in requests if r.request_id not in results.done]
    from jaxserve.engine.llm import LLM  # jax loads here, not for --help or bad input

    try:
        start = time.perf_counter()
        llm = LLM(model=args.model, **engine_kwargs(args))
        load_s = time.perf_counter() - start
        check_requests(llm.engine, requests)
    except (OSError, TypeError, ValueError) as e:  # bad model or input (docs/architecture.md)
        if results is not None:
            results.close()
        return _fail(str(e))
    try:
        outputs, elapsed_s = _generate(llm, requests, results, progress=not args.no_progress)
    finally:
        if results is not None:
            results.close()
    if results is None:
        for req, out in zip(requests, outputs, strict=True):
            for record in output_records(req, out):
                print(format_completion(record))
    else:
        print(f"already done:       {len(results.done)} requests (in {args.output})")
    print(format_summary(outputs, llm.get_stats(), elapsed_s, load_s))
    return 0


def _open_results(args: argparse.Namespace, requests: Sequence[PromptRequest]):
    """The --output file, recovered and checked against this job (cli_jobs.open_results): a
    request counts as done once all its n records are in."""
    from jaxserve.cli_jobs import job_settings, open_results

    n_of = {r.request_id: r.params.n for r in requests}
    return open_results(
        args,
        "generate",
        lambda record: str(record["request_id"]),
        {r.request_id: request_hash(r) for r in requests},
        record_fields=frozenset({"request_id", "index", "token_ids"}),
        # one setting per sampling flag, so that a changed flag is named on its own
        settings=job_settings(
            args, **{f"sampling.{k}": v for k, v in sampling_defaults(args).items()}
        ),
        expected=lambda request_id: n_of.get(request_id, 1),
    )


def request_hash(request: PromptRequest) -> str:
    """The hash a --output record stores of its request (prompt and every sampling field)."""
    from jaxserve.jobs.job_spec import request_hash as hash_of

    params = {name: getattr(request.params, name) for name in SAMPLING_FIELDS}
    return hash_of([request.prompt, request.prompt_token_ids, params])


def _generate(llm, requests: Sequence[PromptRequest], results, *, progress: bool):
    """Run the requests: (their outputs in input order, seconds). Each finished request's
    records go to ``results`` (when given) at once."""
    from tqdm.auto import tqdm

    final = RequestOutputKind.FINAL_ONLY
    params = [dataclasses.replace(r.params, output_kind=final) for r in requests]
    by_id: dict[str, RequestOutput] = {}
    bar = tqdm(total=len(requests), desc="Processed prompts", disable=not progress)
    # While the batch runs, keep the cyclic GC from rescanning the engine's many long-lived
    # objects at every collection (as vLLM's engine process does). A library LLM never
    # freezes (a notebook must get a dropped LLM back), so this ends with the run.
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    num_out = 0
    try:
        if requests:
            ids = [r.request_id for r in requests]
            prompts = [r.engine_prompt() for r in requests]
            index_of = {rid: i for i, rid in enumerate(ids)}
            for out in llm.stream(prompts, params, request_ids=ids):
                by_id[out.request_id] = out
                num_out += sum(len(c.token_ids) for c in out.outputs)
                if results is not None:
                    request = requests[index_of[out.request_id]]
                    stamp = {"input_hash": request_hash(request)}
                    results.append(*({**r, **stamp} for r in output_records(request, out)))
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"out: {num_out / elapsed:.1f} tok/s", refresh=False)
                bar.update(1)
    finally:
        gc.unfreeze()
        bar.close()
    elapsed_s = time.perf_counter() - start
    return [by_id[r.request_id] for r in requests], elapsed_s


def _fail(message: str) -> int:
    print(f"jaxserve generate: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``jaxserve generate``."""
    p = subparsers.add_parser(
        "generate",
        help="generate completions for prompts (offline batch)",
        description="Generate completions with jaxserve's LLM. Sampling flags are defaults; a "
        "JSONL line's own SamplingParams fields override them.",
    )
    p.set_defaults(run=run_generate)
    p.add_argument(
        "--model",
        default="tiny-random-llama",
        help="a built-in model name, an HF or Orbax checkpoint folder, or a Hugging Face Hub "
        "model ID (org/name; HF_HOME and HF_HUB_OFFLINE apply)",
    )
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

    s = p.add_argument_group("sampling (SamplingParams defaults)")
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--min-tokens", type=int)
    s.add_argument("--n", type=int, help="completions per prompt")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="+", metavar="ID")
    s.add_argument("--logprobs", type=int, help="top-N logprobs per generated token")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    s.add_argument("--presence-penalty", type=float)
    s.add_argument("--frequency-penalty", type=float)
    s.add_argument("--repetition-penalty", type=float)

    add_engine_flags(p)


def add_job_flags(parser: argparse.ArgumentParser, input_help: str) -> None:
    """The flags of a resumable JSONL job (run-batch, score): input, output, model, progress."""
    parser.add_argument("-i", "--input", required=True, help=f"{input_help} (JSONL; '-': stdin)")
    parser.add_argument(
        "-o", "--output", required=True, help="the results file (JSONL, appended; resumable)"
    )
    parser.add_argument(
        "--model",
        default="tiny-random-llama",
        help="a built-in model name, an HF or Orbax checkpoint folder, or a Hub model ID",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_overwrite_flag(parser)


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: start a job again (jobs/results.py replaces only a job's own file)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start the job again: replace the results file (only a file a jaxserve job wrote)",
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the engine flags (the LLM constructor arguments that ``engine_kwargs`` reads) to
    ``parser`` as one group; shared by every subcommand that builds an engine."""
    e = parser.add_argument_group("engine (LLM arguments)")
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q is not None],
        help="8-bit linear weights, quantized while loading: int8 (weight-only) or fp8 (e4m3); "
        "default: the checkpoint's own (an FP8 / int8 checkpoint loads as it is)",
    )
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-kv-blocks", type=int)
    e.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        help="KV cache storage: auto (the model dtype) or FP8 (fp8 = fp8_e4m3, fp8_e5m2)",
    )
    e.add_argument(
        "--kv-offloading-size",
        type=float,
        metavar="GIB",
        help="GiB of host memory for a host KV tier (default 0: none)",
    )
    e.add_argument(
        "--preemption-mode",
        choices=list(PREEMPTION_MODES),
        help="a preempted request's KV: recompute (default), swap to the host tier, or auto "
        "(the cheaper of the two); swap and auto need --kv-offloading-size",
    )
    e.add_argument("--memory-utilization", type=float)
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM's name of --memory-utilization (giving both with different values is an error)",
    )
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--no-warmup",
        action="store_true",
        help="compile each batch shape when it first runs instead of all at start-up",
    )
    e.add_argument(
        "--compilation-cache-dir",
        help="the persistent compilation cache's folder (default ~/.cache/jaxserve/xla; '' off)",
    )
    e.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS))
    e.add_argument("--tensor-parallel-size", type=int)
    e.add_argument("--revision", help="branch, tag or commit of a Hub model ID (default: main)")
    e.add_argument("--download-dir", help="Hugging Face cache folder for a Hub model ID")
    e.add_argument("--tokenizer", help="a folder whose tokenizer.json to use instead")
    e.add_argument(
        "--seed",
        dest="engine_seed",
        metavar="SEED",
        type=int,
        help="the engine's seed (LLM(seed=...)); a request's own \"seed\" (a JSONL line's, an "
        "API body's) seeds that request",
    )
    return e


def lazy_subcommand(module: str) -> AddParser:
    """A subcommand whose module is imported only when the parser is built."""
    return lambda subparsers: importlib.import_module(module).add_parser(subparsers)


# One entry per subcommand, in --help order.
SUBCOMMANDS: list[AddParser] = [
    add_generate_parser,
    lazy_subcommand("jaxserve.cli_convert"),
    lazy_subcommand("jaxserve.cli_plan"),
    lazy_subcommand("jaxserve.cli_serve"),
    lazy_subcommand("jaxserve.cli_run_batch"),
    lazy_subcommand("jaxserve.cli_score"),
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
        from jaxserve.cli_jobs import EXIT_INTERRUPTED, interrupted_message

        print(interrupted_message(args), file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
