"""EngineCore: one engine step as a three-line recipe (docs/architecture.md)."""

from __future__ import annotations

from typing import Protocol

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput


class Runner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Wires a Scheduler to the runner it is given; knows nothing of tokenizers or text."""

    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
