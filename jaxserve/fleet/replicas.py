"""Start, watch and stop the data-parallel replicas: ``jaxserve serve`` processes on
127.0.0.1, each with its placement (placement.py) and no API key of its own (only the front
listens beyond loopback; it checks the key).

A replica's port is found free by binding port 0 and closing it just before the process
starts; a replica that cannot take it exits with status 2 and the start fails naming it. A
JaxTransferConnector's fixed ``transfer_port`` (kv_transfer_config) would be taken by every
replica: replica i listens on ``transfer_port + i`` instead (port 0, the default: each its own
free port; a producer's answers name the port it has, so consumers and the router need no
list).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxserve.fleet.front_watch import front_environment
from jaxserve.fleet.placement import Placement

logger = logging.getLogger("jaxserve")


@dataclass
class Replica:
    """One replica process. index: its place among the replicas (the ``replica`` label of
    /metrics); url: http://127.0.0.1:PORT; process: its Popen."""

    index: int
    url: str
    process: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_KV_FLAG = "--kv-transfer-config"


def replica_serve_args(serve_args: Sequence[str], index: int, num_replicas: int) -> list[str]:
    """Replica ``index``'s ``jaxserve serve`` flags: ``serve_args`` with a fixed
    kv_transfer_config ``transfer_port`` moved to ``transfer_port + index``.

    Raises:
        ValueError: the last replica's port would pass 65535.
    """
    argv = list(serve_args)
    if _KV_FLAG not in argv[:-1]:
        return argv
    at = argv.index(_KV_FLAG) + 1
    config = json.loads(argv[at])
    extra = config.get("kv_connector_extra_config") or {}
    base = extra.get("transfer_port", 0)
    if not isinstance(base, int) or isinstance(base, bool) or base == 0:
        return argv  # 0: each replica a free port of its own; a bad value: the replica says
    if base + num_replicas - 1 > 65535:
        raise ValueError(
            f"kv_transfer_config transfer_port={base}: {num_replicas} data-parallel replicas "
            f"take ports {base}..{base + num_replicas - 1}, past 65535"
        )
    config["kv_connector_extra_config"] = {**extra, "transfer_port": base + index}
    argv[at] = json.dumps(config)
    return argv


def start_replicas(
    serve_args: Sequence[str],
    placements: Sequence[Placement],
    environ: Mapping[str, str],
) -> list[Replica]:
    """Start one ``jaxserve serve SERVE_ARGS --host 127.0.0.1 --port P`` per placement
    (replica_serve_args: each its own KV transfer port)."""
    replicas = []
    for index, placement in enumerate(placements):
        port = free_port()
        own = replica_serve_args(serve_args, index, len(placements))
        argv = [sys.executable, "-m", "jaxserve.cli", "serve", *own]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        env = {**environ, **placement.env, **front_environment()}  # exits with the front
        env.pop("JAXSERVE_API_KEY", None)  # the front checks the key; replicas are loopback
        process = subprocess.Popen(argv, env=env, start_new_session=True)
        if placement.cpus is not None and hasattr(os, "sched_setaffinity"):
            # Before the child has imported jax: the threads XLA starts later inherit it.
            os.sched_setaffinity(process.pid, placement.cpus)
        where = f"cores {list(placement.cpus)}" if placement.cpus is not None else placement.env
        logger.info("replica %d: pid %d on 127.0.0.1:%d (%s)", index, process.pid, port, where)
        replicas.append(Replica(index, f"http://127.0.0.1:{port}", process))
    return replicas


def wait_ready(replicas: Sequence[Replica], timeout_s: float) -> None:
    """Return once every replica answers /health with 200 (model loaded, warmed up).

    Raises:
        RuntimeError: a replica exited, or did not become ready in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if not replica.alive:
                raise RuntimeError(
                    f"replica {replica.index} exited with status {replica.process.returncode} "
                    "before it was ready (its log is above)"
                )
            if health(replica.url, timeout_s=2.0):
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"replicas {[r.index for r in pending]} were not ready after {timeout_s:.0f} s"
            )
        if pending:
            time.sleep(0.25)


def health(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stop_replicas(replicas: Sequence[Replica], timeout_s: float) -> None:
    """SIGTERM every replica (each shuts its engine down), then SIGKILL what is left after
    ``timeout_s``; reaps them all."""
    for replica in replicas:
        if replica.alive:
            replica.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        try:
            replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("replica %d did not stop in time: killed", replica.index)
            replica.process.kill()
            replica.process.wait()
