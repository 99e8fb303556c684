"""Per-request output state of the LLMEngine: text, tokens, logprobs of each completion.

One RequestState per user request; it owns one _CompletionState per sample (n > 1 fans out
into n scheduler requests, whose ids the engine makes: engine/fan_out.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    TokenLogprobs,
)
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams


def to_logprob_dict(entry: TokenLogprobs, tokenizer) -> dict[int, Logprob]:
    """TokenLogprobs (sampled/prompt token first, then top-N) as vLLM's {token_id: Logprob}."""
    out: dict[int, Logprob] = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True):
        if token_id not in out:
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else None
            out[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=text)
    return out


@dataclass
class _CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        detok = self.detokenizer
        return CompletionOutput(
            index=self.index,
            # While running, the tail that may begin a stop string is held back: every text
            # handed out is a prefix of the final one (streams can send differences).
            text=detok.get_next_output_text(finished=detok.finished, delta=False),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """Everything the engine accumulates for one user request until it finishes."""

    def __init__(
        self,
        request_id: str,
        engine_ids: list[str],
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        requests: list[Request],
        arrival_time: float,
    ) -> None:
        self.request_id = request_id  # the user's id
        self.requests = requests  # the scheduler's requests, by index (read for their times)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.engine_ids = engine_ids  # the scheduler's id of each sample, by index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.completions = [
            _CompletionState(
                index=i,
                detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                want_logprobs=params.logprobs is not None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None  # a finished prefill's, for its decode

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def apply(self, index: int, out: EngineCoreOutput) -> str | None:
        """Fold one EngineCoreOutput into completion `index`; return a stop string that the
        text just matched (the caller ends the request in the scheduler), else None."""
        c = self.completions[index]
        if index == 0:
            self.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                self.kv_transfer_params = out.kv_transfer_params
        if out.new_token_ids:
            m = self.metrics
            m.last_token_time = now = time.monotonic()
            if m.first_token_time is None:
                m.first_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(
                to_logprob_dict(e, self.tokenizer) for e in out.new_prompt_logprobs
            )
        c.token_ids.extend(out.new_token_ids)
        if c.want_logprobs and out.new_logprobs:
            for entry in out.new_logprobs:
                c.logprobs.append(to_logprob_dict(entry, self.tokenizer))
                c.cumulative_logprob += entry.logprobs[0]
        if c.finish_reason is not None:
            return None
        stop = c.detokenizer.update(out.new_token_ids, finished=out.finished)
        if stop is not None:
            c.finish_reason, c.stop_reason = "stop", stop
            return stop
        if out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return None

    def abort(self) -> None:
        for c in self.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"

    def output(self) -> RequestOutput:
        m = self.metrics
        if m.first_scheduled_time is None:
            times = [r.first_scheduled_time for r in self.requests]
            m.first_scheduled_time = min((t for t in times if t is not None), default=None)
        finished = self.finished
        if finished and m.finished_time is None:
            m.finished_time = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[c.output() for c in self.completions],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=replace(m),
            kv_transfer_params=self.kv_transfer_params,
        )
