"""POST /v1/chat/completions: ChatServing, its response body and its stream."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

import jinja2

from jaxserve.engine.async_llm import AsyncLLM, CheckedRequest
from jaxserve.entrypoints.openai.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    OpenAIError,
    chat_logprobs,
    chat_messages,
    num_logprobs,
    parse_chat_request,
    prompt_logprobs_body,
    sse,
    usage,
)
from jaxserve.entrypoints.openai.protocol.tools import ToolChoice, tool_choice_of
from jaxserve.entrypoints.openai.request_outputs import EventStream, RequestOutputs, stream_error
from jaxserve.entrypoints.openai.serving_base import BaseServing, kv_transfer_answer, usage_of
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, chat_message
from jaxserve.entrypoints.openai.tool_parsers import ToolParser
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


class ChatServing(BaseServing):
    """The /v1/chat/completions handler; a request's own chat_template runs only when
    ``trust_request_chat_template``; ``tool_parser`` reads the tool calls of tool_choice "auto"
    (None: "auto" is refused; "required" and named functions need none)."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        *,
        trust_request_chat_template: bool,
        tool_parser: ToolParser | None = None,
    ) -> None:
        super().__init__(engine, served_model_name)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser

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
        tools = self._tool_choice(request)
        params = self._params(request, None if tools is None else tools.constraint())
        # Off the event loop (in the engine client's worker thread): rendering and tokenizing
        # a long conversation take seconds.
        checked = await self._render_and_check(request, messages, params, tools)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self._start(response_id, [checked])
        head = self._head(response_id)
        if request.stream:
            await outputs.wait_started()
            return EventStream(self._chat_events(request, head, outputs, tools), outputs)
        try:
            finals = await outputs.final_outputs()
        finally:
            outputs.close()
        return self._chat_body(request, head, finals[0], tools)

    def _tool_choice(self, request: ChatCompletionRequest) -> ToolChoice | None:
        tools = tool_choice_of(request)
        if tools is not None and tools.mode == "auto" and self.tool_parser is None:
            raise OpenAIError(
                'tool_choice "auto" (the default with tools) needs a server started with '
                '--tool-call-parser; "required" and a named function work without one',
                param="tool_choice",
            )
        return tools

    def _chat_body(
        self,
        request: ChatCompletionRequest,
        head: dict[str, Any],
        final: RequestOutput,
        tools: ToolChoice | None,
    ) -> dict[str, Any]:
        num_top = num_logprobs(request)
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            message, reason = chat_message(tools, self.tool_parser, c.text, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": None
                    if num_top is None
                    else chat_logprobs(c.logprobs or [], num_top, self._tokenizer),
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {**head, "object": "chat.completion", "choices": choices, "usage": usage_of([final]),
                **kv_transfer_answer([final])}  # fmt: skip
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs)
        return body

    async def _chat_events(
        self,
        request: ChatCompletionRequest,
        head: dict[str, Any],
        outputs: RequestOutputs,
        tools: ToolChoice | None,
    ) -> AsyncGenerator[str, None]:
        head = {**head, "object": "chat.completion.chunk"}
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        num_top = num_logprobs(request)
        prompt_tokens = completion_tokens = 0
        streams = [ToolCallStream(tools, self.tool_parser) for _ in range(request.n)]
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
                    stream = streams[c.index]
                    deltas = stream.deltas(c.text, c.finish_reason is not None)
                    if not deltas and c.finish_reason is None:
                        continue  # held back: it may be the start of a tool call
                    deltas = deltas or [{}]
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        choice = {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": None
                            if num_top is None or not last
                            else chat_logprobs(c.logprobs or [], num_top, self._tokenizer),
                            "finish_reason": stream.finish_reason(c.finish_reason)
                            if last
                            else None,
                            "stop_reason": c.stop_reason if last else None,
                        }
                        yield sse({**head, "choices": [choice], **extra})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except Exception as e:  # reported in the stream, which has begun
            yield sse(stream_error(e).body())
        finally:
            outputs.close()
        yield SSE_DONE

    async def _render_and_check(
        self,
        request: ChatCompletionRequest,
        messages: list[dict],
        params: SamplingParams,
        tools: ToolChoice | None,
    ) -> CheckedRequest:
        try:
            prompt = await self.engine.render_chat_prompt(
                messages,
                chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                tools=None if tools is None else tools.template_tools,
            )
        except jinja2.TemplateSyntaxError as e:
            raise OpenAIError(f"chat_template does not parse: {e}", param="chat_template") from None
        except (TypeError, ValueError, jinja2.TemplateError) as e:
            raise OpenAIError(f"messages: {e}", param="messages") from None
        return await self._check_prompt(request, prompt, params, "messages")
