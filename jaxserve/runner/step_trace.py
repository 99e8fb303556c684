"""StepTrace: what one engine step did and where its time went, for profiling.

Off by default. ``LLMEngine.set_step_tracer(fn)`` turns it on: every step then hands ``fn`` a
StepTrace. Tracing waits for the device at the end of the step's dispatch (to split the host's
time from the device's), so a traced step is not overlapped with the next one's host work:
use it to profile, not to serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxserve.runner.input_batch import PreparedBatch


@dataclass
class StepTrace:
    """Phase times (seconds) of one engine step and the shape of its batch.

    The runner fields stay at their defaults for a step that ran no model (an empty batch).
    """

    schedule_s: float = 0.0  # Scheduler.schedule
    execute_s: float = 0.0  # ModelRunner.execute_model, all of it
    update_s: float = 0.0  # Scheduler.update_from_output
    prepare_s: float = 0.0  # host arrays of the batch (InputBatch, sampling, RoPE rows)
    dispatch_s: float = 0.0  # the jitted step's call, until it returns (asynchronous dispatch)
    device_s: float = 0.0  # from the call until the sampled ids are ready
    padded_tokens: int = 0  # T bucket
    padded_rows: int = 0  # R bucket
    table_width: int = 0  # B bucket
    q_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i32[rows]
    kv_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i32[rows]
    all_greedy: bool = True  # no row samples with temperature > 0

    def record_phases(self, schedule_s: float, execute_s: float, update_s: float) -> None:
        """The engine core's three phases."""
        self.schedule_s, self.execute_s, self.update_s = schedule_s, execute_s, update_s

    def record_batch(self, batch: PreparedBatch, temperature: np.ndarray, prepare_s: float) -> None:
        """The runner's prepared batch, its rows' temperatures and the
        seconds it took to build the host arrays."""
        rows = len(batch.req_ids)
        self.prepare_s = prepare_s
        self.padded_tokens = int(batch.input_ids.shape[0])
        self.padded_rows, self.table_width = (int(n) for n in batch.block_tables.shape)
        self.q_lens = np.array(batch.num_scheduled[:rows], np.int32)
        self.kv_lens = np.array(batch.kv_lens[:rows], np.int32)
        self.all_greedy = bool((np.asarray(temperature)[:rows] <= 0).all())

    def record_device(self, dispatch_s: float, device_s: float) -> None:
        """The jitted step's dispatch and device time."""
        self.dispatch_s, self.device_s = dispatch_s, device_s

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens of the step."""
        return int(self.q_lens.sum())

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.update_s
