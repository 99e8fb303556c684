"""The persistent compilation cache, on by default: a second process loads the engine's step
functions instead of compiling them, and get_stats() tells fresh compilations from cache hits.
Each case runs in fresh processes (the cache is process-wide jax configuration); they load
from one filled folder, so only two of them compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import jax
from jaxserve import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
kwargs.setdefault("warmup", True)
llm = LLM("tiny-random-llama", num_kv_blocks=16, block_size=8, max_model_len=32,
          max_num_batched_tokens=8, max_num_seqs=2, **kwargs)
if not kwargs["warmup"]:  # compile the one shape of a one-token request, not every bucket
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
stats = llm.get_stats()
print(json.dumps({"fresh": stats["num_compilations"], "hits": stats["num_compilation_cache_hits"],
                  "dir": jax.config.jax_compilation_cache_dir}))
"""


def _run(env_updates: dict[str, str | None], **kwargs) -> dict:
    from jaxserve.pallas_kernels import cpu_ffi

    # The C++ CPU kernels' builds stay where this process finds them: a fresh $XDG_CACHE_HOME
    # would otherwise rebuild them in every process (seconds of compiler time each), and what
    # is tested here is the XLA cache alone.
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(cpu_ffi.cache_dir())}
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> tuple[dict, dict]:
    """One process's cache, in the default folder under $XDG_CACHE_HOME: the environment it ran
    in and what it reported. The later processes load from it, so of this module's engine
    processes only this one and the one with the cache off compile."""
    home = tmp_path_factory.mktemp("xdg")
    env = {"JAXSERVE_COMPILATION_CACHE_DIR": None, "XDG_CACHE_HOME": str(home)}
    # The steps of one request, not a whole warm-up: what a second process loads is the same
    # for every step (a whole warm-up loaded: tests/bench/test_startup_bench.py).
    first = _run(env, warmup=False)
    assert first["dir"] == str(home / "jaxserve" / "xla")
    assert first["fresh"] > 0 and first["hits"] == 0
    assert any((home / "jaxserve" / "xla").iterdir())
    return env, first


@pytest.mark.slow
def test_a_second_process_loads_every_step_from_the_cache(filled):
    env, first = filled
    second = _run(env, warmup=False)
    assert second == {"fresh": 0, "hits": first["fresh"], "dir": first["dir"]}


@pytest.mark.slow
def test_the_argument_and_the_environment_move_it_or_turn_it_off(filled, tmp_path):
    # Each points away from the default folder (an empty $XDG_CACHE_HOME) and at the filled
    # one: the folder reported, and every step loaded from it, show it was used.
    _, first = filled
    folder, elsewhere = first["dir"], str(tmp_path / "elsewhere")
    loaded = {"fresh": 0, "hits": first["fresh"], "dir": folder}
    env = {"XDG_CACHE_HOME": elsewhere, "JAXSERVE_COMPILATION_CACHE_DIR": folder}
    assert _run(env, warmup=False) == loaded
    # The argument wins over the environment.
    env_away = {**env, "JAXSERVE_COMPILATION_CACHE_DIR": elsewhere}
    assert _run(env_away, compilation_cache_dir=folder, warmup=False) == loaded
    # "" turns it off, though the environment names a filled folder: everything compiles.
    off = _run(env, compilation_cache_dir="", warmup=False)
    assert off["dir"] is None and off["hits"] == 0 and off["fresh"] == first["fresh"]


@pytest.mark.slow
def test_a_users_own_jax_cache_folder_wins(filled):
    _, first = filled
    env = {"JAX_COMPILATION_CACHE_DIR": first["dir"]}
    own = _run(env, compilation_cache_dir="x", warmup=False)
    assert own == {"fresh": 0, "hits": first["fresh"], "dir": first["dir"]}


def test_bad_value_is_refused():
    from jaxserve.config import RunnerConfig

    with pytest.raises(TypeError, match="compilation_cache_dir must be a folder path"):
        RunnerConfig(compilation_cache_dir=3)


def test_compile_events_count_this_threads_compilations_only():
    import threading

    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runner.compile_cache import CompileEvents

    fn = jax_jit_of(lambda x: jnp.sin(x) + 1)
    before = CompileEvents.in_thread()
    fn(np.ones(3, np.float32))
    assert CompileEvents.in_thread().since(before).compilations == 1
    fn(np.ones(3, np.float32))  # the same shape: reused, nothing compiled
    assert CompileEvents.in_thread().since(before).compilations == 1
    other = threading.Thread(target=lambda: fn(np.ones(5, np.float32)))
    other.start()
    other.join()
    assert CompileEvents.in_thread().since(before).compilations == 1  # not this thread's


def jax_jit_of(f):
    import jax

    return jax.jit(f)
