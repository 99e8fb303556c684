"""What a phase's child process of bench/gpu_e2e.py reads and writes: the requests of its spec,
and its result, rewritten (atomically) at every milestone so that a killed child leaves what it
measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import _datasets


class Result(dict):
    """A child's result, rewritten (atomically) at every milestone."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        write_json(self.path, self)


def write_json(path: str | Path, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def spec_requests(spec: dict) -> list[_datasets.BenchRequest]:
    return [_datasets.BenchRequest(ids, n) for ids, n in spec["requests"]]
