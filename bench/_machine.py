"""The machine a benchmark ran on: load average and the git state of the checkout, recorded
beside every result (the machines are shared and noisy)."""

from __future__ import annotations

import json
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


def write_results(output: str | Path, results: list, args, load) -> None:
    """Write a side-by-side benchmark's JSON: its result rows, its arguments (an argparse
    namespace), the machine and the checkout's git state; print where it went."""
    report = dict(results=results, args=vars(args), machine=machine(load), git=git_state())
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {output}")
