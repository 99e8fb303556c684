"""The TPU kernel under TPU interpret mode, which simulates HBM/VMEM, DMAs and semaphores:
DMA data lands only when its semaphore is waited on, scratch memory starts as NaN, the grid runs
on two simulated cores (both axes are parallel), and a happens-before race detector watches
every buffer access."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rpa_cases as cases
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)

STRICT = pltpu.InterpretParams(
    detect_races=True,
    num_cores_or_threads=2,
    uninitialized_memory="nan",
    dma_execution_mode="on_wait",
    random_seed=0,
)


@pytest.fixture(autouse=True)
def _fresh_interpreter_state() -> Iterator[None]:
    # After an exception the interpreter keeps its simulated state; never leak it across tests.
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "kind", "options"),
    [
        # One page per DMA step and small query blocks: double buffering within and across
        # sequences, many programs per core.
        (cases.SHAPES[1], "mixed", dict(pages_per_tile=1, block_q=4)),
        (cases.SHAPES[4], "prefill", dict(sliding_window=7)),
    ],
    ids=["mixed-small-tiles", "prefill-window"],
)
def test_tpu_kernel_is_correct_and_race_free(shape, kind: str, options: dict) -> None:
    args = cases.make_inputs(shape, cases.batch(kind, shape.page_size))
    scale = cases.sm_scale(shape)
    window = options.get("sliding_window")
    want = ragged_paged_attention_reference(*args, sm_scale=scale, sliding_window=window)
    got = ragged_paged_attention_tpu(*args, sm_scale=scale, interpret=STRICT, **options)
    got.block_until_ready()
    assert not tpu_interpret.races.races_found
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_race_detector_catches_a_read_before_dma_wait() -> None:
    """Control: the same interpreter settings flag a kernel that reads a DMA target too early,
    so the race-free result above means something."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    call = pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=STRICT,
    )
    call(jnp.ones((8, 128), jnp.float32)).block_until_ready()
    assert tpu_interpret.races.races_found
