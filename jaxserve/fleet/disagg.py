"""``jaxserve router``: disaggregated serving's front. Each completion or chat request is first
sent to a prefill server (a producer) with ``max_tokens`` 1, which computes its prompt's KV,
then as it came to a decode server (a consumer), whose answer is streamed to the client.

With ``pass_kv_transfer_params`` (vLLM's protocol), the prefill request asks for
``kv_transfer_params`` {"do_remote_decode": true}, the producer's answer carries the params of
its stored KV (jaxserve's: {"do_remote_prefill": true, "remote_num_tokens": N}), and the router
hands them to the consumer in the decode request's body: a consumer that then cannot load that
KV computes it or fails the request (500), as its ``kv_load_failure_policy`` says. Without it,
a jaxserve consumer still finds the producer's blocks by their prefix hash (computing what it
does not find). The tokens are the same either way. A producer that cannot be reached or fails
with a 5xx does not fail the request: the consumer computes the prompt itself (logged). A
producer's 4xx (bad input) is the client's answer, and nothing reaches a consumer. Each pool
picks its least loaded server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from jaxserve.entrypoints.openai.body import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_DEPTH, parse_body
from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.forwarding import CLIENT_CLOSED, error_response, forward, unless_client_gone
from jaxserve.fleet.metrics import CONTENT_TYPE, merge_expositions
from jaxserve.fleet.proxy import (
    add_error_handler,
    api_key_dependencies,
    pools_lifespan,
    read_body,
)
from jaxserve.fleet.routing import least_loaded

logger = logging.getLogger("jaxserve")

# Fields of the client's request that make no sense for a one-token prefill.
_NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "n", "best_of")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: the client's, generating one token, not streamed."""
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def build_router_app(
    prefill: BackendPool,
    decode: BackendPool,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    pass_kv_transfer_params: bool = False,
) -> FastAPI:
    """The router's app over the ``prefill`` and ``decode`` pools (polled while it runs).

    pass_kv_transfer_params: send vLLM's ``kv_transfer_params`` to the servers (every server
    needs a KV connector: one without refuses the field)."""

    app = FastAPI(title="jaxserve-router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=pools_lifespan(prefill, decode))  # fmt: skip
    v1 = APIRouter(prefix="/v1", dependencies=api_key_dependencies(api_key))

    async def route(request: Request, path: str) -> Response:
        return await _route(request, path, prefill, decode, max_body_bytes,
                            pass_kv_transfer_params)  # fmt: skip

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @v1.get("/models")
    async def models(request: Request) -> Response:
        assert decode.session is not None
        return await forward(decode.session, decode.backends[0], request, "/v1/models", None)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        down = [b.url for b in prefill.backends + decode.backends if not b.healthy]
        if down:
            return error_response(f"servers not healthy: {down}", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await prefill.fetch_metrics() + await decode.fetch_metrics()
        return Response(merge_expositions(texts), headers={"Content-Type": CONTENT_TYPE})

    add_error_handler(app)
    return app


async def _prefill(
    request: Request, pool: BackendPool, path: str, body: dict[str, Any], pass_params: bool
) -> tuple[bool, Any]:
    """Run the request's prefill on the least loaded producer. Returns (True, its
    ``kv_transfer_params`` or None) to go on to a consumer, or (False, the Response to answer
    with now: the client left, or the producer refused the request with a 4xx)."""
    try:
        backend = pool.backends[least_loaded(pool.loads())]
    except RuntimeError:
        logger.warning("no prefill server is healthy: the decode server computes the prompt")
        return True, None
    sent = prefill_body(body)
    if not pass_params:
        del sent["kv_transfer_params"]
    assert pool.session is not None
    backend.in_flight += 1
    try:
        arrived, result = await unless_client_gone(
            request, _post_json(pool.session, backend.url + path, sent)
        )
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        backend.healthy = False
        logger.warning("prefill server %s failed (%s): decode computes the prompt", backend.url, e)
        return True, None
    finally:
        backend.in_flight -= 1
    if not arrived:
        return False, Response(status_code=CLIENT_CLOSED)
    status, data = result
    if 400 <= status < 500:
        return False, Response(data, status_code=status, media_type="application/json")
    if status != 200:
        logger.warning("prefill server %s answered %d: decode computes the prompt", backend.url,
                       status)  # fmt: skip
        return True, None
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    return True, params


async def _post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, bytes]:
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


def router_pools(prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> tuple:
    """(prefill pool, decode pool) of the given URLs.

    Raises:
        ValueError: no URL for a role, or a URL that is not http(s)://host:port.
    """
    for flag, urls in (("--prefill", prefill_urls), ("--decode", decode_urls)):
        if not urls:
            raise ValueError(f"{flag} needs at least one server URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag}: {url!r} is not an http:// or https:// URL")
    return BackendPool(prefill_urls), BackendPool(decode_urls)


async def _route(
    request: Request,
    path: str,
    prefill: BackendPool,
    decode: BackendPool,
    max_body_bytes: int,
    pass_params: bool,
) -> Response:
    """One request: its prefill on a producer, then its decode on a consumer, streamed."""
    raw = await read_body(request, max_body_bytes)
    if raw is None:
        return Response(status_code=CLIENT_CLOSED)
    try:
        body = parse_body(raw, DEFAULT_MAX_DEPTH)
    except OpenAIError as e:
        return error_response(e.message, e.status_code)
    if not isinstance(body, dict):
        return error_response("the request body must be a JSON object", 400)
    done, answer = await _prefill(request, prefill, path, body, pass_params)
    if not done:
        return answer  # the client left, or the producer refused the request
    if pass_params:
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if answer is not None:
            body["kv_transfer_params"] = answer
    try:
        index = least_loaded(decode.loads())
    except RuntimeError:
        return error_response("no decode server is healthy", 503)
    assert decode.session is not None
    raw = json.dumps(body).encode()
    return await forward(decode.session, decode.backends[index], request, path, raw)
