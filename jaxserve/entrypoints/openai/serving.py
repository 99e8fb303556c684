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

import time
from typing import Any

from jaxserve.engine.async_llm import AsyncLLM, CheckedRequest
from jaxserve.entrypoints.openai.request_outputs import EventStream
from jaxserve.entrypoints.openai.serving_base import ChecksOnly
from jaxserve.entrypoints.openai.serving_chat import ChatServing
from jaxserve.entrypoints.openai.serving_completions import CompletionServing
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser


class OpenAIServing:
    """The handlers of /v1/models, /v1/completions (serving_completions.py) and
    /v1/chat/completions (serving_chat.py) over ``engine``."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        *,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.completions = CompletionServing(engine, served_model_name)
        # A request's own chat_template runs only when the operator trusts clients with it;
        # tool_choice "auto" needs the parser of the model's tool-call format.
        self.chat = ChatServing(
            engine,
            served_model_name,
            trust_request_chat_template=trust_request_chat_template,
            tool_parser=None if tool_call_parser is None else get_tool_parser(tool_call_parser),
        )
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
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    async def create_completion(self, body: Any) -> dict[str, Any] | EventStream:
        """POST /v1/completions: the response body, or an EventStream when streaming.

        Raises:
            OpenAIError: see the module docstring.
        """
        return await self.completions.create_completion(body)

    async def create_chat_completion(self, body: Any) -> dict[str, Any] | EventStream:
        """POST /v1/chat/completions: the response body, or an EventStream when streaming.

        Raises:
            OpenAIError: see the module docstring.
        """
        return await self.chat.create_chat_completion(body)

    async def checked_requests(self, url: str, body: Any) -> list[CheckedRequest]:
        """The engine requests that POST ``url`` with ``body`` would start, checked (parsed,
        templated, tokenized), none started: what a batch job warms up for
        (jobs/run_batch.py).

        Raises:
            OpenAIError: as the handler of ``url`` would.
        """
        handler = self.completions if url == "/v1/completions" else self.chat
        handler.checks_only = True
        try:
            if handler is self.completions:
                await handler.create_completion(body)
            else:
                await handler.create_chat_completion(body)
        except ChecksOnly as done:
            return done.checked
        finally:
            handler.checks_only = False
        return []
