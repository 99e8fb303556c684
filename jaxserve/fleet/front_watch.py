"""A replica exits when its front is gone.

The data-parallel front starts its replicas in sessions of their own (replicas.py), so a
Ctrl-C at the terminal reaches only the front, which stops them. A front killed outright
(SIGKILL, the OOM killer) stops nothing: its replicas would serve on, holding their devices,
cores and ports, with nobody routing to them. So the front names itself in each replica's
environment (``JAXSERVE_FRONT_PID``), and a replica watches its parent: once the parent is no
longer that process (the replica was re-parented), the replica sends itself SIGTERM and shuts
down as after any SIGTERM (open requests get the graceful-shutdown time).

Polling ``os.getppid()`` works on every POSIX system, needs no signal set up in the child
before exec, and costs one system call a second.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

logger = logging.getLogger("jaxserve")

FRONT_PID_ENV = "JAXSERVE_FRONT_PID"


def front_environment(pid: int | None = None) -> dict[str, str]:
    """What a replica's environment gets so that it exits with this process (or ``pid``)."""
    return {FRONT_PID_ENV: str(os.getpid() if pid is None else pid)}


def exit_with_front(
    environ: Mapping[str, str] = os.environ, interval_s: float = 1.0
) -> threading.Thread | None:
    """When ``environ`` names a front, watch it in a daemon thread: SIGTERM this process once
    its parent is another. Returns the thread, or None when no front is named.

    Raises:
        ValueError: JAXSERVE_FRONT_PID is not a process id.
    """
    value = environ.get(FRONT_PID_ENV)
    if not value:
        return None
    try:
        front = int(value)
    except ValueError:
        raise ValueError(f"{FRONT_PID_ENV}={value!r} is not a process id") from None
    if front <= 1:
        raise ValueError(f"{FRONT_PID_ENV}={front} is not a front's process id (must be > 1)")
    thread = threading.Thread(
        target=_watch, args=(front, interval_s), name="jaxserve-front-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(front: int, interval_s: float) -> None:
    while os.getppid() == front:
        time.sleep(interval_s)
    logger.warning("the front (pid %d) is gone: this replica shuts down", front)
    os.kill(os.getpid(), signal.SIGTERM)
