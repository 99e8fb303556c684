"""Streaming forms of a request's outputs (SamplingParams.output_kind), shared by AsyncLLM and
LLM.stream."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from jaxserve.outputs import CompletionOutput, RequestOutput


@dataclass
class OutputDelta:
    """Turns one request's cumulative outputs into DELTA ones: each holds only the text,
    token ids and logprobs new since the previous one (texts only grow: the engine holds back
    a tail that may begin a stop string), prompt logprobs only in the first."""

    chars: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    first: bool = True  # prompt logprobs go in the first output only

    def delta(self, out: RequestOutput) -> RequestOutput:
        if not self.chars:
            self.chars = [0] * len(out.outputs)
            self.tokens = [0] * len(out.outputs)
        completions = []
        for c in out.outputs:
            i = c.index
            chars, tokens = self.chars[i], self.tokens[i]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=c.text[chars:],
                    token_ids=c.token_ids[tokens:],
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=None if c.logprobs is None else c.logprobs[tokens:],
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            self.chars[i], self.tokens[i] = len(c.text), len(c.token_ids)
        prompt_logprobs = out.prompt_logprobs if self.first else None
        self.first = False
        return replace(out, outputs=completions, prompt_logprobs=prompt_logprobs)
