"""bench/startup.py's child processes: one fresh jaxserve process per measurement
(_startup_child.py's program), on a compilation cache folder of its own, and what is read
from its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from _startup_child import CHILD

CACHE_ENV = "JAXSERVE_COMPILATION_CACHE_DIR"  # jaxserve/runner/compile_cache.py ENV_VAR


def child_env(cache_dir: str) -> dict[str, str]:
    """The environment with jaxserve's cache folder set and jax's own cache settings removed."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("JAX_") and ("COMPILATION_CACHE" in k or "PERSISTENT_CACHE" in k))
    }
    env[CACHE_ENV] = cache_dir
    return env


def run_child(spec: dict, cache_dir: str, timeout: float = 1800) -> dict:
    """One fresh process; its RESULT, with wall_s (spawn to exit), import_s (spawn to jaxserve
    imported) and the stdout lines before the result."""
    spawn = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=child_env(cache_dir),
        timeout=timeout,
    )
    wall = time.time() - spawn
    lines = proc.stdout.splitlines()
    result = next((x for x in reversed(lines) if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        raise RuntimeError(
            f"{spec['mode']} process failed (rc {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    out = json.loads(result[len("RESULT ") :])
    if out["cache_dir"] != cache_dir:
        raise RuntimeError(f"the child used cache {out['cache_dir']!r}, not {cache_dir!r}")
    out["wall_s"] = wall
    out["spawn"] = spawn
    out["import_s"] = out["times"]["imported"] - spawn
    out["stdout"] = [x for x in lines if not x.startswith("RESULT ")]
    return out


def cache_files(folder: str) -> dict:
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def fresh_names(proc: dict) -> dict[str, int]:
    return dict(Counter(proc["fresh_names"]).most_common())


def summary_line(stdout: list[str]) -> str | None:
    """The CLI summary's compilations line ('engine: ... N compilations (M more loaded ...)')."""
    return next((x.strip() for x in stdout if x.startswith("engine:")), None)


def summary_counts(line: str | None) -> tuple[int, int] | None:
    m = re.search(r"(\d+) compilations \((\d+) more loaded", line or "")
    return (int(m[1]), int(m[2])) if m else None
