"""Runner: the runner as EngineCore sees it (model_runner.ModelRunner is the one there is; the
tests' fakes implement it too): dispatch a step whole, or its forward half and then its sample
half, collect its results, reset after a failure, close at shutdown.
"""

from __future__ import annotations

from typing import Any, Protocol

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.runner.step_trace import StepTrace
from jaxserve.spec_decode.spec_decoder import Proposer


class Runner(Protocol):
    def dispatch(self, scheduler_output: SchedulerOutput, trace: StepTrace | None = None) -> Any:
        """Start one step without waiting for the device; ``trace``, when given, is filled in
        with the runner's part. Returns a handle for ``collect``."""
        ...

    def dispatch_forward(
        self, scheduler_output: SchedulerOutput, trace: StepTrace | None, masks_later: list[str]
    ) -> Any:
        """Start a step's forward half only; the rows of ``masks_later`` (request ids) wait
        for their token masks. Returns a handle for ``dispatch_sample``."""
        ...

    def dispatch_sample(self, forward: Any, token_masks: dict[str, Any]) -> Any:
        """Start the sample half of ``forward`` with the masks of its ``masks_later`` rows.
        Returns a handle for ``collect``."""
        ...

    def collect(self, handle: Any) -> ModelRunnerOutput:
        """A dispatched step's results on the host (waits for the device)."""
        ...

    def reset(self) -> bool: ...

    def close(self) -> None:
        """Stop the runner's own threads and servers (the engine shuts down); idempotent."""
        ...

    @property
    def max_num_sampling_rows(self) -> int:
        """Logits rows one step can sample (requests plus speculative drafts)."""
        ...

    @property
    def spec_proposer(self) -> Proposer | None:
        """The runner's own speculative proposer (a draft model), or None."""
        ...

    @property
    def is_idle(self) -> bool: ...
