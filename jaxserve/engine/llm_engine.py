"""LLMEngine: requests in, RequestOutputs out, one EngineCore step at a time.

Owns what the core does not: prompt validation and tokenization, seeds, the fan-out of n > 1
into child requests, incremental detokenization and stop strings, and assembling RequestOutputs.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.core import EngineCore
from jaxserve.engine.request_state import RequestState, child_request_id
from jaxserve.outputs import RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.factory import build_runner
from jaxserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
_MASK63 = (1 << 63) - 1


def _mix_seed(seed: int, index: int) -> int:
    """A distinct 63-bit seed for child `index` of a seeded n > 1 request (splitmix64)."""
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class LLMEngine:
    """The engine of DESIGN.md section 5. ``LLMEngine(model=..., **same_kwargs_as_LLM)``."""

    def __init__(self, model: str = "tiny-random-llama", **kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.runner, info = build_runner(config)
        self.config = info.config
        self.info = info
        self.tokenizer = info.tokenizer.tokenizer
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, info.num_kv_blocks)
        self.core = EngineCore(self.scheduler, self.runner)
        self._states: dict[str, RequestState] = {}  # user request id -> state
        self._child_of: dict[str, tuple[str, int]] = {}  # scheduler id -> (user id, index)
        self._seed_rng = np.random.default_rng(self.config.model.seed)
        # Start-up made many long-lived objects (blocks, buffers, jit caches); freezing them
        # keeps the cyclic GC from rescanning them during serving (as vLLM's EngineCore does:
        # ~0.4 ms a step at 1024 running requests, measured by bench/scheduler_overhead.py).
        gc.collect()
        gc.freeze()

    # ---- inputs -----------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate a prompt and tokenize it: (text or None, token ids). Allocates nothing.

        Raises:
            TypeError: not a str, a list of int, or a dict with "prompt" / "prompt_token_ids".
            ValueError: empty, a token id outside [0, vocab_size), text without a tokenizer.
        """
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                token_ids = None
            else:
                raise TypeError(
                    f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        elif isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            token_ids = prompt
        else:
            raise TypeError(
                f"prompt must be a str, a list of int or a dict, got {type(prompt).__name__}"
            )
        if token_ids is None:
            if not isinstance(text, str):
                raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
            if not text:
                raise ValueError("prompt is empty (0 characters); need at least 1 token")
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.config.model.model!r} has no tokenizer: pass prompt_token_ids"
                )
            token_ids = self.tokenizer.encode(text).ids
        return text, self._check_token_ids(token_ids)

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in token_ids):
            raise TypeError("prompt_token_ids must be a list of int")
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("prompt is empty (0 tokens); need at least 1 token")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Validate, tokenize and queue one request (n > 1: n scheduler requests).

        Raises:
            TypeError / ValueError before anything is queued or allocated.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._states:
            raise ValueError(
                f"request_id {request_id!r} is already in use by an unfinished request"
            )
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.process_prompt(prompt)
        state = RequestState(request_id, text, token_ids, params, self.tokenizer)
        requests = self._make_requests(request_id, token_ids, params, priority)
        added: list[str] = []
        try:
            for i, req in enumerate(requests):
                parent = requests[0].request_id if i else None
                self.scheduler.add_request(req, parent_req_id=parent)
                added.append(req.request_id)
        except Exception:
            self.scheduler.abort_requests(added)
            raise
        self._states[request_id] = state
        for i, req in enumerate(requests):
            self._child_of[req.request_id] = (request_id, i)

    def _make_requests(
        self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int
    ) -> list[Request]:
        base = params.seed
        if base is None:
            base = int(self._seed_rng.integers(0, _MASK63, dtype=np.int64))
        now = time.monotonic()
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                child = dataclasses.replace(
                    params, n=1, prompt_logprobs=params.prompt_logprobs if i == 0 else None
                )
            requests.append(
                Request(
                    child_request_id(request_id, i),
                    token_ids,
                    child,
                    eos_token_ids=self.info.eos_token_ids,
                    arrival_time=now,
                    priority=priority,
                    seed=base if i == 0 else _mix_seed(base, i),
                )
            )
        return requests

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort user requests (all their samples); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._states.pop(rid, None)
            if state is None:
                continue
            children = state.child_ids()
            self.scheduler.abort_requests(children)
            for child in children:
                self._child_of.pop(child, None)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the user requests that progressed, or
        with finished_only=True only of those that finished (what an offline batch reads: it
        skips building a RequestOutput, with a copy of every token list, per running request
        per step; 3.75 ms a step at 256 running in bench/profile_throughput.py)."""
        progressed: dict[str, RequestState] = {}
        for out in self.core.step():
            owner = self._child_of.get(out.req_id)
            if owner is None:
                continue
            request_id, index = owner
            state = self._states[request_id]
            stop = state.apply(index, out)
            if stop is not None and not out.finished:
                self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
            if out.finished or stop is not None:
                del self._child_of[out.req_id]
            progressed[request_id] = state
        results = []
        for request_id, state in progressed.items():
            finished = state.finished
            if finished or not finished_only:
                results.append(state.output())
            if finished:
                del self._states[request_id]
        return results

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def get_stats(self) -> dict[str, int | float]:
        stats = dict(self.scheduler.get_stats())
        stats["num_compilations"] = self.runner.num_compilations
        return stats
