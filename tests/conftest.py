"""Test-session set-up shared by every test module: the platform the tests run on.

The suite runs on the CPU unless ``--platform gpu`` or ``--platform tpu`` is given (then the
tests marked ``gpu`` run natively, and expectations derived from the execution plan follow that
platform). The platform is pinned through JAX_PLATFORMS before any test module imports jax.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
_CACHE_DIR = pytest.StashKey[str]()
# Faster XLA:CPU compilations for the tests (pytest_configure says why).
_CPU_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--platform",
        choices=sorted(_JAX_PLATFORMS),
        default="cpu",
        help="the jax platform the tests run on (default: cpu, even where a GPU is visible)",
    )


def pytest_configure(config: pytest.Config) -> None:
    platform = config.getoption("--platform")
    os.environ["JAX_PLATFORMS"] = _JAX_PLATFORMS[platform]
    # No network in tests: a model name that is not a folder must not reach the Hub (the Hub
    # tests lay out a cache folder of their own).
    os.environ["HF_HUB_OFFLINE"] = "1"
    # One persistent compilation cache for the session, shared by its workers and the
    # processes they start (engines of one configuration built again, by another test or a
    # restarted job, load their steps instead of compiling them): a fresh folder, made by the
    # controller before the workers start and removed at the end. The tests that count
    # compilations count fresh ones and cache hits together; tests of the cache itself set
    # their own folder (tests/runner/test_compile_cache.py).
    if not hasattr(config, "workerinput"):
        folder = tempfile.mkdtemp(prefix="jaxserve-test-xla-")
        config.stash[_CACHE_DIR] = folder
        os.environ["JAXSERVE_COMPILATION_CACHE_DIR"] = folder
    if platform == "cpu":
        # The tests compile far more than they run (tiny models, a few steps per engine), and
        # LLVM's optimization is a large part of an XLA:CPU compilation: level 0 took about a
        # third off the CPU time of the engine-building tests measured (two of them). XLA:CPU's
        # MLIR fusion emitters took about half of what was left: the classic emitters halved the
        # CPU time of an engine's step compilations again (fp8 llama engine of
        # test_fp8_kv_parity: 9.1 -> 4.4 s, same tokens). One LLVM module per executable
        # instead of a split one compiled in threads: ~10% less CPU (the workers already keep
        # the cores busy). They change code generation; subprocesses inherit them. A value
        # already set wins. (At level 0 the classic emitters can round differently between
        # two programs in the last bit: tests/models/test_moe_quant.py's bit-exact check runs
        # without them.)
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in _CPU_XLA_FLAGS:
            if flag.split("=")[0] not in flags:
                flags = f"{flags} {flag}".strip()
        os.environ["XLA_FLAGS"] = flags
    # jaxlib 0.10.2 miscompiles some fused CPU computations (jax-ml/jax#39103): the engine
    # applies the workaround when it is built, but a test may run jax before building one.
    from jaxserve.runner.xla_flags import apply_cpu_workarounds

    apply_cpu_workarounds()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests of an xdist_group run on one worker, one after another (--dist loadgroup): start
    # them first, so that the longest serial stretch of the suite never becomes its tail.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    if config.getoption("--platform") == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run with --platform gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
