"""Outputs: what the runner hands the scheduler, and what the engine hands the user."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, as in vLLM: its value, its rank in the distribution (1 =
    most likely) and its decoded text when a tokenizer is present."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the sampled (or prompt) token plus the top-N.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # first prompt token has no logprob: None


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position, straight from the device.

    token_ids: [1 + N] the sampled (or prompt) token first, then the top-N in order.
    logprobs: [1 + N] matching log-probabilities.
    ranks: [1 + N] rank of each token (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """ModelRunner -> Scheduler hand-off of one step.

    req_ids: requests that sampled this step, in batch order (a request in mid-prefill, whose
        chunk does not reach the end of its prompt, samples nothing and is absent).
    sampled_token_ids: [len(req_ids)][tokens sampled this step] (one each, unless multi-step).
    logprobs: req_id -> one TokenLogprobs per sampled token, for requests that asked.
    prompt_logprobs: req_id -> TokenLogprobs for each prompt token computed this step whose
        logprob is known (the token after each computed position), for requests that asked.
    kv_loads: req_id -> blocks written, for each asynchronous KV connector load the runner
        finished this step (fewer than the job's blocks: the store lacked the next one).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    kv_loads: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """Scheduler -> LLMEngine: what one request gained this step.

    finish_reason: None while running; "stop" (EOS, stop token, stop string), "length"
        (max_tokens or max_model_len), "abort", or "error" (its promised KV could not be
        loaded and kv_load_failure_policy is "fail").
    stop_reason: the stop token id that ended it, if any; for "error", why.
    kv_transfer_params: a finished prefill's (kv_transfer_params do_remote_decode) answer to
        pass to its decode request (the KV connector's producer_params), else None.
    """

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One sampled completion of a request (index < SamplingParams.n)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to one request, in time.monotonic() seconds (vLLM's names);
    None until they happen."""

    arrival_time: float  # the engine queued it
    first_scheduled_time: float | None = None  # its first step began (queue time ends)
    first_token_time: float | None = None  # its first output token came back
    last_token_time: float | None = None  # its latest output token came back
    finished_time: float | None = None  # its last sample finished
    num_generation_tokens: int = 0  # output tokens so far, over all samples

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the user gets back for one prompt (vLLM's names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # A finished prefill's kv_transfer_params for its decode request (vLLM's), else None.
    kv_transfer_params: dict | None = None
