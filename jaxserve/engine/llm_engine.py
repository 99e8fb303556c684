"""LLMEngine: requests in, RequestOutputs out, one EngineCore step at a time.

Owns what the core does not: prompt validation and tokenization, seeds, the fan-out of n > 1
into child requests, incremental detokenization and stop strings, and assembling RequestOutputs.

Failure and concurrency contract:

- Every public method that changes the engine's state, and ``get_stats``, holds the engine's
  lock (a re-entrant one), so calls from several threads are serialised, never interleaved
  inside a step; ``exclusive()`` holds it across several calls (``LLM.generate`` runs its whole
  batch under it). Checking and tokenizing a request (``check_request``, ``process_prompt``,
  ``render_chat_prompt``) take no lock: AsyncLLM runs them off the event loop while the engine
  thread steps; ``has_unfinished_requests`` and ``get_num_unfinished_requests`` read a length
  without it.
- Ctrl-C inside ``step()`` is held until the step ends (interrupts.defer_sigint), then raised
  as KeyboardInterrupt: the step counts as failed (below).
- A ``step()`` that raises, for any reason (an error, or Ctrl-C), first aborts every unfinished
  request and frees all their blocks, then lets the exception through: the engine is left empty
  and ready, never half-updated. KV pages that the failed step left unusable are reallocated
  (and the prefix cache, which described them, dropped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.background_warmup import BackgroundWarmup
from jaxserve.engine.core import EngineCore
from jaxserve.engine.fan_out import SampleFanOut
from jaxserve.engine.interrupts import defer_sigint
from jaxserve.engine.job_preview import JobPreview, check_warmup_for
from jaxserve.engine.prompts import PromptProcessor, PromptType
from jaxserve.engine.request_state import RequestState
from jaxserve.engine.run_ahead import RunAheadPolicy
from jaxserve.kv_transfer_config import check_params_for
from jaxserve.outputs import RequestOutput
from jaxserve.request import RequestStatus
from jaxserve.runner.factory import build_runner
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_trace import StepTrace
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.manager import StructuredOutputs
from jaxserve.structured.request_constraints import ConstraintSpec

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A prompt and its params as LLMEngine.check_request validated them."""

    text: str | None  # the prompt text, None for token ids
    token_ids: list[int]  # the prompt's token ids, in the vocabulary, within the limits
    params: SamplingParams  # the engine's validated copy
    # The compiled grammar and bad words (structured/manager.py); None: no per-step mask.
    constraints: ConstraintSpec | None = None


