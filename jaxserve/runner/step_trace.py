"""StepTrace: what one engine step did and where its time went, for profiling; ReadyWatch: when
the device finished each step.

Off by default. ``LLMEngine.set_step_tracer(fn)`` turns it on: every step then hands ``fn`` a
StepTrace once it is learned. Tracing does not wait for the device in the step's path: a
ReadyWatch thread waits for each step's sampled ids and notes when they were ready, so a traced
engine overlaps its steps as an untraced one does (async scheduling), and the trace tells how
long the device sat idle before each step was dispatched: the time from the previous step's
end to this step's dispatch, 0 when this step was queued behind the previous one.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from jaxserve.runner.input_batch import PreparedBatch


@dataclass
class StepTrace:
    """Phase times (seconds) of one engine step and the shape of its batch.

    The runner fields stay at their defaults for a step that ran no model (an empty batch).
    """

    schedule_s: float = 0.0  # Scheduler.schedule (and the step's token masks)
    execute_s: float = 0.0  # ModelRunner.dispatch, all of it (host work, the calls)
    masks_s: float = 0.0  # the step's token masks (structured outputs), where it has some
    collect_s: float = 0.0  # ModelRunner.collect: waiting for the samples, and the host's part
    update_s: float = 0.0  # Scheduler.update_from_output (and what follows it)
    prepare_s: float = 0.0  # host arrays of the batch (InputBatch, sampling, RoPE rows)
    dispatch_s: float = 0.0  # the jitted halves' calls, until they return (asynchronous)
    device_s: float = 0.0  # from when the device could start the step until its samples were ready
    device_idle_s: float = 0.0  # the device's wait for this step after the previous one ended
    dispatched_at: float = 0.0  # time.perf_counter() when the jitted step was called
    ready_at: float | None = None  # ... and when its samples were ready (ReadyWatch)
    padded_tokens: int = 0  # T bucket
    padded_rows: int = 0  # R bucket
    table_width: int = 0  # B bucket
    q_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i32[rows]
    kv_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i32[rows]
    all_greedy: bool = True  # no row samples with temperature > 0
    ready_event: threading.Event = field(default_factory=threading.Event, repr=False)

    def record_phases(self, schedule_s: float, execute_s: float) -> None:
        """The engine core's scheduling and the runner's dispatch."""
        self.schedule_s, self.execute_s = schedule_s, execute_s

    def record_learned(self, collect_s: float, update_s: float) -> None:
        """The engine core's collection of the samples and its update."""
        self.collect_s, self.update_s = collect_s, update_s

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

    def record_dispatch(self, called_at: float, dispatch_s: float) -> None:
        """The forward half's call: when it began (the device may start the step from then on;
        XLA:CPU even runs part of it in the call when the device is idle), and how long it
        took to return."""
        self.dispatched_at, self.dispatch_s = called_at, dispatch_s

    def add_dispatch(self, dispatch_s: float) -> None:
        """The sample half's call (step.py), after the forward's (record_dispatch)."""
        self.dispatch_s += dispatch_s

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens of the step."""
        return int(self.q_lens.sum())

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def total_s(self) -> float:
        """The host's time on the step: scheduling, dispatch, collection and update."""
        return self.schedule_s + self.execute_s + self.collect_s + self.update_s


class _Ready(Protocol):
    def ready(self) -> None:
        """Block until the step's samples are computed."""


class ReadyWatch:
    """A thread that waits for each dispatched step's samples, in dispatch order, and notes in
    its StepTrace when they were ready, its device time and the device's idle time before it.
    One per traced engine; the thread ends with the process (a daemon) or with ``close``."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[StepTrace, _Ready] | None] = queue.SimpleQueue()
        self._last: StepTrace | None = None  # the last step handed to watch
        self._thread = threading.Thread(target=self._run, name="jaxserve-ready-watch",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def watch(self, trace: StepTrace, step: _Ready, dispatched_at: float) -> None:
        """A dispatched step (its jitted call began at trace.dispatched_at, or, for a step that
        ran no model, at ``dispatched_at``): its idle time is the wait from the previous
        step's samples being ready until then (0 if they were not yet: the device was still
        busy with it)."""
        prev, self._last = self._last, trace
        if not trace.dispatched_at:
            trace.dispatched_at = dispatched_at
        dispatched_at = trace.dispatched_at
        prev_ready = prev.ready_at if prev is not None else None
        trace.device_idle_s = 0.0 if prev_ready is None else max(0.0, dispatched_at - prev_ready)
        trace.ready_at = None
        self._queue.put((trace, step))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        prev_ready = 0.0
        while (item := self._queue.get()) is not None:
            trace, step = item
            try:
                step.ready()
            except Exception:  # the step failed: the engine's collect raises it
                pass
            now = time.perf_counter()
            trace.device_s = now - max(trace.dispatched_at, prev_ready)
            trace.ready_at = prev_ready = now
            trace.ready_event.set()
