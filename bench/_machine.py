"""The machine a benchmark ran on: load average and the git state of the checkout, recorded
beside every result (the machines are shared and noisy)."""

from __future__ import annotations

import os
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
