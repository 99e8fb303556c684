"""POST /v1/completions: CompletionServing, its response body and its stream."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from jaxserve.engine.async_llm import CheckedRequest
from jaxserve.entrypoints.openai.protocol import (
    SSE_DONE,
    CompletionRequest,
    completion_logprobs,
    completion_prompts,
    echo_logprobs,
    echo_only,
    parse_completion_request,
    prompt_logprobs_body,
    sse,
    usage,
)
from jaxserve.entrypoints.openai.request_outputs import EventStream, RequestOutputs, stream_error
from jaxserve.entrypoints.openai.serving_base import BaseServing, kv_transfer_answer, usage_of
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


class CompletionServing(BaseServing):
    """The /v1/completions handler."""

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
        head = self._head(response_id)
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
            "usage": usage_of(finals),
            **kv_transfer_answer(finals),
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
            yield sse(stream_error(e).body())
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


def _joined(prompt: dict[str, list[Any]], completion: dict[str, list[Any]]) -> dict[str, list]:
    """An echoed prompt's logprobs object followed by its completion's (offsets shifted)."""
    shift = len("".join(prompt["tokens"]))
    return {
        "tokens": prompt["tokens"] + completion["tokens"],
        "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + shift for o in completion["text_offset"]],
    }
