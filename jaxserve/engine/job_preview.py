"""JobPreview: an offline job's requests, handed to its engine's construction so that the
shapes they can reach compile while the weights load (runner/job_startup.py).

A job warms up only what its requests can reach (engine/job_warmup.py), which it learns by
tokenizing them; when the engine's construction is told the requests, it tokenizes them with
the checkpoint's tokenizer as soon as the runner is built over the weights' shapes, and
compiles their set in the time the weights take to load. The `generate` and `score` commands
read their input before they build the engine and hand it over::

    llm = LLM(model, warmup_for=JobPreview.of(prompts, params))  # the job's shapes compile
    llm.generate(prompts, params)                                  # nothing new to compile

A preview is a head start, not a contract: a request it cannot read (a bad prompt: the job's
own check refuses it by name, after construction) is left out, and the job's warm-up compiles
whatever its checked requests reach beyond the handed set before its first step. So a preview
that differs from the job costs compile time, never a compilation on the step path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxserve.engine.job_warmup import job_set
from jaxserve.engine.prompts import PromptProcessor, PromptType
from jaxserve.runner.job_shapes import JobRequest, WarmupSet, job_request
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class PreviewRequest:
    """One request of a job, as the job will hand it to the engine."""

    prompt: PromptType  # as LLM.generate takes it (text, token ids, or a dict of either)
    params: SamplingParams
    # A scored continuation (LLM.score, `jaxserve score`): its tokens, without special tokens,
    # follow the prompt's in one request; None for a generation.
    continuation: PromptType | None = None


@dataclass(frozen=True)
class JobPreview:
    """The requests of a job that will run on the engine being built."""

    requests: tuple[PreviewRequest, ...]

    def __post_init__(self) -> None:
        for i, r in enumerate(self.requests):
            if not isinstance(r, PreviewRequest):
                raise TypeError(f"JobPreview.requests[{i}] must be a PreviewRequest, got {r!r}")
            if not isinstance(r.params, SamplingParams):
                raise TypeError(
                    f"JobPreview.requests[{i}].params must be a SamplingParams, got {r.params!r}"
                )

    @classmethod
    def of(
        cls,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> JobPreview:
        """The preview of ``LLM.generate(prompts, params)`` (one params for all, or one each).

        Raises:
            ValueError: a params list of another length than the prompts.
        """
        prompts = list(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"JobPreview.of: {len(params)} sampling params for {len(prompts)} prompts"
            )
        return cls(tuple(PreviewRequest(p, s) for p, s in zip(prompts, params, strict=True)))

    def warmup_set(
        self, runner: ModelRunner, config: EngineConfig, tokenizer: Any
    ) -> WarmupSet | None:
        """The set the readable requests reach on ``runner`` (runner/job_startup.JobSetFn):
        each tokenized as LLMEngine.check_request tokenizes it, with ``tokenizer`` (the
        checkpoint's TokenizerInfo); None when no request can be read."""
        model = config.model
        prompts = PromptProcessor(tokenizer, runner.vocab_size, model.max_model_len, model.model)
        jobs = [j for r in self.requests if (j := read_request(prompts, r)) is not None]
        if len(jobs) < len(self.requests):
            logger.info(
                "warm-up at construction: %d of the handed job's %d requests cannot be read; "
                "left out (the job's own check names them)",
                len(self.requests) - len(jobs),
                len(self.requests),
            )
        return job_set(config, runner, jobs) if jobs else None


def check_warmup_for(preview: JobPreview | None, config: EngineConfig) -> None:
    """Refuse a ``warmup_for`` that is not a JobPreview, or that the engine's warm-up setting
    cannot honour (LLMEngine's).

    Raises:
        TypeError: not a JobPreview.
        ValueError: warmup is not "job".
    """
    if preview is None:
        return
    if not isinstance(preview, JobPreview):
        raise TypeError(f"warmup_for must be a JobPreview, got {type(preview).__name__}")
    if config.runner.warmup != "job":
        raise ValueError(
            f"warmup_for needs warmup='job' (a job's shapes compiled at construction), got "
            f"warmup={config.runner.warmup!r}"
        )


def read_request(prompts: PromptProcessor, request: PreviewRequest) -> JobRequest | None:
    """The request's JobRequest, or None when it cannot be read (the job's check names it)."""
    try:
        params = request.params.clone()
        _, ids = prompts.process(request.prompt)
        num_tokens = len(ids)
        if request.continuation is not None:
            _, more = prompts.process(request.continuation, add_special_tokens=False)
            num_tokens += len(more)
    except (TypeError, ValueError):
        return None
    # StructuredOutputs.check gives a per-step mask to a grammar and to bad words (bad words
    # that tokenize to nothing get none: a variant more than needed, never one less).
    has_step_mask = params.structured_outputs is not None or bool(params.bad_words)
    return job_request(num_tokens, params, has_step_mask)
