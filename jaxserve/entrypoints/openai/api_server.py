"""The HTTP server of ``jaxserve serve``: a FastAPI app over OpenAIServing, run by uvicorn.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (with an
API key, each ``/v1`` route needs ``Authorization: Bearer KEY``, else 401), ``GET /health``
(200 while the engine runs, 503 once it is dead) and ``GET /metrics`` (the engine's Prometheus
exposition); the last two answer without the key. Every error is OpenAI's error body; FastAPI's
422 for a malformed request is a 400 here, as every other bad input.

A client that goes away aborts its engine requests: a streaming response closes its EventStream
once the response ends, however it ends (a disconnect included), and a non-streaming handler is
cancelled when the client disconnects before the answer is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.protocol import OpenAIError, loc_path
from jaxserve.entrypoints.openai.serving import EventStream, OpenAIServing

logger = logging.getLogger("jaxserve")

API_KEY_ENV = "JAXSERVE_API_KEY"
_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response of an EventStream, which it closes (aborting the engine
    requests left) when the response ends: finished, failed or the client gone."""

    def __init__(self, events: EventStream) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


def build_app(engine: AsyncLLM, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name``; ``api_key`` (if given)
    guards the /v1 routes. The caller owns the engine (and shuts it down)."""
    serving = OpenAIServing(engine, served_model_name)
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    dependencies = [Depends(_api_key_check(api_key))] if api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=dependencies)

    @v1.get("/models")
    async def list_models() -> Response:
        return JSONResponse(serving.list_models())

    @v1.post("/completions")
    async def create_completion(request: Request) -> Response:
        return await _respond(request, serving.create_completion)

    @v1.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await _respond(request, serving.create_chat_completion)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        error = OpenAIError(
            "the engine is not running (it failed or was shut down)", status_code=503
        )
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            engine.metrics.render(), headers={"Content-Type": engine.metrics.content_type}
        )

    _add_error_handlers(app)
    return app


def _api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise OpenAIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                status_code=401,
            )

    return check_api_key


async def _respond(request: Request, handler: Callable[[Any], Awaitable[Any]]) -> Response:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its request was read: nothing was started
        return Response(status_code=_CLIENT_CLOSED)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    task = asyncio.ensure_future(handler(body))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        if not task.done():
            task.cancel()  # the handler closes its engine requests, which aborts them
    if task.cancelled():
        return Response(status_code=_CLIENT_CLOSED)
    result = task.result()
    if isinstance(result, EventStream):
        return EventStreamResponse(result)
    return JSONResponse(result)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": str(exc)}
        loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        param = loc_path(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return _error_response(OpenAIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = OpenAIError(str(exc.detail), status_code=exc.status_code)
        return _error_response(error, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return _error_response(OpenAIError(message, status_code=500))


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key: --api-key, else $JAXSERVE_API_KEY; None (no key) when neither is set."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def run_server(args: argparse.Namespace) -> int:
    """``jaxserve serve``: build the engine from the flags (warm-up included), serve it with
    uvicorn until SIGINT / SIGTERM, then shut the engine down. Returns the exit code.

    Raises:
        OSError / TypeError / ValueError: bad engine flags or model (from AsyncLLM(...)).
    """
    from jaxserve.cli import engine_kwargs

    api_key = api_key_of(args)
    name = args.served_model_name or args.model
    engine = AsyncLLM(
        model=args.model,
        max_waiting_requests=args.max_waiting_requests,
        served_model_name=name,
        **engine_kwargs(args),
    )
    try:
        app = build_app(engine, served_model_name=name, api_key=api_key)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
        )
        logger.info(
            "serving %r as %r on http://%s:%d/v1 (API key %s)",
            args.model,
            name,
            args.host,
            args.port,
            "required" if api_key else "not required",
        )
        # The process's own: nothing built so far (jax, the model, the compiled steps: ~600k
        # objects) is garbage, so the cyclic GC stops scanning it, as vLLM's server does. A
        # full collection of that heap took ~0.4 s, a pause every stream felt at once.
        gc.collect()
        gc.freeze()
        _run_until_signal(uvicorn.Server(config))
    finally:
        engine.shutdown()
    return 0


def _run_until_signal(server: uvicorn.Server) -> None:
    """Run uvicorn until SIGINT or SIGTERM. uvicorn shuts down gracefully, then raises the
    signal again: with SIGTERM handled as SIGINT here, both end the run as a KeyboardInterrupt,
    caught, so that the engine is shut down and the exit status is 0."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    if in_main_thread:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()
    except KeyboardInterrupt:
        logger.info("stopped by a signal; shutting the engine down")
    finally:
        if in_main_thread and previous is not None:  # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous)
