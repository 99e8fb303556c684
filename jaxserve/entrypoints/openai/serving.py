"""OpenAIServing: the OpenAI endpoints as async handlers over an AsyncLLM, free of any web
framework, so that the HTTP server (api_server.py) and a batch job write the same bodies.

``create_completion(body)`` and ``create_chat_completion(body)`` take the JSON body as a dict
and return the response body (a dict) or, with ``"stream": true``, an ``EventStream`` of
server-sent events (``"data: {json}\\n\\n"`` strings, then ``"data: [DONE]\\n\\n"``). They raise
``OpenAIError`` (status code and OpenAI's error body): 400 bad input, 404 an unknown model name,
503 a full waiting queue, 500 an engine failure.

Every prompt of a request is validated (tokenized, its length checked against max_model_len)
before any is queued. A streaming response starts only once every prompt of it has produced its
first output, so a full queue is a 503 and not an error inside a 200 stream. Closing an
EventStream (the server does when the client goes away) or cancelling a handler aborts the
engine requests: each engine generator is driven by a task of its own, which ``close()``
cancels, and AsyncLLM aborts a request whose generator is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import jinja2

from jaxserve.engine.async_llm import AsyncLLM, CheckedRequest, EngineError, QueueFullError
from jaxserve.entrypoints.openai.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    echo_logprobs,
    echo_only,
    num_logprobs,
    parse_chat_request,
    parse_completion_request,
    prompt_logprobs_body,
    requested_max_tokens,
    sampling_params,
    sse,
    usage,
    with_max_tokens,
)
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")

_Item = tuple[int, RequestOutput | None, BaseException | None]


def api_error(error: BaseException) -> BaseException:
    """The OpenAIError an engine exception answers with (others are passed on: a bug, a 500)."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, QueueFullError):
        return OpenAIError(f"the server is busy: {error}; retry later", status_code=503)
    if isinstance(error, EngineError):
        return OpenAIError(f"the engine failed: {error}", status_code=500)
    if isinstance(error, (TypeError, ValueError)):
        return OpenAIError(str(error))
    return error


