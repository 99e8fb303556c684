"""Listening for ``jaxserve serve`` and the fronts over replicas (jaxserve/fleet/): the API key,
the socket bound before anything slow is built, and uvicorn run until SIGINT or SIGTERM.

Light: no jax, no engine, so a front that only forwards requests loads neither.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading

import uvicorn

logger = logging.getLogger("jaxserve")

API_KEY_ENV = "JAXSERVE_API_KEY"


def api_key_of(given: str | None) -> str | None:
    """The API key: ``given`` (--api-key), else $JAXSERVE_API_KEY; None (no key) when neither
    is set.

    Raises:
        ValueError: a key given but empty (an unset shell variable would open the server).
    """
    if given is not None:
        if not given.strip():
            raise ValueError(
                "--api-key is empty (an unset shell variable?); give a key, or leave the flag "
                "out to serve without one"
            )
        return given
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty; unset it to serve without a key")
    return key or None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow is built, so that a port in use is
    known in a second rather than after the model has loaded and compiled.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's), naming it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_until_signal(server: uvicorn.Server, sock: socket.socket) -> None:
    """Run uvicorn until SIGINT or SIGTERM. uvicorn shuts down gracefully, then raises the
    signal again: with SIGTERM handled as SIGINT here, both end the run as a KeyboardInterrupt,
    caught, so that the engine is shut down and the exit status is 0."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    if in_main_thread:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        logger.info("stopped by a signal; shutting the engine down")
    finally:
        if in_main_thread and previous is not None:  # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous)
