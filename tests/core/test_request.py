"""Request and RequestStatus: token bookkeeping and the stop rules."""

from __future__ import annotations

import pytest
from sched_fake_model import make_request

from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams


def test_status_finished_and_reasons() -> None:
    assert not RequestStatus.WAITING.is_finished and RequestStatus.WAITING.finish_reason is None
    assert not RequestStatus.RUNNING.is_finished and not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert all(s.is_finished for s in RequestStatus if s.name.startswith("FINISHED"))


def test_token_lists_grow_together() -> None:
    prompt = [1, 2, 3]
    req = make_request("r", prompt)
    prompt.append(9)  # the request keeps its own copy
    assert req.num_prompt_tokens == 3 and req.num_tokens == 3 and req.num_output_tokens == 0
    req.append_output_token_id(7)
    assert req.all_token_ids == [1, 2, 3, 7] and req.output_token_ids == [7]
    assert req.num_tokens == 4 and req.num_output_tokens == 1
    assert req.status == RequestStatus.WAITING and not req.is_finished


def test_stop_token_then_eos_then_length_order() -> None:
    req = make_request("r", [1], max_tokens=3, eos=frozenset({5}), stop_token_ids=[6])
    req.append_output_token_id(6)
    assert req.check_stop(6) == RequestStatus.FINISHED_STOPPED and req.stop_reason == 6
    req = make_request("r", [1], max_tokens=1, eos=frozenset({5}))
    req.append_output_token_id(5)
    # EOS on the last allowed token is a "stop", with no stop_reason.
    assert req.check_stop(5) == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    req = make_request("r", [1], max_tokens=2, eos=frozenset({5}))
    req.append_output_token_id(3)
    assert req.check_stop(3) is None
    req.append_output_token_id(4)
    assert req.check_stop(4) == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_and_ignore_eos() -> None:
    req = make_request("r", [1], max_tokens=5, eos=frozenset({5}), min_tokens=2)
    req.append_output_token_id(5)
    assert req.check_stop(5) is None  # 1 output < min_tokens
    req.append_output_token_id(5)
    assert req.check_stop(5) == RequestStatus.FINISHED_STOPPED
    req = make_request("r", [1], max_tokens=5, eos=frozenset({5}), ignore_eos=True)
    req.append_output_token_id(5)
    assert req.check_stop(5) is None


def test_bad_types_raise() -> None:
    with pytest.raises(TypeError, match="request_id"):
        Request(3, [1], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sampling_params"):
        Request("r", [1], {"max_tokens": 3})  # type: ignore[arg-type]
