"""The engine requests of one API request, and the streaming response over them.

``RequestOutputs`` drives each engine generator in a task of its own and interleaves their
outputs; ``close()`` cancels the tasks, and AsyncLLM aborts a request whose generator is
cancelled. ``EventStream`` is a streaming response body: server-sent events, closed (aborting
what is left) when the response ends. ``api_error`` maps the engine's exceptions onto OpenAI's
error statuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator

from jaxserve.engine.async_llm import AsyncLLM, CheckedRequest, EngineError, QueueFullError
from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.outputs import RequestOutput

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
            failed = [c for c in output.outputs if c.finish_reason == "error"]
            if failed:  # its promised KV could not be loaded (kv_load_failure_policy "fail")
                self.close()
                raise OpenAIError(str(failed[0].stop_reason), status_code=500)
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


def stream_error(error: Exception) -> OpenAIError:
    converted = api_error(error)
    if isinstance(converted, OpenAIError):
        return converted
    logger.exception("streaming response failed", exc_info=error)
    return OpenAIError(f"internal error: {type(error).__name__}: {error}", status_code=500)