class LLMEngine:
    """The engine of docs/architecture.md. ``LLMEngine(model=..., **same_kwargs_as_LLM)``;
    ``warmup_for`` (jaxserve's, passed on by LLM and AsyncLLM; warmup="job" only): a job's
    requests (job_preview.JobPreview), whose shapes compile while the weights load."""

    def __init__(
        self, model: str = "tiny-random-llama", *, warmup_for: JobPreview | None = None, **kwargs
    ) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        check_warmup_for(warmup_for, config)
        job_set = None if warmup_for is None else warmup_for.warmup_set
        runner, info = build_runner(config, job_set)
        self.config = info.config
        self.info = info
        self.tokenizer = info.tokenizer.tokenizer
        self.prompts = PromptProcessor(
            info.tokenizer,
            info.vocab_size,
            self.config.model.max_model_len,
            self.config.model.model,
        )
        policy = RunAheadPolicy() if info.plan.run_ahead == "measured" else None
        self._lock = threading.RLock()
        # The rest of a server's warm-up, compiled while it serves (background_warmup.py);
        # None: warm-up ended at construction (or comes per job).
        self.background_warmup = None
        if self.config.runner.enable_background_warmup:
            self.background_warmup = BackgroundWarmup(runner, self._lock, info.plan.compile_workers)
        self.core = EngineCore(
            self.config, runner, info.num_kv_blocks, info.host_tier, policy,
            warmup=self.background_warmup,
        )  # fmt: skip
        self.structured = StructuredOutputs(
            self.tokenizer, info.vocab_size, info.eos_token_ids, info.plan.grammar_fill_threads
        )
        self._states: dict[str, RequestState] = {}  # user request id -> state
        self._child_of: dict[str, tuple[str, int]] = {}  # scheduler id -> (user id, index)
        # the scheduler requests of each user request (its n samples)
        self._fan_out = SampleFanOut(self.config.model.seed, info.eos_token_ids)
        self._shut_down = False
        if self.background_warmup is not None:
            self.background_warmup.start()
        # No gc.freeze() here: frozen objects are never collected, and a notebook that builds
        # a second LLM must get the first one's memory back. A process that owns its engine
        # for good (the CLI) may freeze after building it.

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler, for inspection (requests go through the core)."""
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        """The core's runner, for inspection (steps go through the core)."""
        return self.core.runner

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine's lock across several calls: other threads' calls wait."""
        with self._lock:
            yield

    # ---- inputs -----------------------------------------------------------------------------
    def process_prompt(
        self, prompt: PromptType, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """Validate a prompt and tokenize it: (text or None, token ids). Allocates nothing.
        See PromptProcessor.process (engine/prompts.py)."""
        return self.prompts.process(prompt, add_special_tokens=add_special_tokens)

    def render_chat_prompt(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> dict[str, Any]:
        """One conversation rendered with the chat template (the tokenizer's, or
        ``chat_template``) as a prompt dict {"prompt", "prompt_token_ids"}, the template told
        of ``tools`` when given. Allocates nothing. See PromptProcessor.render_chat
        (engine/prompts.py)."""
        return self.prompts.render_chat(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    def check_request(
        self, prompt: PromptType, params: SamplingParams | None = None
    ) -> CheckedRequest:
        """Everything ``add_request`` checks of a prompt and its params, without queueing:
        lets a caller refuse a whole batch before queueing any of it, then queue the checked
        requests without checking (or tokenizing) them again.

        Raises:
            TypeError / ValueError: naming the field, the value and the limit.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()
        config = self.config
        check_params_for(params.kv_transfer_params, config.kv_transfer,
                         config.cache.enable_prefix_caching)  # fmt: skip
        text, token_ids = self.process_prompt(prompt)
        self.core.check_prompt_length(len(token_ids))
        # Last: a grammar compiles (or comes from the cache) only for a request that can run.
        return CheckedRequest(text, token_ids, params, self.structured.check(params))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | CheckedRequest,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Validate, tokenize and queue one request (n > 1: n scheduler requests); a
        CheckedRequest (check_request) carries its params and is queued as it is.

        The engine keeps a validated copy of ``params`` (SamplingParams.clone): changing the
        object afterwards does not reach the queued request.

        Raises:
            TypeError / ValueError before anything is queued or allocated.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(
                f"priority must be an int, got {priority!r} ({type(priority).__name__})"
            )
        if isinstance(prompt, CheckedRequest) and params is not None:
            raise TypeError("params must be None with a CheckedRequest, which carries its own")
        with self._lock:
            if self._shut_down:
                raise RuntimeError(f"request {request_id!r}: the engine was shut down")
            if request_id in self._states:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by an unfinished request"
                )
            checked = prompt
            if not isinstance(checked, CheckedRequest):
                checked = self.check_request(prompt, params)
            self._queue(request_id, checked, priority)

    def _queue(self, request_id: str, checked: CheckedRequest, priority: int) -> None:
        params, token_ids = checked.params, checked.token_ids
        engine_ids = self._fan_out.engine_ids(request_id, params.n)
        now = time.monotonic()
        requests = self._fan_out.requests(
            engine_ids, token_ids, params, priority, now, checked.constraints
        )
        state = RequestState(
            request_id, engine_ids, checked.text, token_ids, params, self.tokenizer, requests, now
        )
        self.core.add_requests(requests)
        self._states[request_id] = state
        for i, engine_id in enumerate(engine_ids):
            self._child_of[engine_id] = (request_id, i)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort user requests (all their samples); unknown ids are ignored. Returns the final
        output of each request aborted (its unfinished samples end with "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        with self._lock, defer_sigint():
            for rid in ids:
                state = self._states.pop(rid, None)
                if state is None:
                    continue
                self.core.abort_requests(state.engine_ids)
                for engine_id in state.engine_ids:
                    self._child_of.pop(engine_id, None)
                state.abort()
                aborted.append(state)
        return [state.output() for state in aborted]

    # ---- the loop ---------------------------------------------------------------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the user requests that progressed, or
        with finished_only=True only of those that finished (what an offline batch reads: it
        skips building a RequestOutput, with a copy of every token list, per running request
        per step).

        Raises:
            Whatever the step raised (KeyboardInterrupt included), after aborting every
            unfinished request: see the module docstring.
        """
        with self._lock, defer_sigint() as interrupt:
            try:
                outputs = self._step(finished_only)
                interrupt.check()  # a Ctrl-C held during the step aborts like a failure
                return outputs
            except BaseException:
                self._recover()  # Ctrl-C is held here: the recovery runs to its end
                raise

    def _recover(self) -> None:
        """Abort everything and make the scheduler, the runner and the KV pages agree again."""
        aborted = self.core.recover()
        self._states.clear()
        self._child_of.clear()
        logger.warning("engine step failed: aborted %d unfinished requests", len(aborted))

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        progressed: dict[str, RequestState] = {}
        for out in self.core.step():
            owner = self._child_of.get(out.req_id)
            if owner is None:
                continue
            request_id, index = owner
            state = self._states[request_id]
            stop = state.apply(index, out)
            if stop is not None and not out.finished:
                self.core.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
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

    def unfinished_requests(self) -> list[tuple[int, SamplingParams]]:
        """(prompt length, params) of each unfinished user request (job_warmup.py)."""
        with self._lock:
            return [(len(s.prompt_token_ids), s.params) for s in self._states.values()]

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``reset_prefix_cache``: later prompts are
        computed again. Returns False, changing nothing, while requests are unfinished."""
        with self._lock:
            return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop everything the engine owns that runs on its own (vLLM's AsyncLLM.shutdown is
        the name): unfinished requests are aborted, then the runner's KV connector (transfer
        server, lease and pull threads), the step tracer's thread and the grammar compilers
        stop. A server's background warm-up stops first, outside the lock (its thread may be
        waiting for it to run a stage). Idempotent; a request added afterwards raises
        RuntimeError."""
        if self.background_warmup is not None:
            self.background_warmup.stop()
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self.abort_request(list(self._states))
            self.core.close()
            self.structured.shutdown()

    def set_step_tracer(self, tracer: Callable[[StepTrace], None] | None) -> None:
        """Hand every later step's StepTrace (phase times, batch shape) to ``tracer``; None
        turns tracing off. A traced step waits for the device before it returns (see
        jaxserve/runner/step_trace.py): a profiling tool, not a serving mode."""
        with self._lock:
            self.core.set_step_tracer(tracer)

    def get_stats(self, *, include_plan: bool = True) -> dict[str, Any]:
        """The counters of docs/architecture.md (num_compilations: fresh XLA compilations of the
        step), plus num_compilation_cache_hits (loaded from the persistent cache instead),
        "recompilations" (each compilation after warm-up, with what was new),
        num_requests_running / num_requests_waiting (scheduler requests: one per sample) and
        "plan": the execution plan as a dict (platform, device_kind, attention, sampler_draw, dtype,
        kv_cache_dtype, tensor_parallel_size, ...). ``include_plan=False`` leaves "plan" out: the
        counters alone, cheap enough to read after every step (AsyncLLM's metrics)."""
        with self._lock:
            stats = self.core.get_stats()
        if self.background_warmup is not None:  # None once lifted
            stats["step_token_cap"] = self.background_warmup.cap.tokens
        if include_plan:
            stats["plan"] = self.info.plan.as_dict()
        return stats
