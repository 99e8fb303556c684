"""AsyncLLM: the engine for servers, as vLLM V1's. The engine loop runs in its own thread and
never waits on a client; each request streams RequestOutputs to an asyncio consumer.

    async for out in engine.generate(prompt, sampling_params, request_id):
        ...                                  # as tokens arrive; output_kind picks the form

Threads and hand-offs:

    event loop (clients)                      engine thread ("jaxserve-engine")
    generate(): check the request (tokenize,  drains the inbox between steps: adds, aborts
      validate: raises before queueing),      steps the LLMEngine while anything is unfinished,
      puts ("add", ...) in the inbox          sleeps on the inbox when idle
    awaits its OutputChannel             <--  OutputChannel.put(latest cumulative output)
    consumer gone (cancelled, aclose,         ("abort", id) from the consumer's finally:
      an error): puts ("abort", id)           the request's blocks are freed

Admission (ids in use, the max_waiting_requests bound, shutdown) is the RequestGate's
(request_gate.py), which also owns the inbox. A channel keeps only the latest output (each is
cumulative), so a slow consumer never makes the engine queue outputs; DELTA outputs are the
difference from what the consumer last received.
A step that raises aborts every request (LLMEngine's contract): each consumer gets EngineError,
and the engine keeps serving new requests.

What a server needs, besides generate() and abort(), is this client's too, so that it never
reaches the LLMEngine inside: the limits (max_model_len, config), the tokenizer, the checks of
a request before anything is allocated (tokenize, render_chat_prompt, check_request: each runs
in a worker thread, so a long prompt never stalls the event loop; generate() then queues the
CheckedRequest without tokenizing again), get_stats() and the Prometheus exposition
(render_metrics). generate() given a raw prompt checks it on the calling thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.job_warmup import warm_up_for
from jaxserve.engine.llm_engine import CheckedRequest, LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.engine.output_channel import OutputChannel
from jaxserve.engine.prompts import PromptType
from jaxserve.engine.request_gate import EngineError, QueueFullError, RequestGate, cause
from jaxserve.engine.streaming import OutputDelta
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "CheckedRequest", "EngineError", "QueueFullError"]

logger = logging.getLogger("jaxserve")


class AsyncLLM:
    """An engine for concurrent clients: ``AsyncLLM(model=..., **same_kwargs_as_LLM)``.

    Args:
        max_waiting_requests: refuse a new request (QueueFullError) while this many wait to
            start (queued, not yet running); None: no bound.
        served_model_name: the ``model_name`` label of the metrics (default: the model).

    ``enable_background_warmup`` defaults to True with a full warm-up (``warmup=True``, the
    default): the engine answers requests once its smallest buckets are ready while the rest
    compile in the background (engine/background_warmup.py); False warms everything up first.
    """

    def __init__(
        self,
        model: str = "tiny-random-llama",
        *,
        max_waiting_requests: int | None = None,
        served_model_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("warmup", True) is True:
            kwargs.setdefault("enable_background_warmup", True)
        gate = RequestGate(max_waiting_requests)
        self._start(LLMEngine(model=model, **kwargs), gate, served_model_name, owned=True)

    @classmethod
    def from_engine(
        cls,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        served_model_name: str | None = None,
    ) -> AsyncLLM:
        """Drive an LLMEngine already built (it must have no unfinished request, and nothing
        else may step it while this runs). The caller owns it: shutdown() stops this
        client's thread and leaves the engine open (the caller shuts it down)."""
        gate = RequestGate(max_waiting_requests)
        if engine.has_unfinished_requests():
            raise ValueError("AsyncLLM.from_engine needs an engine with no unfinished request")
        self = cls.__new__(cls)
        self._start(engine, gate, served_model_name, owned=False)
        return self

    def _start(
        self, engine: LLMEngine, gate: RequestGate, served_model_name: str | None, owned: bool
    ) -> None:
        self.engine = engine
        self._owns_engine = owned  # the engine thread shuts it down as it ends
        self.metrics = EngineMetrics(served_model_name or engine.config.model.model)
        self._gate = gate
        self._inbox = gate.inbox
        self._streams: dict[str, OutputChannel] = {}  # engine thread only
        self._num_incremental = 0  # streams in it that want more than their final output
        self.metrics.observe_stats(engine.get_stats())
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- the client side --------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._gate.stopping

    @property
    def errored(self) -> bool:
        return self._gate.dead is not None

    @property
    def max_waiting_requests(self) -> int | None:
        """Refuse a new request (QueueFullError) while this many wait to start."""
        return self._gate.max_waiting_requests

    # ---- what a server asks of the engine ----------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The engine's configuration, resolved (max_model_len from the checkpoint included)."""
        return self.engine.config

    @property
    def model_name(self) -> str:
        """The model as given (a built-in name, a folder, a Hub ID)."""
        return self.engine.config.model.model

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output, in tokens."""
        return int(self.engine.config.model.max_model_len)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a ``tokenizers.Tokenizer``), or None for a model without one."""
        return self.engine.tokenizer

    get_tokenizer = tokenizer.fget

    async def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """LLMEngine.process_prompt in a worker thread: (text or None, token ids); raises its
        TypeError / ValueError (a bad, empty or too long prompt). Allocates nothing."""
        return await asyncio.to_thread(self.engine.process_prompt, prompt)

    async def render_chat_prompt(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> dict[str, Any]:
        """LLMEngine.render_chat_prompt in a worker thread: {"prompt", "prompt_token_ids"};
        raises its TypeError / ValueError / jinja2.TemplateError. Allocates nothing."""
        return await asyncio.to_thread(
            functools.partial(
                self.engine.render_chat_prompt,
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        )

    async def check_request(
        self, prompt: PromptType, params: SamplingParams | None = None
    ) -> CheckedRequest:
        """LLMEngine.check_request in a worker thread: the prompt and params checked against
        the limits, nothing queued or allocated; generate() takes the result as it is. Raises
        TypeError / ValueError naming the field, the value and the limit."""
        return await asyncio.to_thread(self.engine.check_request, prompt, params)

    async def warm_up(self, requests: list[CheckedRequest]) -> int:
        """With warmup="job": compile the step shapes ``requests`` can reach (with the
        engine's unfinished ones), in a worker thread under the engine's lock
        (engine/job_warmup.py); returns the compilations it caused (0 otherwise)."""

        def run() -> int:
            with self.engine.exclusive():
                return warm_up_for(self.engine, requests)

        return await asyncio.to_thread(run)

    def get_stats(self) -> dict[str, Any]:
        """LLMEngine.get_stats(): the engine's counters and its plan."""
        return self.engine.get_stats()

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition of the engine's metrics, and its content type."""
        return self.metrics.render(), self.metrics.content_type

    async def generate(
        self,
        prompt: PromptType | CheckedRequest,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs as they come (``output_kind`` of its
        params: CUMULATIVE, DELTA or FINAL_ONLY); the last has ``finished`` set.

        Raises (at the first iteration, before anything is queued):
            TypeError / ValueError: a bad prompt, params, request_id or priority, or a
                request_id in use by an unfinished request.
            QueueFullError: max_waiting_requests requests already wait.
        Raises later:
            EngineError: a step failed (the request was aborted), or the engine shut down.

        A consumer that stops early (aclose(), cancellation, an error) aborts the request.
        """
        checked = self._check(prompt, sampling_params, request_id, priority)
        params = checked.params
        stream = OutputChannel(asyncio.get_running_loop(), params.output_kind, params.n)
        self._gate.submit(request_id, ("add", request_id, checked, priority, stream))
        sent = OutputDelta() if stream.kind is RequestOutputKind.DELTA else None
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if stream.kind is RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                yield out if sent is None else sent.delta(out)
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def _check(
        self,
        prompt: PromptType | CheckedRequest,
        params: SamplingParams | None,
        request_id: str,
        priority: int,
    ) -> CheckedRequest:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if isinstance(prompt, CheckedRequest):
            if params is not None:
                raise TypeError("sampling_params must be None with a CheckedRequest")
            return prompt
        return self.engine.check_request(prompt, params)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its consumer gets a final output with finish_reason "abort");
        an unknown or finished id is ignored."""
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine thread (idempotent); unfinished requests fail with EngineError. An
        engine this client built is shut down with it (LLMEngine.shutdown: its background
        warm-up, its KV connector's server and threads, ...) before this returns (called from
        the engine thread itself: as that thread ends)."""
        self._gate.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain(block=not engine.has_unfinished_requests()):
                    break
                if engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # a bug of the loop itself: nothing can be served
            logger.exception("the engine loop stopped")
            self._gate.die(e)
        error = EngineError("the engine shut down" + cause(self._gate.dead))
        engine.abort_request(list(self._streams))
        while True:  # adds queued before the sentinel (none can come after it)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command is not None and command[0] == "add":
                self._track(command[1], command[4])
        self._fail_all(error)
        if self._owns_engine:
            try:
                engine.shutdown()
            except Exception:  # logged: nothing is left to fail
                logger.exception("the engine's shutdown failed")

    def _drain(self, block: bool) -> bool:
        """Apply the inbox's commands (waiting for one when ``block``); False on shutdown."""
        changed = False
        while True:
            try:
                command = self._inbox.get(block=block and not changed)
            except queue.Empty:
                break
            if command is None:
                return False
            changed = True
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])
        if changed:
            self._observe_stats()
        return True

    def _add(self, request_id: str, checked: CheckedRequest, priority: int, stream: OutputChannel):
        self._gate.taken()
        try:
            self.engine.add_request(request_id, checked, priority=priority)
        except Exception as e:  # checked before: only an engine fault lands here
            self._end(request_id)
            stream.fail(EngineError(f"could not queue the request ({e})"))
            return
        self._track(request_id, stream)

    def _track(self, request_id: str, stream: OutputChannel) -> None:
        self._streams[request_id] = stream
        self._num_incremental += stream.kind is not RequestOutputKind.FINAL_ONLY

    def _untrack(self, request_id: str) -> OutputChannel | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_incremental -= stream.kind is not RequestOutputKind.FINAL_ONLY
        return stream

    def _abort(self, request_id: str) -> None:
        stream = self._untrack(request_id)
        if stream is None:
            return  # finished already, or never added
        self._end(request_id)
        self.metrics.observe_abort(request_id, stream.num_samples)
        for out in self.engine.abort_request(request_id):
            stream.put(out)

    def _step(self) -> None:
        try:
            # When every stream wants its final output only (a batch job), the engine skips
            # building the outputs of requests still running (their latencies are then
            # observed once, at the end).
            outputs = self.engine.step(finished_only=self._num_incremental == 0)
        except Exception as e:  # the engine aborted everything and is ready again
            self._fail_all(EngineError(f"the engine step failed ({type(e).__name__}: {e})"))
            self._observe_stats()
            return
        for out in outputs:
            self.metrics.observe_output(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._untrack(out.request_id)
                self._end(out.request_id)
            stream.put(out)
        self._observe_stats()

    def _observe_stats(self) -> None:
        stats = self.engine.get_stats(include_plan=False)
        self._gate.num_waiting = stats["num_requests_waiting"]
        self.metrics.observe_stats(stats)

    def _end(self, request_id: str) -> None:
        self._gate.end(request_id)

    def _fail_all(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        self._num_incremental = 0
        for request_id, stream in streams.items():
            self._end(request_id)
            self.metrics.observe_abort(request_id, stream.num_samples)
            stream.fail(error)
