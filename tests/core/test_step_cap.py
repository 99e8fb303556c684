"""StepTokenCap: the token cap of a server's steps while its warm-up goes on, and the
scheduler under it (host only, the fake model)."""

from __future__ import annotations

import pytest
from sched_fake_model import make_request, make_scheduler, reference_output, run_to_completion

from jaxserve.core.sched.step_cap import StepTokenCap


def test_cap_only_rises_then_lifts() -> None:
    cap = StepTokenCap(8)
    assert cap.budget(32) == 8 and cap.budget(6) == 6
    cap.raise_to(4)  # never lower
    assert cap.tokens == 8
    cap.raise_to(16)
    assert cap.budget(32) == 16
    cap.lift()
    cap.raise_to(24)  # nothing once lifted
    assert cap.tokens is None and cap.budget(32) == 32


@pytest.mark.parametrize("bad, error", [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_cap_is_refused(bad, error) -> None:
    with pytest.raises(error, match="StepTokenCap tokens"):
        StepTokenCap(bad)


def test_capped_scheduler_chunks_long_prompts_and_rations_decodes() -> None:
    """Under a cap no step schedules more tokens than it; a prompt longer than the cap is
    prefilled in chunks of it, and the outputs are those of the uncapped scheduler."""
    sched, runner = make_scheduler(budget=32, max_seqs=8)
    cap = StepTokenCap(6)
    sched.token_cap = cap
    prompts = {f"r{i}": list(range(1, 20 + i)) for i in range(8)}
    reqs = [make_request(rid, p, max_tokens=5) for rid, p in prompts.items()]
    for req in reqs:
        sched.add_request(req)
    first = sched.schedule()
    assert first.total_num_scheduled_tokens == 6  # r0's first chunk of its 19 tokens
    sched.update_from_output(first, runner.execute(first))
    for _ in range(12):  # bounded: the cap holds while it is set
        so = sched.schedule()
        assert 0 < so.total_num_scheduled_tokens <= 6
        sched.update_from_output(so, runner.execute(so))
    assert sched.has_unfinished_requests()
    cap.lift()  # warm-up over: the full budget again
    results = run_to_completion(sched, runner)
    for req in reqs:
        expected, _ = reference_output(prompts[req.request_id], req.sampling_params)
        assert req.output_token_ids == expected, req.request_id
    assert set(results) <= set(prompts)