class RequestOutputs:
    """The outputs of the engine requests of one API request (one per prompt), interleaved as
    they come: an async iterator of (prompt index, RequestOutput).

    Each engine generator runs in a task of its own; ``close()`` cancels them (synchronously,
    so it also works from a ``finally`` that a cancellation is passing through), which aborts
    every request not finished yet.
    """

    def __init__(self, engine: AsyncLLM, requests: list[tuple[str, CheckedRequest]]) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._ready: deque[_Item] = deque()
        self._num_live = len(requests)
        self._tasks = [
            asyncio.ensure_future(self._pump(i, engine.generate(checked, None, request_id)))
            for i, (request_id, checked) in enumerate(requests)
        ]

    async def _pump(self, index: int, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in outputs:
                self._queue.put_nowait((index, output, None))
        except Exception as e:  # handed to the consumer, which raises it
            self._queue.put_nowait((index, None, e))
            return
        self._queue.put_nowait((index, None, None))

    async def wait_started(self) -> None:
        """Wait until every request has given its first output: the engine's admission errors
        (QueueFullError) raise here, as OpenAIError."""
        started: set[int] = set()
        try:
            while len(started) < len(self._tasks):
                item = await self._queue.get()
                if item[2] is not None:
                    raise api_error(item[2])
                started.add(item[0])
                self._ready.append(item)
        except BaseException:
            self.close()
            raise

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._num_live:
            index, output, error = self._ready.popleft() if self._ready else await self._queue.get()
            if error is not None:
                self.close()
                raise api_error(error)
            if output is None:
                self._num_live -= 1
                continue
            return index, output
        raise StopAsyncIteration

    async def final_outputs(self) -> list[RequestOutput]:
        """The last output of each request, in prompt order (all finished)."""
        last: dict[int, RequestOutput] = {}
        async for index, output in self:
            last[index] = output
        if len(last) != len(self._tasks) or not all(o.finished for o in last.values()):
            raise OpenAIError("the engine ended a request without a final output", status_code=500)
        return [last[i] for i in range(len(self._tasks))]

    def close(self) -> None:
        """Abort every request not finished yet (cancels the tasks that drive them)."""
        for task in self._tasks:
            task.cancel()


class EventStream:
    """A streaming response: an async iterator of server-sent events (str), the last one
    ``"data: [DONE]\\n\\n"``. ``aclose()`` aborts the engine requests not finished yet."""

    def __init__(self, events: AsyncGenerator[str, None], outputs: RequestOutputs) -> None:
        self._events = events
        self._outputs = outputs

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        self._outputs.close()
        await self._events.aclose()


class OpenAIServing:
    """The handlers of /v1/models, /v1/completions and /v1/chat/completions over ``engine``."""

    def __init__(
        self, engine: AsyncLLM, served_model_name: str, *, trust_request_chat_template: bool = False
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        # A request's own chat_template runs only when the operator trusts clients with it.
        self.trust_request_chat_template = trust_request_chat_template
        self._max_model_len = engine.max_model_len
        self._tokenizer = engine.tokenizer
        self._created = int(time.time())

    def list_models(self) -> dict[str, Any]:
        """The /v1/models body: the one model this server serves."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "jaxserve",
                    "root": self.engine.model_name,
                    "max_model_len": self._max_model_len,
                }
            ],
        }

    # ---- /v1/completions -----------------------------------------------------------------------
    async def create_completion(self, body: Any) -> dict[str, Any] | EventStream:
        """POST /v1/completions: the response body, or an EventStream when streaming.

        Raises:
            OpenAIError: see the module docstring.
        """
        request = parse_completion_request(body)
        self._check_model(request.model)
        prompts = completion_prompts(request)
        params = self._params(request)
        if request.echo and request.logprobs is not None:
            # The echoed prompt's logprobs, as many top ones as the completion's.
            top = max(request.logprobs, params.prompt_logprobs or 0)
            params = replace(params, prompt_logprobs=top)
        # Off the event loop (the engine client tokenizes in a worker thread): tokenizing a
        # long prompt must not stall other requests.
        checked = await self._check_prompts(request, prompts, params)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = self._start(response_id, checked)
        head = {"id": response_id, "created": int(time.time()), "model": self.served_model_name}
        if request.stream:
            await outputs.wait_started()
            return EventStream(self._completion_events(request, head, outputs), outputs)
        try:
            finals = await outputs.final_outputs()
        finally:
            outputs.close()
        return self._completion_body(request, head, finals)

    def _completion_body(
        self, request: CompletionRequest, head: dict[str, Any], finals: list[RequestOutput]
    ) -> dict[str, Any]:
        n, num_top = request.n, request.logprobs
        if request.echo:
            finals = [self._echoed(request, final) for final in finals]
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                choice: dict[str, Any] = {
                    "index": i * n + c.index,
                    "text": c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if num_top is not None:
                    choice["logprobs"] = completion_logprobs(
                        c.logprobs or [], num_top, self._tokenizer
                    )
                    if request.echo:
                        choice["logprobs"] = _joined(
                            echo_logprobs(
                                final.prompt_token_ids,
                                final.prompt_logprobs,
                                num_top,
                                self._tokenizer,
                            ),
                            choice["logprobs"],
                        )
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {
            **head,
            "object": "text_completion",
            "choices": choices,
            "usage": _usage(finals),
        }

    async def _completion_events(
        self, request: CompletionRequest, head: dict[str, Any], outputs: RequestOutputs
    ) -> AsyncGenerator[str, None]:
        head = {**head, "object": "text_completion"}
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        n, num_top = request.n, request.logprobs
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        try:
            async for i, output in outputs:
                prompt_tokens[i] = len(output.prompt_token_ids)
                for c in output.outputs:
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    logprobs = None
                    if num_top is not None:
                        offset = offsets.get(index, 0)
                        logprobs = completion_logprobs(
                            c.logprobs or [], num_top, self._tokenizer, offset
                        )
                        offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
                    choice = {
                        "index": index,
                        "text": c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    yield sse({**head, "choices": [choice], **extra})
            if include_usage:
                total = usage(sum(prompt_tokens.values()), completion_tokens)
                yield sse({**head, "choices": [], "usage": total})
        except Exception as e:  # reported in the stream, which has begun
            yield sse(_stream_error(e).body())
        finally:
            outputs.close()
        yield SSE_DONE

    def _echoed(self, request: CompletionRequest, final: RequestOutput) -> RequestOutput:
        """``final`` with the prompt's text before each completion's; with max_tokens=0
        (echo_only), the one token the engine sampled is left out."""
        prompt = final.prompt
        if prompt is None:
            ids = final.prompt_token_ids
            tokenizer = self._tokenizer
            prompt = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""
        completions = []
        for c in final.outputs:
            if echo_only(request):
                c = replace(c, text="", token_ids=[], logprobs=[], cumulative_logprob=None)
            completions.append(replace(c, text=prompt + c.text))
        return replace(final, outputs=completions)

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def create_chat_completion(self, body: Any) -> dict[str, Any] | EventStream:
        """POST /v1/chat/completions: the response body, or an EventStream when streaming.

        Raises:
            OpenAIError: see the module docstring.
        """
        request = parse_chat_request(body)
        self._check_model(request.model)
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError(
                "chat_template: this server does not run templates sent by clients (a template "
                "is a program); the operator can allow them with --trust-request-chat-template",
                param="chat_template",
            )
        messages = chat_messages(request)
        params = self._params(request)
        # Off the event loop (in the engine client's worker thread): rendering and tokenizing
        # a long conversation take seconds.
        checked = await self._render_and_check(request, messages, params)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self._start(response_id, [checked])
        head = {"id": response_id, "created": int(time.time()), "model": self.served_model_name}
        if request.stream:
            await outputs.wait_started()
            return EventStream(self._chat_events(request, head, outputs), outputs)
        try:
            finals = await outputs.final_outputs()
        finally:
            outputs.close()
        return self._chat_body(request, head, finals[0])

    def _chat_body(
        self, request: ChatCompletionRequest, head: dict[str, Any], final: RequestOutput
    ) -> dict[str, Any]:
        num_top = num_logprobs(request)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None
                if num_top is None
                else chat_logprobs(c.logprobs or [], num_top, self._tokenizer),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        body = {**head, "object": "chat.completion", "choices": choices, "usage": _usage([final])}
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs)
        return body

    async def _chat_events(
        self, request: ChatCompletionRequest, head: dict[str, Any], outputs: RequestOutputs
    ) -> AsyncGenerator[str, None]:
        head = {**head, "object": "chat.completion.chunk"}
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        num_top = num_logprobs(request)
        prompt_tokens = completion_tokens = 0
        try:
            for index in range(request.n):
                choice = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield sse({**head, "choices": [choice], **extra})
            async for _, output in outputs:
                prompt_tokens = len(output.prompt_token_ids)
                for c in output.outputs:
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue
                    completion_tokens += len(c.token_ids)
                    choice = {
                        "index": c.index,
                        "delta": {"content": c.text},
                        "logprobs": None
                        if num_top is None
                        else chat_logprobs(c.logprobs or [], num_top, self._tokenizer),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    yield sse({**head, "choices": [choice], **extra})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except Exception as e:  # reported in the stream, which has begun
            yield sse(_stream_error(e).body())
        finally:
            outputs.close()
        yield SSE_DONE

    # ---- shared ----------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r} (GET /v1/models)",
                status_code=404,
                param="model",
            )

    def _params(self, request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        requested, _ = requested_max_tokens(request)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        # Without a limit, each prompt gets what the context leaves (_check_prompt); until then
        # the longest that may be, so that min_tokens is checked against something.
        max_tokens = self._max_model_len if requested is None else requested
        if isinstance(request, CompletionRequest) and echo_only(request):
            max_tokens = 1  # the engine samples one token, which the answer leaves out
        return sampling_params(request, max_tokens=max_tokens, output_kind=kind)

    async def _check_prompts(
        self,
        request: CompletionRequest,
        prompts: list[Any],
        params: SamplingParams,
    ) -> list[CheckedRequest]:
        return [
            await self._check_prompt(
                request, prompt, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            )
            for i, prompt in enumerate(prompts)
        ]

    async def _render_and_check(
        self, request: ChatCompletionRequest, messages: list[dict], params: SamplingParams
    ) -> CheckedRequest:
        try:
            prompt = await self.engine.render_chat_prompt(
                messages,
                chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
            )
        except jinja2.TemplateSyntaxError as e:
            raise OpenAIError(f"chat_template does not parse: {e}", param="chat_template") from None
        except (TypeError, ValueError, jinja2.TemplateError) as e:
            raise OpenAIError(f"messages: {e}", param="messages") from None
        return await self._check_prompt(request, prompt, params, "messages")

    async def _check_prompt(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        where: str,
    ) -> CheckedRequest:
        """Tokenize and check one prompt with the engine's checks, and the completion length
        against the context: nothing is queued yet.

        Raises:
            OpenAIError (400): a bad or too long prompt (param "prompt" / "messages"), a
                max_tokens that does not fit the context with the prompt.
        """
        param = where.split("[")[0]
        engine, limit = self.engine, self._max_model_len
        requested, field = requested_max_tokens(request)
        try:
            text, token_ids = await engine.tokenize(prompt)
            if requested is None:
                params = with_max_tokens(request, params, max(1, limit - len(token_ids)))
            prompt_dict = {"prompt": text, "prompt_token_ids": token_ids}
            checked = await engine.check_request(prompt_dict, params)
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"{where}: {e}", param=param) from None
        if requested is not None and len(token_ids) + requested > limit:
            raise OpenAIError(
                f"{field}={requested} is too large: this model's maximum context length is "
                f"{limit} tokens and the {where} has {len(token_ids)} tokens "
                f"({requested} > {limit} - {len(token_ids)})",
                param=field,
            )
        return checked

    def _start(self, response_id: str, checked: list[CheckedRequest]) -> RequestOutputs:
        requests = [(f"{response_id}-{i}", c) for i, c in enumerate(checked)]
        logger.debug(
            "request %s: %d prompt(s), n=%d", response_id, len(checked), checked[0].params.n
        )
        return RequestOutputs(self.engine, requests)


def _joined(prompt: dict[str, list[Any]], completion: dict[str, list[Any]]) -> dict[str, list]:
    """An echoed prompt's logprobs object followed by its completion's (offsets shifted)."""
    shift = len("".join(prompt["tokens"]))
    return {
        "tokens": prompt["tokens"] + completion["tokens"],
        "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + shift for o in completion["text_offset"]],
    }


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    return usage(
        sum(len(f.prompt_token_ids) for f in finals),
        sum(len(c.token_ids) for f in finals for c in f.outputs),
    )


def _stream_error(error: Exception) -> OpenAIError:
    converted = api_error(error)
    if isinstance(converted, OpenAIError):
        return converted
    logger.exception("streaming response failed", exc_info=error)
    return OpenAIError(f"internal error: {type(error).__name__}: {error}", status_code=500)
