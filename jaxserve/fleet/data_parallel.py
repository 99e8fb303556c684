"""``jaxserve serve --data-parallel-size N``: N replica processes behind one front.

The front binds its port first (a port in use fails at once), plans every replica's share of
the machine, starts the replicas, waits until each answers /health, then serves the front's
app until SIGINT / SIGTERM and stops the replicas (each shuts its engine down) on the way out,
however it ends.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.entrypoints.openai.listen import api_key_of, bind_socket
from jaxserve.entrypoints.openai.settings import ServerSettings
from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.placement import detect_platform, machine_devices, plan_placements
from jaxserve.fleet.proxy import FrontSettings, build_front_app
from jaxserve.fleet.replicas import (
    replica_serve_args,
    start_replicas,
    stop_replicas,
    wait_ready,
)
from jaxserve.fleet.routing import make_policy
from jaxserve.fleet.serve_front import serve_front

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class DataParallelConfig:
    """num_replicas: engine processes (--data-parallel-size); tensor_parallel_size: devices
    each replica takes; routing: routing.ROUTING_POLICIES; startup_timeout_s: how long the
    replicas may take to load and warm up."""

    num_replicas: int
    tensor_parallel_size: int = 1
    routing: str = "load"
    startup_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.num_replicas}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        make_policy(self.routing, self.num_replicas)  # refuses an unknown name


def run_data_parallel(
    serve_args: Sequence[str], config: DataParallelConfig, settings: ServerSettings
) -> int:
    """Serve ``config.num_replicas`` replicas of ``jaxserve serve SERVE_ARGS`` behind one
    endpoint at ``settings``' address. Returns the exit code (0 after a signal).

    Raises:
        ValueError: an empty API key, a platform or device count that cannot be split.
        OSError: the address cannot be bound.
        RuntimeError: a replica exited or was not ready in time.
    """
    api_key = api_key_of(settings.api_key)
    policy = make_policy(config.routing, config.num_replicas)
    cpus, gpus = machine_devices(os.environ)
    platform = detect_platform(os.environ)
    placements = plan_placements(
        config.num_replicas, config.tensor_parallel_size, platform, cpus=cpus, gpus=gpus
    )
    replica_serve_args(serve_args, 0, config.num_replicas)  # transfer ports past 65535: refused
    sock = bind_socket(settings.host, settings.port)
    replicas = []
    # SIGTERM as SIGINT from here: however the front is stopped, the replicas are stopped too
    # (they run in sessions of their own, out of reach of the terminal's signals).
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
    try:
        replicas = start_replicas(serve_args, placements, os.environ)
        wait_ready(replicas, config.startup_timeout_s)
        pool = BackendPool([r.url for r in replicas])
        front = FrontSettings(api_key=api_key, max_body_bytes=settings.max_request_body_bytes)
        app = build_front_app(pool, policy, front)
        what = f"serving {config.num_replicas} replicas (routing {config.routing})"
        serve_front(
            app,
            settings.host,
            settings.port,
            settings.uvicorn_log_level,
            what,
            api_key,
            sock=sock,
            graceful_shutdown_timeout=settings.graceful_shutdown_timeout,
        )
    finally:
        stop_replicas(replicas, timeout_s=settings.graceful_shutdown_timeout + 30)
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
