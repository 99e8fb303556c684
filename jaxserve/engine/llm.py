"""LLM: vLLM's offline API (generate / chat / score) over an LLMEngine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxserve.engine.interrupts import InterruptGuard, defer_sigint
from jaxserve.engine.job_warmup import warm_up_for
from jaxserve.engine.llm_engine import CheckedRequest, LLMEngine
from jaxserve.engine.prompts import PromptType
from jaxserve.engine.scoring import SCORE_PARAMS, check_pairs, continuation_logprobs
from jaxserve.engine.streaming import OutputDelta
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (str, list of int, dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise TypeError(
        f"prompts must be a str, a list of int, a dict, or a list of these; "
        f"got {type(prompts).__name__}"
    )


class LLM:
    """An offline engine: ``LLM(model=...).generate(prompts, sampling_params)``.

    Keyword arguments are those of docs/architecture.md (dtype, max_model_len, block_size,
    num_kv_blocks, memory_utilization, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, attention_backend, tensor_parallel_size, seed, ...); an unknown one
    raises TypeError. ``warmup`` defaults to "job": each generate / stream / chat / score call
    first compiles the step shapes its requests can reach (engine/job_warmup.py), not every
    bucket the limits allow; True compiles them all at construction, as a server does.
    """

    def __init__(self, model: str = "tiny-random-llama", **kwargs: Any) -> None:
        kwargs.setdefault("warmup", "job")
        if kwargs.get("enable_background_warmup"):
            raise ValueError(
                "LLM(enable_background_warmup=True): an offline LLM warms up before its work; "
                "serving before warm-up ends is for servers (AsyncLLM, `jaxserve serve`)"
            )
        self.engine = LLMEngine(model=model, **kwargs)
        self._counter = itertools.count()
        # Requests of stream() calls, and their outputs stepped by another call (a generate()
        # or stream() of another thread steps every request): taken by their own call.
        self._streaming: set[str] = set()
        self._mailbox: dict[str, RequestOutput] = {}

    def warm_up(self, requests: Sequence[CheckedRequest]) -> int:
        """Compile (and run once) the step shapes that ``requests`` (LLMEngine.check_request)
        can reach, as generate() and stream() do first with warmup="job": a job calls it to
        keep the compilations out of its timed run. Returns the compilations it caused."""
        with self.engine.exclusive():
            return warm_up_for(self.engine, requests)

    def shutdown(self) -> None:
        """Stop the engine's threads and servers (LLMEngine.shutdown); idempotent. The LLM
        takes no request afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (LLMEngine.reset_prefix_cache); False while requests
        of another thread are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order.

        Every prompt and every SamplingParams is validated before any request is queued, so a
        bad one raises without side effects; the message starts with the prompt's index.

        Calls from several threads run one after another (the engine's lock is held for the
        whole call). If the call raises, Ctrl-C included, its requests are aborted and their
        blocks freed: the LLM stays usable.

        Raises:
            TypeError / ValueError: a bad prompt or SamplingParams ("prompts[i]: ...").
        """
        checked = self._check_all(prompts, sampling_params)
        engine = self.engine
        request_ids = [str(next(self._counter)) for _ in checked]
        # Ctrl-C is held to the next safe point (interrupts.py), and never interrupts the
        # abort that it triggers.
        with engine.exclusive():
            warm_up_for(engine, checked)  # before Ctrl-C is deferred: it may take a while
            with defer_sigint() as interrupt:
                try:
                    for rid, request in zip(request_ids, checked, strict=True):
                        engine.add_request(rid, request)
                    return self._run(request_ids, use_tqdm, interrupt)
                except BaseException:
                    engine.abort_request(request_ids)
                    raise

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
    ) -> Iterator[RequestOutput]:
        """generate() as a generator, for notebooks: yields RequestOutputs as the engine steps,
        the requests interleaved as they progress, each in the form of its params'
        ``output_kind`` (CUMULATIVE: everything so far; DELTA: only what is new; FINAL_ONLY:
        the finished output only)::

            params = SamplingParams(max_tokens=64, output_kind=RequestOutputKind.DELTA)
            for out in llm.stream("Once upon a time", params):
                print(out.outputs[0].text, end="", flush=True)

        Every prompt and params is checked before anything is queued (as generate()). Closing
        the generator early (break, an error, Ctrl-C) aborts its unfinished requests. Calls
        from other threads may run at the same time: each call gets its own outputs.

        Args:
            request_ids: the outputs' request ids, one per prompt (a job's own ids); default:
                the LLM's counter, as generate().

        Raises:
            TypeError / ValueError: a bad prompt or SamplingParams ("prompts[i]: ..."), bad or
                repeated request ids, or an id in use by an unfinished request.
            RuntimeError: the requests were aborted by another caller.
        """
        checked = self._check_all(prompts, sampling_params)
        engine = self.engine
        request_ids = self._request_ids(request_ids, len(checked))
        with engine.exclusive():
            warm_up_for(engine, checked)
            with defer_sigint():
                try:
                    for rid, request in zip(request_ids, checked, strict=True):
                        engine.add_request(rid, request)
                except BaseException:
                    engine.abort_request(request_ids)
                    raise
                self._streaming.update(request_ids)
        kinds = {rid: c.params.output_kind for rid, c in zip(request_ids, checked, strict=True)}
        deltas = {rid: OutputDelta() for rid, k in kinds.items() if k is RequestOutputKind.DELTA}
        try:
            while kinds:
                for out in self._next_outputs(kinds):
                    rid = out.request_id
                    if out.finished:
                        del kinds[rid]
                    elif kinds[rid] is RequestOutputKind.FINAL_ONLY:
                        continue
                    yield deltas[rid].delta(out) if rid in deltas else out
        finally:
            with engine.exclusive(), defer_sigint():
                engine.abort_request(list(kinds))
                for rid in request_ids:
                    self._streaming.discard(rid)
                    self._mailbox.pop(rid, None)

    def _request_ids(self, given: Sequence[str] | None, n: int) -> list[str]:
        if given is None:
            return [str(next(self._counter)) for _ in range(n)]
        ids = list(given)
        if len(ids) != n:
            raise ValueError(f"request_ids has {len(ids)} entries but there are {n} prompts")
        for i, rid in enumerate(ids):
            if not isinstance(rid, str):
                raise TypeError(f"request_ids[{i}] must be a str, got {rid!r}")
        if len(set(ids)) != n:
            repeated = next(rid for rid in ids if ids.count(rid) > 1)
            raise ValueError(f"request_ids must be unique; {repeated!r} repeats")
        return ids

    def _next_outputs(self, pending: dict[str, Any]) -> list[RequestOutput]:
        """The next outputs of ``pending`` requests: from the mailbox, or from one step (whose
        outputs of other stream() calls go to the mailbox)."""
        engine = self.engine
        with engine.exclusive(), defer_sigint() as interrupt:
            mine = [self._mailbox.pop(rid) for rid in pending if rid in self._mailbox]
            if mine:
                self._streaming.difference_update(o.request_id for o in mine if o.finished)
                return mine
            if not engine.has_unfinished_requests():
                raise RuntimeError(
                    f"{len(pending)} requests of this stream() were aborted by another caller"
                )
            # Only finished outputs are needed when every request of the stream() calls
            # under way wants its final output only: skip building the others.
            final_only = len(self._streaming) == len(pending) and all(
                kind is RequestOutputKind.FINAL_ONLY for kind in pending.values()
            )
            for out in engine.step(finished_only=final_only):
                if out.request_id in pending:
                    mine.append(out)
                elif out.request_id in self._streaming:
                    self._mailbox[out.request_id] = out
            for out in mine:
                if out.finished:
                    self._streaming.discard(out.request_id)
            interrupt.check()
        return mine

    def _check_all(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[CheckedRequest]:
        """Every prompt and its params checked, or the first failure ("prompts[i]: ...")."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        checked = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            try:
                checked.append(self.engine.check_request(prompt, params))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        return checked

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries but there are {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {p!r}")
        return params

    def _run(
        self, request_ids: list[str], use_tqdm: bool, interrupt: InterruptGuard
    ) -> list[RequestOutput]:
        """Step the engine until every request of ``request_ids`` has finished."""
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while pending:
                interrupt.check()
                streaming = self._streaming
                for out in self.engine.step(finished_only=not streaming):
                    if out.request_id not in pending:
                        if out.request_id in streaming:  # a stream() call's: its mailbox
                            self._mailbox[out.request_id] = out
                        continue  # else a request added to the engine directly
                    if not out.finished:
                        continue
                    pending.discard(out.request_id)
                    finished[out.request_id] = out
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"in: {num_in / elapsed:.1f} tok/s, out: {num_out / elapsed:.1f} tok/s",
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.engine.render_chat_prompt(
                conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def score(
        self,
        prompts: Sequence[PromptType],
        continuations: Sequence[PromptType],
        use_tqdm: bool = False,
    ) -> list[float]:
        """Total log-probability of each continuation given its prompt (batch scoring).

        Each pair is run as one prompt (prompt tokens + continuation tokens) with
        prompt_logprobs; the continuation's token logprobs are summed. A text continuation is
        tokenized without special tokens (no BOS of its own: it continues the prompt).

        Raises:
            TypeError / ValueError: a bad prompt or continuation, or a pair longer than
                max_model_len ("pairs[i]: ...").
        """
        pairs = check_pairs(self.engine, prompts, continuations)
        outs = self.generate([p.token_ids for p in pairs], SCORE_PARAMS, use_tqdm)
        return [
            sum(continuation_logprobs(out, p.num_prompt_tokens))
            for out, p in zip(outs, pairs, strict=True)
        ]
