"""The score job: the log-probability of each line's continuation given its prompt.

Input, one pair a line (``id`` optional: the line's 0-based index)::

    {"id": "q1", "prompt": "The capital of France is", "continuation": " Paris"}
    {"prompt_token_ids": [1, 40, 41], "continuation_token_ids": [42, 43]}

Output: a job header (job_spec.py), then one line per pair, appended as pairs finish
(ResultsFile: a rerun skips the ids already written, after checking their pairs did not
change)::

    {"id": "q1", "logprob": -3.2, "token_logprobs": [-1.2, -2.0], "num_tokens": 2,
     "input_hash": "<16 hex digits>"}

Every line is checked (parsed, tokenized, its length checked) before any runs; a bad line stops
the job with its line number.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.job_preview import JobPreview, PreviewRequest
from jaxserve.engine.llm import LLM
from jaxserve.engine.scoring import SCORE_PARAMS, check_pair, continuation_logprobs
from jaxserve.jobs.job_spec import request_hash
from jaxserve.jobs.jsonl import (
    InputError,
    UniqueIds,
    check_fields,
    line_id,
    numbered_lines,
    parse_object,
)
from jaxserve.jobs.results import ResultsFile
from jaxserve.sampling_params import RequestOutputKind

_FIELDS = ("id", "prompt", "prompt_token_ids", "continuation", "continuation_token_ids")
# Fields every output record has (recognises an older, header-less results file).
RECORD_FIELDS = frozenset({"id", "logprob", "token_logprobs", "num_tokens"})


@dataclass(frozen=True)
class ScoreLine:
    id: str
    prompt: str | dict[str, list[int]]  # as LLM prompts: text, or {"prompt_token_ids": ...}
    continuation: str | dict[str, list[int]]
    where: str  # its input line ("pairs.jsonl:3")
    input_hash: str = ""  # job_spec.request_hash of (id, prompt, continuation)


def parse_score_lines(lines: Iterable[str], source: str) -> list[ScoreLine]:
    """Raises InputError: not JSON, an unknown field, not exactly one prompt and one
    continuation, an id that repeats, or no line at all."""
    parsed: list[ScoreLine] = []
    ids = UniqueIds("id")
    for line in numbered_lines(lines, source):
        obj = parse_object(line.text, line.where)
        check_fields(obj, _FIELDS, line.where, ", ".join(_FIELDS))
        item_id = line_id(obj, "id", len(parsed), line.where)
        ids.add(item_id, line)
        prompt = _one_of(obj, "prompt", line.where)
        continuation = _one_of(obj, "continuation", line.where)
        # The id is hashed too: an implicit id is a line index, and a deleted line must not
        # let index 0 name another pair's score.
        digest = request_hash([item_id, prompt, continuation])
        parsed.append(ScoreLine(item_id, prompt, continuation, line.where, digest))
    if not parsed:
        raise InputError(f"{source}: no lines to score")
    return parsed


def _one_of(obj: dict[str, Any], name: str, where: str) -> str | dict[str, list[int]]:
    text, ids = obj.get(name), obj.get(f"{name}_token_ids")
    if (text is None) == (ids is None):
        raise InputError(f"{where}: give exactly one of '{name}' and '{name}_token_ids'")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise InputError(f"{where}: field '{name}' must be a non-empty string")
        return text
    return {"prompt_token_ids": ids}  # checked (type, vocabulary) by the engine


def job_preview(todo: list[ScoreLine]) -> JobPreview:
    """The pairs to score as the engine's construction takes them (LLM(warmup_for=...)), so
    that their shapes compile while the weights load (engine/job_preview.py)."""
    return JobPreview(
        tuple(PreviewRequest(item.prompt, SCORE_PARAMS, item.continuation) for item in todo)
    )


def score_lines(llm: LLM, lines: list[ScoreLine], results: ResultsFile) -> Iterator[dict[str, Any]]:
    """Score every line not in ``results.done``; yield (and append) each record as its pair
    finishes.

    Raises:
        InputError: a pair the engine refuses (named by its input line), before any runs.
    """
    todo = [item for item in lines if item.id not in results.done]
    pairs = []
    for item in todo:
        try:
            pairs.append(check_pair(llm.engine, item.prompt, item.continuation))
        except (TypeError, ValueError) as e:
            raise InputError(f"{item.where} (prompt + continuation): {e}") from None
    if not todo:
        return
    num_prompt = {item.id: p.num_prompt_tokens for item, p in zip(todo, pairs, strict=True)}
    hash_of = {item.id: item.input_hash for item in todo}
    params = SCORE_PARAMS.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    outputs = llm.stream([p.token_ids for p in pairs], params, request_ids=[i.id for i in todo])
    for out in outputs:
        token_logprobs = continuation_logprobs(out, num_prompt[out.request_id])
        record = {
            "id": out.request_id,
            "logprob": sum(token_logprobs),
            "token_logprobs": token_logprobs,
            "num_tokens": len(token_logprobs),
            "input_hash": hash_of[out.request_id],
        }
        results.append(record)
        yield record
