"""ConstrainedRequests: the engine core's requests with constraints (a grammar, allowed ids, bad
words), step by step: their token masks when a step is scheduled, their drafts cut to what the
constraints allow, and after the step their matchers advanced and the requests whose grammar is
complete, rejected a token or reached a dead end ended. Host side; an engine without any
constrained request pays nothing per step (the set of ids is empty)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.structured.draft_checks import cut_drafts, run_lengths
from jaxserve.structured.step_masks import (
    advance_matchers,
    dead_ends_reached,
    sampling_constrained,
    with_finish_reasons,
    with_token_masks,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from jaxserve.core.sched.scheduler import Scheduler


class ConstrainedRequests:
    """The ids of the constrained requests queued so far, less those that ended (the step's
    finished ids: never a walk over the queue), and what each step does with them."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, req: Request) -> None:
        if req.constraints is not None:
            self.ids.add(req.request_id)

    def schedule(
        self, so: SchedulerOutput, requests: dict[str, Request], masks_later: bool
    ) -> tuple[SchedulerOutput, dict[str, int], list[Request]]:
        """``so`` with the masks of its constrained requests and their dead ends; with
        ``masks_later``, ``so`` as it is and the constrained requests that sample (their masks
        are built once the step before is learned: step_masks.token_masks)."""
        if not self.ids:
            return so, {}, []
        self.ids.difference_update(so.finished_req_ids)
        if len(self.ids) > len(requests):  # a guard: an id that ended unseen
            self.ids.intersection_update(requests)
        if masks_later:
            return so, {}, sampling_constrained(so, requests, self.ids)
        return *with_token_masks(so, requests, self.ids), []

    def cut_drafts(
        self,
        drafts: dict[str, list[int]],
        requests: dict[str, Request],
        sampled: Callable[[Request], bool],
    ) -> dict[str, list[int]]:
        """The proposal with constrained requests' drafts cut (draft_checks.cut_drafts)."""
        return cut_drafts(drafts, requests, self.ids, sampled) if self.ids else drafts

    def update(
        self,
        scheduler: Scheduler,
        so: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        dead_ends: dict[str, int],
    ) -> list[EngineCoreOutput]:
        """The scheduler learns the step (a constrained request's verified run cut at its
        grammar's end); then the matchers advance, and a request whose grammar is complete
        finishes ("stop"), one whose matcher rejected a token, or that reached a dead end,
        ends ("abort", logged)."""
        requests = scheduler.requests
        if so.token_masks and so.scheduled_spec_decode_tokens:
            runner_output = run_lengths(so, runner_output, requests, dead_ends)
        outputs = scheduler.update_from_output(so, runner_output)
        if not so.token_masks:
            return outputs
        complete, failed = advance_matchers(outputs, requests)
        # a dead end's EOS: not a stop
        failed = list(dict.fromkeys(failed + dead_ends_reached(outputs, dead_ends)))
        complete = [rid for rid in complete if rid not in failed]
        if complete:
            scheduler.finish_requests(complete, RequestStatus.FINISHED_STOPPED)
        if failed:
            scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        reasons = dict.fromkeys(complete, "stop") | dict.fromkeys(failed, "abort")
        return with_finish_reasons(outputs, reasons)
