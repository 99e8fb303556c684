"""The data-parallel front: one OpenAI endpoint over N replicas. Each completion or chat
request goes to the replica its routing policy picks (routing.py), its answer streamed back;
/metrics is every replica's, labelled and summed (metrics.py), plus the front's own counters.

The front checks the API key and the body's size and JSON; the replica checks everything else
and answers with its own errors, passed through unchanged.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from jaxserve.entrypoints.openai.body import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_DEPTH, parse_body
from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.forwarding import CLIENT_CLOSED, error_response, forward
from jaxserve.fleet.metrics import CONTENT_TYPE, merge_expositions
from jaxserve.fleet.prefix_keys import PrefixKeyConfig, prefix_keys
from jaxserve.fleet.routing import PrefixAware, RoutingPolicy


@dataclass(frozen=True)
class FrontSettings:
    """api_key: the key /v1 routes need (None: none); max_body_bytes: past it 413;
    prefix_keys: how prompts are cut into blocks for prefix routing."""

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    prefix_keys: PrefixKeyConfig = PrefixKeyConfig()


def build_front_app(
    pool: BackendPool, policy: RoutingPolicy, settings: FrontSettings = FrontSettings()
) -> FastAPI:
    """The front's app over ``pool`` (polled while the app runs) routed by ``policy``."""
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=pools_lifespan(pool))  # fmt: skip
    routed = [0] * len(pool.backends)
    v1 = APIRouter(prefix="/v1", dependencies=api_key_dependencies(settings.api_key))

    async def route(request: Request, path: str) -> Response:
        raw = await read_body(request, settings.max_body_bytes)
        if raw is None:
            return Response(status_code=CLIENT_CLOSED)
        keys = prefix_keys(_json_or_none(raw), settings.prefix_keys)
        try:
            index = policy.choose(keys, pool.loads())
        except RuntimeError as e:  # none healthy
            return error_response(f"no replica can take the request: {e}", 503)
        routed[index] += 1
        assert pool.session is not None
        return await forward(pool.session, pool.backends[index], request, path, raw)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @v1.get("/models")
    async def models(request: Request) -> Response:
        healthy = [b for b in pool.backends if b.healthy] or pool.backends
        assert pool.session is not None
        return await forward(pool.session, healthy[0], request, "/v1/models", None)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        down = [i for i, b in enumerate(pool.backends) if not b.healthy]
        if down:
            return error_response(f"replicas {down} are not healthy", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await pool.fetch_metrics()
        front = _front_metrics(pool, routed, policy)
        return Response(merge_expositions(texts, front), headers={"Content-Type": CONTENT_TYPE})

    add_error_handler(app)
    return app


def pools_lifespan(*pools: BackendPool) -> Any:
    """An app lifespan that starts the pools' sessions and pollers (one poll done before the
    first request) and closes them at the end."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for pool in pools:
            await pool.start()
        for pool in pools:
            await pool.poll_once()
        try:
            yield
        finally:
            for pool in pools:
                await pool.close()

    return lifespan


def api_key_dependencies(api_key: str | None) -> list:
    if not api_key:
        return []
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise OpenAIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                status_code=401,
            )

    return [Depends(check_api_key)]


def add_error_handler(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc.message, exc.status_code)


async def read_body(request: Request, max_bytes: int) -> bytes | None:
    """The raw body (None: the client left first), refused with 413 past ``max_bytes``."""
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise OpenAIError(
                    f"the request body ({size} bytes or more) is over this server's limit of "
                    f"{max_bytes} bytes (--max-request-body-bytes)",
                    status_code=413,
                )
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


def _json_or_none(raw: bytes) -> object:
    try:
        return parse_body(raw, DEFAULT_MAX_DEPTH)
    except (OpenAIError, json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return None  # the replica answers it with its own 400


def _front_metrics(pool: BackendPool, routed: list[int], policy: RoutingPolicy) -> str:
    lines = [
        "# HELP jaxserve:front_requests_routed_total Requests the front sent to each replica.",
        "# TYPE jaxserve:front_requests_routed_total counter",
    ]
    lines += [
        f'jaxserve:front_requests_routed_total{{replica="{i}"}} {n}' for i, n in enumerate(routed)
    ]
    lines += [
        "# HELP jaxserve:front_requests_in_flight Requests open at each replica, as the front "
        "counts them.",
        "# TYPE jaxserve:front_requests_in_flight gauge",
    ]
    lines += [
        f'jaxserve:front_requests_in_flight{{replica="{i}"}} {b.in_flight}'
        for i, b in enumerate(pool.backends)
    ]
    if isinstance(policy, PrefixAware):
        lines += [
            "# HELP jaxserve:front_prefix_routing_total Prefix routing decisions by kind.",
            "# TYPE jaxserve:front_prefix_routing_total counter",
        ]
        for kind in ("matched", "hashed", "rebalanced"):
            value = getattr(policy.stats, kind)
            lines.append(f'jaxserve:front_prefix_routing_total{{decision="{kind}"}} {value}')
    return "\n".join(lines) + "\n"
