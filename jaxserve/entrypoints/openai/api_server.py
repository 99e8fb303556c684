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

import asyncio
import gc
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
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
from jaxserve.entrypoints.openai.body import BodyLimits, parse_body
from jaxserve.entrypoints.openai.listen import (
    API_KEY_ENV,
    api_key_of,
    bind_socket,
    is_loopback,
    run_until_signal,
)
from jaxserve.entrypoints.openai.protocol import OpenAIError, loc_path
from jaxserve.entrypoints.openai.request_outputs import EventStream
from jaxserve.entrypoints.openai.serving import OpenAIServing
from jaxserve.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger("jaxserve")

_PARSE_INLINE_BYTES = 256 * 1024
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


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    body_limits: BodyLimits | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name``; ``api_key`` (if given)
    guards the /v1 routes; ``body_limits`` bound what a request body may be;
    ``trust_request_chat_template`` lets requests send their own chat template;
    ``tool_call_parser`` names the parser of tool_choice "auto" (tool_parsers/). The caller owns
    the engine (and shuts it down)."""
    serving = OpenAIServing(
        engine,
        served_model_name,
        trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser,
    )
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.body_limits = body_limits or BodyLimits()
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
        body, content_type = engine.render_metrics()
        return Response(body, headers={"Content-Type": content_type})

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
    limits: BodyLimits = request.app.state.body_limits
    try:
        raw = await _read_body(request, limits.max_bytes)
    except ClientDisconnect:  # gone before its request was read: nothing was started
        return Response(status_code=_CLIENT_CLOSED)
    # A large body parses in a worker thread: the event loop keeps serving everyone else.
    if len(raw) > _PARSE_INLINE_BYTES:
        body = await asyncio.to_thread(parse_body, raw, limits.max_depth)
    else:
        body = parse_body(raw, limits.max_depth)
    task = asyncio.ensure_future(handler(body))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        if not task.done():
            task.cancel()  # the handler closes its engine requests, which aborts them
            # Let the cancellation run to its end: reading a result before that raises.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.debug("client disconnected from %s before its answer", request.url.path)
        return Response(status_code=_CLIENT_CLOSED)
    result = task.result()
    if isinstance(result, EventStream):
        return EventStreamResponse(result)
    return JSONResponse(result)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 past ``max_bytes`` (on Content-Length, or while it
    arrives when the client sends none or lies)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> OpenAIError:
    return OpenAIError(
        f"the request body ({size} bytes or more) is over this server's limit of {max_bytes} "
        f"bytes (--max-request-body-bytes)",
        status_code=413,
    )


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


def run_server(engine_args: Mapping[str, Any], settings: ServerSettings) -> int:
    """``jaxserve serve``: bind the port, build the engine (warm-up included) from
    ``engine_args`` (``LLM(...)``'s keyword arguments, ``model`` included: what
    ``EngineConfig.from_kwargs`` reads), serve it with uvicorn until SIGINT / SIGTERM, then shut
    the engine down. Returns the exit code.

    Raises:
        OSError / TypeError / ValueError: bad engine arguments or model (from AsyncLLM(...)), an
            empty API key, an address that cannot be bound.
    """
    api_key = api_key_of(settings.api_key)
    if api_key is None and not is_loopback(settings.host):
        logger.warning(
            "serving on %s, reachable from other machines, with no API key: anyone who can "
            "reach it can use it (--api-key or $%s)",
            settings.host,
            API_KEY_ENV,
        )
    limits = BodyLimits(max_bytes=settings.max_request_body_bytes)
    sock = bind_socket(settings.host, settings.port)
    try:
        engine_args = dict(engine_args)
        model = engine_args.pop("model", "tiny-random-llama")
        name = settings.served_model_name or model
        engine = AsyncLLM(
            model=model,
            max_waiting_requests=settings.max_waiting_requests,
            served_model_name=name,
            **engine_args,
        )
        try:
            app = build_app(
                engine,
                served_model_name=name,
                api_key=api_key,
                body_limits=limits,
                trust_request_chat_template=settings.trust_request_chat_template,
                tool_call_parser=settings.tool_call_parser,
            )
            _serve(app, sock, settings, f"serving {model!r} as {name!r}", api_key is not None)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    return 0


def _serve(
    app: FastAPI, sock: socket.socket, settings: ServerSettings, what: str, keyed: bool
) -> None:
    """Listen on ``sock`` and serve ``app`` until a signal; ``what`` starts the log line."""
    config = uvicorn.Config(
        app,
        # uvicorn serves ``sock`` (and logs no "running on" line for a passed socket: the
        # "serving ... on" line below says where); host and port are its records
        host=settings.host,
        port=settings.port,
        log_level=settings.uvicorn_log_level,
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout,
    )
    # Listening from here (not from the bind: a client would wait in the backlog through the
    # whole warm-up), so a client that read the line below connects.
    sock.listen(config.backlog)
    logger.info(
        "%s on http://%s:%d/v1 (API key %s)",
        what,
        settings.host,
        sock.getsockname()[1],
        "required" if keyed else "not required",
    )
    # The process's own: nothing built so far (jax, the model, the compiled steps: ~600k
    # objects) is garbage, so the cyclic GC stops scanning it, as vLLM's server does. A full
    # collection of that heap took ~0.4 s, a pause every stream felt at once.
    gc.collect()
    gc.freeze()
    run_until_signal(uvicorn.Server(config), sock)
