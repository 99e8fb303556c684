"""Forward one HTTP request to a backend and hand its answer back, streamed as it arrives, with
the backend's in-flight count kept exact and the backend request cut when the client goes.

Cutting is how an abort travels: the front closes its connection to the backend, the backend's
server sees the disconnect and aborts the engine request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import aiohttp
import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.fleet.backends import Backend

logger = logging.getLogger("jaxserve")

CLIENT_CLOSED = 499  # nginx's "client closed request", as the engine's server logs it
_PASSED_HEADERS = ("content-type",)


class ForwardedStream(StreamingResponse):
    """A streamed backend answer; ``on_close`` runs when the response ends however it ends
    (finished, failed, the client gone, or never started)."""

    def __init__(self, chunks: Any, status: int, headers: dict[str, str], on_close: Any) -> None:
        super().__init__(chunks, status_code=status, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                self._on_close()


def error_response(message: str, status: int) -> JSONResponse:
    error = OpenAIError(message, status_code=status)
    return JSONResponse(error.body(), status_code=status)


async def client_gone(request: Request) -> None:
    """Return when the client disconnects (its body has been read: only that is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_gone(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """(True, result of ``work``), or (False, None) if the client went first (``work`` is
    cancelled and awaited, so nothing of it outlives the request)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def forward(
    session: aiohttp.ClientSession,
    backend: Backend,
    request: Request,
    path: str,
    raw: bytes | None,
) -> Response:
    """Send ``raw`` to ``backend``'s ``path`` (GET when None) and return its answer: a
    text/event-stream streamed through, anything else read whole. A backend that cannot be
    reached answers 502 and is marked unhealthy until its next good poll."""
    backend.in_flight += 1
    closed = handed_off = False
    response: aiohttp.ClientResponse | None = None

    def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            backend.in_flight -= 1
            if response is not None:
                response.close()  # drops the connection: the backend aborts what is left

    try:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        method = "GET" if raw is None else "POST"
        sent = session.request(method, backend.url + path, data=raw, headers=headers)
        arrived, response = await unless_client_gone(request, sent)
        if not arrived:
            return Response(status_code=CLIENT_CLOSED)
        passed = {"content-type": response.headers.get("content-type", "application/json")}
        if passed["content-type"].startswith("text/event-stream"):
            passed.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
            handed_off = True  # the stream closes it when it ends
            return ForwardedStream(response.content.iter_any(), response.status, passed, close)
        arrived, body = await unless_client_gone(request, response.read())
        if not arrived:
            return Response(status_code=CLIENT_CLOSED)
        return Response(body, status_code=response.status, headers=passed)
    except aiohttp.ClientError as e:
        backend.healthy = False
        logger.warning("backend %s failed: %s", backend.url, e)
        return error_response(f"the backend {backend.url} failed: {type(e).__name__}", 502)
    finally:
        if not handed_off:
            close()
