"""``jaxserve generate``'s job: prompts in, completions out (the command line is cli/generate.py).

A prompt line (JSONL, read by jsonl.py) is ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}``
with an optional ``"request_id"`` and optional SamplingParams fields, which override the command
line's sampling flags. Every request is checked by the engine (vocabulary, tokenization,
max_model_len, pool size) before any is queued; a bad one names its line and request_id. Each
finished request's records (one per completion) go to the results file at once, so a rerun
skips what is done.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from jaxserve.jobs.job_spec import request_hash as hash_of
from jaxserve.jobs.jsonl import (
    InputError,
    UniqueIds,
    check_fields,
    line_id,
    numbered_lines,
    parse_object,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.engine.job_preview import JobPreview
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.llm_engine import CheckedRequest, LLMEngine
    from jaxserve.jobs.results import ResultsFile
    from jaxserve.outputs import RequestOutput

# Fields of a JSONL line besides the SamplingParams fields.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "request_id")
# SamplingParams constructor arguments (excludes the normalised views filled by __post_init__).
# output_kind is for streaming consumers (AsyncLLM); a JSONL job reads final outputs only.
SAMPLING_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"
)
# Fields every output record has (recognises an older, header-less results file).
RECORD_FIELDS = frozenset({"request_id", "index", "token_ids"})


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


def parse_prompt_line(text: str, where: str, defaults: dict[str, Any], index: int) -> PromptRequest:
    """One JSONL line -> PromptRequest.

    Args:
        text: a JSON object with "prompt" (str) or "prompt_token_ids" (list of int), an optional
            "request_id" (str or int) and optional SamplingParams fields, which override
            ``defaults``.
        where: where the line is, for messages ("prompts.jsonl:3").
        defaults: SamplingParams fields from the command line.
        index: the request's 0-based index, its id when the line gives none.

    Raises:
        InputError: not JSON, not an object, an unknown field, a bad prompt, request id or
            sampling field; the message starts with ``where`` and names the field.
    """
    obj = parse_object(text, where)
    check_fields(
        obj,
        (*PROMPT_FIELDS, *SAMPLING_FIELDS),
        where,
        f"{', '.join(PROMPT_FIELDS)} and the SamplingParams fields {', '.join(SAMPLING_FIELDS)}",
    )
    prompt, prompt_token_ids = _parse_prompt(obj, where)
    request_id = line_id(obj, "request_id", index, where)
    sampling = {k: v for k, v in obj.items() if k in SAMPLING_FIELDS}
    params = make_sampling_params({**defaults, **sampling}, where)
    return PromptRequest(request_id, prompt, prompt_token_ids, params, where)


def read_prompt_lines(
    lines: Iterable[str], source: str, defaults: dict[str, Any]
) -> list[PromptRequest]:
    """Parse JSONL prompt lines (blank lines are skipped; line numbers count from 1).

    Raises:
        InputError: a bad line (see parse_prompt_line), a duplicate request id, or no prompt.
    """
    requests: list[PromptRequest] = []
    ids = UniqueIds("field 'request_id'")
    for line in numbered_lines(lines, source):
        request = parse_prompt_line(line.text, line.where, defaults, len(requests))
        ids.add(request.request_id, line)
        requests.append(request)
    if not requests:
        raise InputError(f"{source}: no prompts")
    return requests


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
    spec = []
    if "spec_decode_num_draft_tokens" in stats:
        spec = [
            f"speculation:        {stats['spec_decode_num_accepted_tokens']}/"
            f"{stats['spec_decode_num_draft_tokens']} drafts accepted "
            f"({stats['spec_decode_acceptance_rate']:.1%}), "
            f"{stats['spec_decode_mean_accepted_length']:.2f} tokens per verification"
        ]
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
            *spec,
        ]
    )


def check_requests(engine: LLMEngine, requests: Sequence[PromptRequest]) -> list[CheckedRequest]:
    """Run the engine's own checks (vocabulary, tokenization, max_model_len, pool size) on
    every request before any is queued; returns them checked (for the job's warm-up).

    Raises:
        InputError: naming the request's input line and request_id.
    """
    checked = []
    for request in requests:
        try:
            checked.append(engine.check_request(request.engine_prompt(), request.params))
        except (TypeError, ValueError) as e:
            raise InputError(f"{request.where} (request_id {request.request_id!r}): {e}") from None
    return checked


def job_preview(requests: Sequence[PromptRequest]) -> JobPreview:
    """The requests as the engine's construction takes them (LLM(warmup_for=...)), so that
    their shapes compile while the weights load (engine/job_preview.py)."""
    from jaxserve.engine.job_preview import JobPreview

    return JobPreview.of([r.engine_prompt() for r in requests], [r.params for r in requests])


def request_hash(request: PromptRequest) -> str:
    """The hash a --output record stores of its request (prompt and every sampling field)."""
    params = {name: getattr(request.params, name) for name in SAMPLING_FIELDS}
    return hash_of([request.prompt, request.prompt_token_ids, params])


def generate(
    llm: LLM, requests: Sequence[PromptRequest], results: ResultsFile | None, *, progress: bool
) -> tuple[list[RequestOutput], float]:
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
