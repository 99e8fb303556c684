"""Serve a front's app (proxy.py, disagg.py) with uvicorn on a bound socket until SIGINT or
SIGTERM, as ``jaxserve serve`` serves an engine (entrypoints/openai/listen.py)."""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

from jaxserve.entrypoints.openai.listen import (
    API_KEY_ENV,
    bind_socket,
    is_loopback,
    run_until_signal,
)

logger = logging.getLogger("jaxserve")


def serve_front(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str,
    what: str,
    api_key: str | None,
    *,
    sock: socket.socket | None = None,
    graceful_shutdown_timeout: float = 10.0,
) -> int:
    """Listen on ``sock`` (else bind ``host:port``) and serve ``app`` until a signal; ``what``
    starts the log line. Returns 0.

    Raises:
        OSError: the address cannot be bound.
    """
    if api_key is None and not is_loopback(host):
        logger.warning(
            "serving on %s, reachable from other machines, with no API key (--api-key or $%s)",
            host,
            API_KEY_ENV,
        )
    own = sock is None
    sock = sock or bind_socket(host, port)
    try:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=graceful_shutdown_timeout,
        )
        sock.listen(config.backlog)
        logger.info(
            "%s on http://%s:%d/v1 (API key %s)",
            what,
            host,
            sock.getsockname()[1],
            "required" if api_key else "not required",
        )
        run_until_signal(uvicorn.Server(config), sock)
    finally:
        if own:
            sock.close()
    return 0
