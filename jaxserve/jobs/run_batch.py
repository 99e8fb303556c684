"""run-batch: a job in OpenAI's batch format, through the server's own handlers.

Input, one request a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {...}}

Output: a job header (job_spec.py), then one line per input line, appended as requests finish
(ResultsFile: crash-safe; a rerun skips every custom_id already written, after checking that
its request did not change)::

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {<what POST url answers>}},
     "error": null, "input_hash": "<16 hex digits>"}

A request the handlers refuse (a bad field, a prompt over the context) gets its status code
and OpenAI's error body as its response; a line that is not a request at all (not JSON, no
custom_id, an unknown url or method, streaming) gets ``"response": null`` and ``"error":
{"code", "message", "line"}``. Duplicate custom_ids are refused before anything runs.

The requests run through AsyncLLM with their final outputs only, at most ``max_in_flight`` at
a time, so the engine always has work queued and nothing is tokenized far ahead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.entrypoints.openai.request_outputs import api_error
from jaxserve.entrypoints.openai.serving import OpenAIServing
from jaxserve.jobs.job_spec import request_hash
from jaxserve.jobs.jsonl import (
    InputError,
    JsonlLine,
    LineError,
    NestedTooDeeplyError,
    UniqueIds,
    numbered_lines,
    parse_object,
)
from jaxserve.jobs.results import ResultsFile

URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class BatchLine:
    """One input line: a request, or why it is not one (``error``)."""

    line: int  # 1-based line number in the input
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: str | None = None
    input_hash: str = ""  # job_spec.request_hash of the request (or of the bad line's text)

    @property
    def key(self) -> str | tuple[str, int]:
        """Its key in the output: the custom_id, or ("line", its line) for a line without one
        (a tuple, so that no custom_id, a string, can collide with it)."""
        return self.custom_id if self.custom_id is not None else ("line", self.line)


def parse_batch_lines(lines: Iterable[str], source: str) -> list[BatchLine]:
    """Parse the input (blank lines skipped).

    Raises:
        InputError: a custom_id that repeats (both lines named), a line nested too deeply to
            read, or no request at all.
    """
    parsed: list[BatchLine] = []
    custom_ids = UniqueIds("custom_id")
    for line in numbered_lines(lines, source):
        item = _parse_line(line)
        if item.custom_id is not None:
            custom_ids.add(item.custom_id, line)
        parsed.append(item)
    if not parsed:
        raise InputError(f"{source}: no requests")
    return parsed


def _parse_line(line: JsonlLine) -> BatchLine:
    item = _parse_request(line)
    request = line.text.strip() if item.error is not None else [item.url, item.body]
    return dataclasses.replace(item, input_hash=request_hash(request))


def _parse_request(line: JsonlLine) -> BatchLine:
    number = line.number
    try:
        obj = parse_object(line.text, line.where)
    except NestedTooDeeplyError:
        raise
    except LineError as e:  # the line gets an error record; the others run
        return BatchLine(number, None, error=e.reason)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(
            number, None, error=f"'custom_id' must be a non-empty string, got {custom_id!r}"
        )
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return BatchLine(number, custom_id, error=f"unknown field {unknown[0]!r}")
    if obj.get("method", "POST") != "POST":
        return BatchLine(number, custom_id, error=f"'method' must be POST, got {obj['method']!r}")
    url = obj.get("url")
    if url not in URLS:
        return BatchLine(number, custom_id, error=f"'url' must be one of {URLS}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, error=f"'body' must be an object, got {body!r:.100}")
    if body.get("stream"):
        return BatchLine(number, custom_id, error="'body.stream' must be false in a batch")
    return BatchLine(number, custom_id, url, body)


def output_key(record: dict[str, Any]) -> str | tuple[str, int]:
    """The key of an output record (ResultsFile's), matching BatchLine.key."""
    if record["custom_id"] is not None:
        return record["custom_id"]
    return ("line", record["error"]["line"])


# Fields every output record has (recognises an older, header-less results file).
RECORD_FIELDS = frozenset({"id", "custom_id", "response", "error"})


@dataclass
class BatchSummary:
    total: int  # requests in the input
    done_before: int  # already in the output when this run began
    succeeded: int = 0  # answered 200 in this run
    failed: int = 0  # an error line or a non-200 status in this run
    output_tokens: int = 0
    elapsed_s: float = 0.0


async def run_batch(
    engine: AsyncLLM,
    lines: list[BatchLine],
    results: ResultsFile,
    *,
    served_model_name: str,
    max_in_flight: int,
    progress: bool = True,
    tool_call_parser: str | None = None,
) -> BatchSummary:
    """Run every line not in ``results.done``; write each line's record as it finishes.
    ``tool_call_parser``: as the server's, for tool_choice "auto" (tool_parsers/)."""
    from tqdm.auto import tqdm

    serving = OpenAIServing(engine, served_model_name, tool_call_parser=tool_call_parser)
    todo = [item for item in lines if item.key not in results.done]
    summary = BatchSummary(total=len(lines), done_before=len(lines) - len(todo))
    bar = tqdm(total=len(lines), initial=summary.done_before, desc="Requests", disable=not progress)
    slots = asyncio.Semaphore(max_in_flight)
    start = time.perf_counter()

    async def one(item: BatchLine) -> None:
        async with slots:
            record = await _answer(serving, item)
        status = (record["response"] or {}).get("status_code")
        if status == 200:
            summary.succeeded += 1
            summary.output_tokens += record["response"]["body"]["usage"]["completion_tokens"]
        else:
            summary.failed += 1
        results.append(record)
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(
            f"out: {summary.output_tokens / elapsed:.1f} tok/s, failed: {summary.failed}",
            refresh=False,
        )
        bar.update(1)

    await _warm_up(serving, todo)
    tasks = [asyncio.ensure_future(one(item)) for item in todo]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # on an error or an interrupt: abort what still runs
        await asyncio.gather(*tasks, return_exceptions=True)
        results.flush()
        bar.close()
        summary.elapsed_s = time.perf_counter() - start
    return summary


async def _warm_up(serving: OpenAIServing, todo: list[BatchLine]) -> None:
    """With a per-job warm-up (AsyncLLM(warmup="job"), the CLI's default), compile the step
    shapes every request of the job can reach before the first one runs: each line's body goes
    through its handler in checks-only mode (parsed, templated, tokenized, nothing started).
    A line the handler refuses is left out (its record says why when it runs)."""
    engine = serving.engine
    if engine.config.runner.warmup != "job":
        return
    checked = []
    for item in todo:
        if item.error is None:
            try:
                checked += await serving.checked_requests(item.url, item.body)
            except OpenAIError:
                continue
    await engine.warm_up(checked)


async def _answer(serving: OpenAIServing, item: BatchLine) -> dict[str, Any]:
    """The output record of one line."""
    record: dict[str, Any] = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.custom_id,
        "response": None,
        "error": None,
        "input_hash": item.input_hash,
    }
    if item.error is not None:
        record["error"] = {"code": "invalid_request", "message": item.error, "line": item.line}
        return record
    handler = (
        serving.create_completion
        if item.url == "/v1/completions"
        else serving.create_chat_completion
    )
    try:
        body = await handler(item.body)
        status = 200
    except Exception as e:
        error = api_error(e)
        if not isinstance(error, OpenAIError):
            raise  # a bug, not a bad request: the job stops (and can be resumed)
        body, status = error.body(), error.status_code
    request_id = body.get("id", record["id"]) if status == 200 else record["id"]
    record["response"] = {"status_code": status, "request_id": request_id, "body": body}
    return record
