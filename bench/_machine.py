"""The machine a benchmark ran on: load average and the git state of the checkout, recorded
beside every result (the machines are shared and noisy)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_state() -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True)
        return r.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": len(git("status", "--short").splitlines()),
    }


def machine(load) -> dict:
    """The machine's description for a result file: core counts, platform, Python, and the load
    average the benchmark sampled (``load``, any JSON value)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": load,
    }
